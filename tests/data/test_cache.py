from __future__ import annotations

import os

import pytest
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


def make_sample(path, size=(64, 64), color=(10, 20, 30)):
    from PIL import Image

    Image.new("RGB", size, color).save(path)
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


# ---- what mutation testing found unguarded (docs/testing.md) ---------------------------------------------------
def test_a_clips_frames_are_part_of_its_key(tmp_path):
    s = make_sample(tmp_path / "a.png")
    clip = Sample(**{**s.__dict__, "frame_indices": (0, 1, 2)})
    other = Sample(**{**s.__dict__, "frame_indices": (0, 2, 4)})
    assert len({latent_key(s, "v"), latent_key(clip, "v"), latent_key(other, "v")}) == 3
    assert latent_key(clip, "v") == latent_key(Sample(**{**clip.__dict__}), "v")


def test_entries_are_sharded_by_the_keys_first_two_characters(tmp_path):
    cache = TensorCache(tmp_path)
    key = text_key("a", "te")
    assert cache.path(key) == tmp_path / key[:2] / f"{key}.safetensors"


def test_a_save_writes_a_temp_file_beside_the_entry_and_leaves_nothing_when_it_fails(tmp_path, monkeypatch):
    import simpletuner.data.cache as cache_module

    cache = TensorCache(tmp_path)
    key = text_key("a", "te")
    seen = []
    real = cache_module.save_file

    def recording(tensors, filename):
        seen.append(filename)
        return real(tensors, filename)

    monkeypatch.setattr(cache_module, "save_file", recording)
    cache.save(key, {"x": torch.ones(2)})
    (tmp,) = seen
    assert os.path.dirname(tmp) == str(cache.path(key).parent)  # same folder: the rename is atomic
    # a crash's leftover is a hidden temp file, never taken for an entry (<key>.safetensors)
    assert os.path.basename(tmp).startswith(".tmp-") and tmp.endswith(".safetensors")
    assert not os.path.exists(tmp) and cache.has(key)

    def failing(tensors, filename):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(cache_module, "save_file", failing)
    other = text_key("b", "te")
    try:
        cache.save(other, {"x": torch.ones(2)})
    except OSError:
        pass
    else:
        raise AssertionError("the failing save did not raise")
    assert not [p for p in tmp_path.rglob(".tmp-*")] and not cache.path(other).exists()


def test_a_server_job_never_writes_a_cache_outside_its_roots(tmp_path, monkeypatch):
    from simpletuner.config import paths

    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    monkeypatch.setenv(paths.ROOTS_ENV, paths.roots_env_value([inside]))
    TensorCache(inside).save(text_key("a", "te"), {"x": torch.ones(1)})
    try:
        TensorCache(outside).save(text_key("a", "te"), {"x": torch.ones(1)})
    except paths.PathOutsideRoots as exc:
        assert exc.field == "cache" and str(outside) in exc.message
    else:
        raise AssertionError("wrote outside the roots")
    assert not list(outside.rglob("*.safetensors"))


def test_damaged_entries_are_removed_with_a_warning_and_named_on_load(tmp_path, caplog):
    from simpletuner.data.cache import CacheEntryDamaged

    cache = TensorCache(tmp_path)
    key = text_key("a", "te")
    cache.save(key, {"x": torch.ones(2)})
    cache.path(key).write_bytes(b"\x00" * 10)
    with caplog.at_level("WARNING", logger="simpletuner.cache"):
        assert cache.has(key) is False
    assert caplog.messages == [f"{cache.path(key)}: damaged cache entry; encoding it again"]
    assert not cache.path(key).exists() and cache.has(key) is False
    cache.path(key).write_bytes(b"\x00" * 10)
    try:
        cache.load(key)
    except CacheEntryDamaged as exc:
        assert str(exc).startswith(f"{cache.path(key)}: cache entry cannot be read (")
        assert str(exc).endswith("it is encoded again when the run is started again (Retry)")
    else:
        raise AssertionError("a damaged entry loaded")


class BatchRecordingAdapter(CountingAdapter):
    def __init__(self):
        super().__init__()
        self.batches = []

    def latent_cache_entries(self, pixels):
        self.batches.append(tuple(pixels.shape))
        return super().latent_cache_entries(pixels)


