from __future__ import annotations

import os

import torch

from simpletuner.data.cache import TensorCache, fill_latent_cache, fill_text_cache, latent_key, text_key
from simpletuner.data.discovery import Sample
from simpletuner.models.base import TextEmbedding


class CountingAdapter:
    def __init__(self):
        self.images = 0
        self.prompts = 0

    def vae_cache_identity(self):
        return "vae-v1"

    def text_cache_identity(self):
        return "te-v1"

    def encode_images(self, pixels):
        self.images += len(pixels)
        return pixels[:, :1, ::8, ::8].clone()

    def latent_cache_entries(self, pixels):
        return [{"latents": latent} for latent in self.encode_images(pixels)]

    def encode_prompts(self, prompts):
        self.prompts += len(prompts)
        return [TextEmbedding({"prompt_embeds": torch.full((2, 3), float(len(p)))}) for p in prompts]


def make_sample(path, size=(64, 64)):
    from PIL import Image

    Image.new("RGB", size, (10, 20, 30)).save(path)
    st = os.stat(path)
    return Sample("ds", str(path), "cap", size, size, (0, 0, *size), file_size=st.st_size, mtime_ns=st.st_mtime_ns)


def test_keys_follow_identity_not_position(tmp_path):
    s = make_sample(tmp_path / "a.png")
    assert latent_key(s, "vae-v1") == latent_key(s, "vae-v1")
    assert latent_key(s, "vae-v1") != latent_key(s, "vae-v2")
    moved = Sample(**{**s.__dict__, "mtime_ns": s.mtime_ns + 1})
    assert latent_key(moved, "vae-v1") != latent_key(s, "vae-v1")
    cropped = Sample(**{**s.__dict__, "crop_box": (1, 0, 65, 64)})
    assert latent_key(cropped, "vae-v1") != latent_key(s, "vae-v1")
    assert text_key("a", "te") != text_key("b", "te") != text_key("a", "te2")


def test_fill_encodes_only_missing_entries(tmp_path):
    adapter = CountingAdapter()
    samples = [make_sample(tmp_path / f"{i}.png") for i in range(3)]
    cache_dir = tmp_path / "vae"
    assert fill_latent_cache({str(cache_dir): samples}, adapter, 2, show_progress=False) == 3
    assert fill_latent_cache({str(cache_dir): samples}, adapter, 2, show_progress=False) == 0
    assert adapter.images == 3
    cache = TensorCache(cache_dir)
    stored = cache.load(latent_key(samples[0], "vae-v1"))["latents"]
    assert stored.shape == (1, 8, 8)
    assert not list(cache_dir.rglob(".tmp-*"))

    text = TensorCache(tmp_path / "text")
    assert fill_text_cache(["a", "bb", "a"], adapter, text, 8, show_progress=False) == 2
    assert fill_text_cache(["a", "bb", "ccc"], adapter, text, 8, show_progress=False) == 1
    assert text.load(text_key("bb", "te-v1"))["prompt_embeds"][0, 0] == 2.0


# ---- damaged entries (issue 15) -------------------------------------------------------------------------------
def test_a_damaged_entry_is_encoded_again_and_named(tmp_path, caplog):
    adapter = CountingAdapter()
    samples = [make_sample(tmp_path / f"{i}.png") for i in range(3)]
    cache_dir = tmp_path / "cache"
    assert fill_latent_cache({str(cache_dir): samples}, adapter, batch_size=2, show_progress=False) == 3
    cache = TensorCache(cache_dir)
    damaged = cache.path(latent_key(samples[1], "vae-v1"))
    damaged.write_bytes(damaged.read_bytes()[:30])  # cut short, as by a crash or a full disk
    garbled = cache.path(latent_key(samples[2], "vae-v1"))
    garbled.write_bytes(b"\xff" * 64)
    with caplog.at_level("WARNING"):
        assert fill_latent_cache({str(cache_dir): samples}, adapter, batch_size=2, show_progress=False) == 2
    assert str(damaged) in caplog.text and str(garbled) in caplog.text
    assert adapter.images == 5
    assert cache.load(latent_key(samples[1], "vae-v1"))["latents"].shape[0] == 1


def test_an_entry_damaged_mid_run_is_a_clear_error_naming_it(tmp_path):
    from simpletuner.data.cache import CacheEntryDamaged
    from simpletuner.data.discovery import DatasetError

    cache = TensorCache(tmp_path)
    key = text_key("a cat", "te-v1")
    cache.save(key, {"prompt_embeds": torch.ones(2, 3)})
    cache.path(key).write_bytes(b"\x00" * 10)
    try:
        cache.load(key)
    except CacheEntryDamaged as exc:
        assert str(cache.path(key)) in str(exc)
        assert isinstance(exc, DatasetError)  # the CLI prints it as one line, no traceback
    else:
        raise AssertionError("a damaged entry loaded")