def test_batches_hold_one_bucket_and_at_most_batch_size(tmp_path):
    adapter = BatchRecordingAdapter()
    square = [make_sample(tmp_path / f"s{i}.png", (64, 64)) for i in range(5)]
    wide = [make_sample(tmp_path / f"w{i}.png", (96, 64)) for i in range(2)]
    assert fill_latent_cache({str(tmp_path / "c"): square + wide + square[:2]}, adapter, 2,
                             show_progress=False) == 7  # the repeated samples are encoded once
    assert sorted(adapter.batches) == sorted([(2, 3, 64, 64), (2, 3, 64, 64), (1, 3, 64, 64), (2, 3, 64, 96)])


def test_an_unreadable_image_is_named_or_collected(tmp_path):
    import pytest

    good = make_sample(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    bad = Sample(**{**good.__dict__, "path": str(tmp_path / "bad.png")})
    with pytest.raises(ValueError, match=f"{tmp_path / 'bad.png'}: cannot be decoded"):
        fill_latent_cache({str(tmp_path / "c1"): [bad, good]}, CountingAdapter(), 4, show_progress=False)
    unreadable = []
    assert fill_latent_cache({str(tmp_path / "c2"): [bad, good]}, CountingAdapter(), 4, show_progress=False,
                             unreadable=unreadable) == 1
    assert [(s.path, why.split(":")[0]) for s, why in unreadable] == [(str(tmp_path / "bad.png"), "cannot be decoded")]


def test_masks_are_cached_at_latent_resolution_once(tmp_path):
    from PIL import Image

    from simpletuner.data.cache import fill_mask_cache, mask_key

    Image.new("L", (64, 32), 0).save(tmp_path / "m.png")
    img = Image.open(tmp_path / "m.png")
    img.paste(255, (0, 0, 32, 32))
    img.save(tmp_path / "m.png")
    st = os.stat(tmp_path / "m.png")
    mask = Sample("ds", str(tmp_path / "m.png"), "", (64, 32), (64, 32), (0, 0, 64, 32), file_size=st.st_size,
                  mtime_ns=st.st_mtime_ns)
    assert mask_key(mask, 8) != mask_key(mask, 16) and mask_key(mask, 8) != latent_key(mask, "mask/16")
    assert mask_key(mask, 8) == latent_key(mask, "mask/8")
    folder = tmp_path / "masks"
    assert fill_mask_cache({str(folder): [mask, mask]}, 8, show_progress=False) == 1
    assert fill_mask_cache({str(folder): [mask]}, 8, show_progress=False) == 0
    stored = TensorCache(folder).load(mask_key(mask, 8))["mask"]
    assert stored.shape == (1, 4, 8)  # (1, h / 8, w / 8)
    assert torch.allclose(stored[0, :, :4], torch.ones(4, 4)) and torch.allclose(stored[0, :, 4:], torch.zeros(4, 4))
    assert fill_mask_cache({str(folder): [mask]}, 16, show_progress=False) == 1  # another VAE scale: another entry


def test_negative_prompts_have_their_own_identity(tmp_path):
    from simpletuner.data.cache import negative_identity

    class NegativeAdapter(CountingAdapter):
        def encode_negative_prompts(self, prompts):
            return [TextEmbedding({"prompt_embeds": torch.full((2, 3), -1.0)}) for _ in prompts]

    adapter, cache = NegativeAdapter(), TensorCache(tmp_path)
    assert negative_identity("te-v1") == "te-v1|negative"
    assert fill_text_cache(["blurry"], adapter, cache, 4, show_progress=False, negative=True) == 1
    assert fill_text_cache(["blurry"], adapter, cache, 4, show_progress=False) == 1  # the positive one is apart
    assert cache.load(text_key("blurry", "te-v1|negative"))["prompt_embeds"][0, 0] == -1.0
    assert cache.load(text_key("blurry", "te-v1"))["prompt_embeds"][0, 0] == 6.0


def test_a_bucket_of_only_unreadable_images_does_not_stop_the_next_bucket(tmp_path):
    good = make_sample(tmp_path / "good.png", (96, 64))
    bad_file = make_sample(tmp_path / "bad.png", (64, 64))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    unreadable, progress = [], []
    adapter = BatchRecordingAdapter()
    assert fill_latent_cache({str(tmp_path / "c"): [good, bad_file]}, adapter, 4, show_progress=False,
                             unreadable=unreadable, on_progress=lambda *done_total: progress.append(done_total)) == 1
    assert adapter.batches == [(1, 3, 64, 96)] and [s.path for s, _ in unreadable] == [bad_file.path]
    assert progress == [(2, 2)]  # the unreadable file counts as done: progress reaches its total


def test_each_entry_holds_its_own_samples_latent_and_each_batch_is_reported(tmp_path):
    from simpletuner.data.discovery import load_pixels

    adapter = CountingAdapter()
    samples = [make_sample(tmp_path / f"{i}.png", color=(40 * i, 20, 30)) for i in range(5)]
    progress, saved = [], []
    assert fill_latent_cache({str(tmp_path / "c"): samples}, adapter, 2, show_progress=False,
                             on_progress=lambda done, total: progress.append((done, total)),
                             on_saved=saved.append) == 5
    assert progress == [(2, 5), (4, 5), (5, 5)]
    keys = [latent_key(s, "vae-v1") for s in samples]
    assert sorted(saved) == sorted(keys) and len(set(keys)) == 5
    cache = TensorCache(tmp_path / "c")
    for sample, key in zip(samples, keys):  # batched, yet every file holds the latent of its own sample
        assert torch.equal(cache.load(key)["latents"], adapter.encode_images(load_pixels(sample)[None])[0])


def test_a_sample_in_two_caches_is_written_to_each(tmp_path):
    sample = make_sample(tmp_path / "a.png")
    adapter = CountingAdapter()
    folders = [str(tmp_path / "one"), str(tmp_path / "two")]
    assert fill_latent_cache({f: [sample] for f in folders}, adapter, 4, show_progress=False) == 2
    assert all(TensorCache(f).has(latent_key(sample, "vae-v1")) for f in folders)


def test_reference_latents_are_encoded_by_the_reference_encoder_under_its_identity(tmp_path):
    class ReferenceAdapter(CountingAdapter):
        def reference_cache_identity(self):
            return "ref-v1"

        def encode_references(self, pixels):
            return torch.full((len(pixels), 2, 2), 7.0)

    sample = make_sample(tmp_path / "ref.png")
    adapter = ReferenceAdapter()
    assert fill_latent_cache({str(tmp_path / "c"): [sample]}, adapter, 4, show_progress=False, references=True) == 1
    assert adapter.images == 0  # not the VAE's latent-cache entries
    cache = TensorCache(tmp_path / "c")
    assert not cache.has(latent_key(sample, "vae-v1"))
    assert torch.equal(cache.load(latent_key(sample, "ref-v1"))["latents"], torch.full((2, 2), 7.0))


def test_ranks_share_the_latent_and_mask_entries_without_overlap(tmp_path):
    from simpletuner.data.cache import fill_mask_cache, mask_key

    samples = [make_sample(tmp_path / f"{i}.png", color=(40 * i, 0, 0)) for i in range(5)]
    folder = str(tmp_path / "c")
    saved = {rank: [] for rank in (0, 1)}
    counts = [fill_latent_cache({folder: samples}, CountingAdapter(), 2, show_progress=False, shard=(rank, 2),
                                on_saved=saved[rank].append) for rank in (0, 1)]
    assert counts == [3, 2] and not set(saved[0]) & set(saved[1])
    assert set(saved[0]) | set(saved[1]) == {latent_key(s, "vae-v1") for s in samples}
    assert fill_latent_cache({folder: samples}, CountingAdapter(), 2, show_progress=False) == 0  # all there
    fresh = str(tmp_path / "fresh")  # shares are cut before cached entries are left out
    fill_latent_cache({fresh: samples[1:2]}, CountingAdapter(), 2, show_progress=False)
    assert [fill_latent_cache({fresh: samples}, CountingAdapter(), 2, show_progress=False, shard=(rank, 2))
            for rank in (0, 1)] == [3, 1]
    masks = str(tmp_path / "masks")
    assert [fill_mask_cache({masks: samples}, 8, show_progress=False, shard=(rank, 2)) for rank in (0, 1)] == [3, 2]
    assert all(TensorCache(masks).has(mask_key(s, 8)) for s in samples)


class PromptRecordingAdapter(CountingAdapter):
    def __init__(self):
        super().__init__()
        self.calls = []

    def encode_prompts(self, prompts):
        self.calls.append(list(prompts))
        return super().encode_prompts(prompts)


def test_captions_are_encoded_once_in_batches_each_under_its_own_key(tmp_path):
    adapter, cache = PromptRecordingAdapter(), TensorCache(tmp_path)
    captions = ["ccc", "a", "eeeee", "a", "bb", "dddd"]
    progress = []
    assert fill_text_cache(captions, adapter, cache, 2, show_progress=False,
                           on_progress=lambda done, total: progress.append((done, total))) == 5
    assert adapter.calls == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]  # by caption, batch_size at a time
    assert progress == [(2, 5), (4, 5), (5, 5)]
    for caption in set(captions):  # the stand-in encoder fills a caption's embedding with its length
        assert cache.load(text_key(caption, "te-v1"))["prompt_embeds"][0, 0] == len(caption)
    assert fill_text_cache(captions + ["ffffff"], adapter, cache, 2, show_progress=False) == 1
    assert adapter.calls[-1] == ["ffffff"]


def test_ranks_share_the_captions_without_overlap(tmp_path):
    captions = ["a", "bb", "ccc", "dddd", "eeeee"]
    adapters = [PromptRecordingAdapter() for _ in range(2)]
    cache = TensorCache(tmp_path)
    assert [fill_text_cache(captions, adapters[rank], cache, 8, show_progress=False, shard=(rank, 2))
            for rank in (0, 1)] == [3, 2]
    assert adapters[0].calls == [["a", "ccc", "eeeee"]] and adapters[1].calls == [["bb", "dddd"]]
    # shares are cut before the cached captions are left out: an entry already there does not move another's share
    cache = TensorCache(tmp_path / "fresh")
    fill_text_cache(["bb"], PromptRecordingAdapter(), cache, 8, show_progress=False)
    adapters = [PromptRecordingAdapter() for _ in range(2)]
    assert [fill_text_cache(captions, adapters[rank], cache, 8, show_progress=False, shard=(rank, 2))
            for rank in (0, 1)] == [3, 1]
    assert adapters[0].calls == [["a", "ccc", "eeeee"]] and adapters[1].calls == [["dddd"]]


class ReferencePromptAdapter(CountingAdapter):
    """A family whose prompt embedding sees the image it edits: the stand-in adds the image's mean to each value."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def encode_text(self, prompts, pixels, negative=False):
        self.calls.append((list(prompts), [round(float(p.mean()), 4) for p in pixels], negative))
        return [TextEmbedding({"prompt_embeds": torch.full((2, 3), len(p) + float(x.mean()))})
                for p, x in zip(prompts, pixels)]


def test_captions_are_encoded_with_their_reference_images_one_entry_per_pair(tmp_path):
    from simpletuner.data.discovery import load_pixels

    dark, light = make_sample(tmp_path / "dark.png", color=(0, 0, 0)), make_sample(tmp_path / "light.png",
                                                                                   color=(255, 255, 255))
    means = {s.path: round(float(load_pixels(s).mean()), 4) for s in (dark, light)}
    assert means[dark.path] != means[light.path]
    adapter, cache = ReferencePromptAdapter(), TensorCache(tmp_path / "text")
    captions, references = ["make it red", "make it red", "flip", "flip"], [dark, light, dark, dark]
    assert fill_text_cache(captions, adapter, cache, 2, show_progress=False, references=references) == 3
    keys = {(c, r.path): text_key(c, "te-v1", r) for c, r in zip(captions, references)}
    assert len(set(keys.values())) == 3 and text_key("flip", "te-v1") not in keys.values()
    # batches by caption (then key), each caption with its own reference's pixels
    red = sorted([("make it red", dark), ("make it red", light)], key=lambda cr: keys[(cr[0], cr[1].path)])
    assert adapter.calls == [(["flip", red[0][0]], [means[dark.path], means[red[0][1].path]], False),
                             ([red[1][0]], [means[red[1][1].path]], False)]
    for (caption, path), key in keys.items():
        assert cache.load(key)["prompt_embeds"][0, 0] == pytest.approx(len(caption) + means[path])
    assert fill_text_cache(captions, adapter, cache, 2, show_progress=False, references=references) == 0
    assert fill_text_cache(["flip"], adapter, cache, 2, show_progress=False, references=[dark], negative=True) == 1
    assert adapter.calls[-1] == (["flip"], [means[dark.path]], True)
    assert cache.has(text_key("flip", "te-v1|negative", dark))


def test_progress_bars_show_by_default_and_only_when_there_is_work(tmp_path, capsys):
    from simpletuner.data.cache import fill_mask_cache

    samples = [make_sample(tmp_path / f"{i}.png", color=(i, 0, 0)) for i in range(3)]
    adapter = CountingAdapter()
    assert fill_latent_cache({str(tmp_path / "vae"): samples}, adapter, 2) == 3
    assert fill_text_cache(["a", "b", "c"], adapter, TensorCache(tmp_path / "text"), 2) == 3
    assert fill_mask_cache({str(tmp_path / "masks"): samples}, 8) == 3
    shown = capsys.readouterr().err
    assert "Caching VAE latents: 100%" in shown and "3/3" in shown
    assert "Caching text embeds: 100%" in shown and "2/2" in shown  # batches of two
    assert "Caching loss masks: 100%" in shown
    assert fill_latent_cache({str(tmp_path / "vae"): samples}, adapter, 2) == 0  # all cached: no bar
    assert fill_text_cache(["a", "b", "c"], adapter, TensorCache(tmp_path / "text"), 2) == 0
    assert fill_mask_cache({str(tmp_path / "masks"): samples}, 8) == 0
    assert capsys.readouterr().err == ""
    more = [make_sample(tmp_path / "more.png", color=(9, 9, 9))]
    assert fill_latent_cache({str(tmp_path / "vae"): more}, adapter, 2, show_progress=False) == 1
    assert fill_text_cache(["d"], adapter, TensorCache(tmp_path / "text"), 2, show_progress=False) == 1
    assert fill_mask_cache({str(tmp_path / "masks"): more}, 8, show_progress=False) == 1
    assert capsys.readouterr().err == ""  # asked for none


def test_a_damaged_entry_another_rank_removed_first_is_no_error(tmp_path, monkeypatch):
    """Two ranks filling one cache find the same damaged entry; the one that removes it second must not fail."""
    import simpletuner.data.cache as cache_module

    cache = TensorCache(tmp_path)
    key = text_key("a", "te")
    cache.save(key, {"x": torch.ones(2)})

    def checked_while_the_other_rank_removes_it(path):
        path.unlink()
        return False

    monkeypatch.setattr(cache_module, "safetensors_intact", checked_while_the_other_rank_removes_it)
    assert cache.has(key) is False and not cache.path(key).exists()


def test_an_unreadable_image_neither_cuts_its_batch_short_nor_miscounts_the_progress(tmp_path, capsys):
    good = [make_sample(tmp_path / f"g{i}.png", color=(i, 0, 0)) for i in range(3)]
    (tmp_path / "bad.png").write_bytes(b"not a png")
    bad = Sample(**{**good[0].__dict__, "path": str(tmp_path / "bad.png")})
    adapter, unreadable, progress = BatchRecordingAdapter(), [], []
    assert fill_latent_cache({str(tmp_path / "c"): [good[0], bad, good[1], good[2]]}, adapter, 4,
                             unreadable=unreadable, on_progress=lambda done, total: progress.append((done, total))) == 3
    assert adapter.batches == [(3, 3, 64, 64)] and [s.path for s, _ in unreadable] == [bad.path]
    assert progress == [(4, 4)]
    bar = capsys.readouterr().err
    assert "Caching VAE latents: 100%" in bar and "4/4" in bar and "5/4" not in bar
