"""On-disk caches of VAE latents and text embeddings, keyed by identity, never by position.

A latent's key hashes (file path, size, mtime, bucket, resize, crop, VAE identity); a text embedding's key hashes
(caption, encoder identity). A changed image or setting therefore gets a new key and only it is re-encoded, and a
warm cache lets training run without loading the VAE or the text encoders at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from simpletuner.data.discovery import Sample, load_mask, load_pixels


def latent_key(sample: Sample, vae_identity: str) -> str:
    payload = [sample.path, sample.file_size, sample.mtime_ns, sample.target_size, sample.resize_to,
               sample.crop_box, vae_identity]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def mask_key(sample: Sample, vae_scale_factor: int) -> str:
    """A loss mask at latent resolution: the file and its preparation, and the VAE's downscale."""
    return latent_key(sample, f"mask/{vae_scale_factor}")


def text_key(caption: str, text_identity: str) -> str:
    return hashlib.sha256(json.dumps([caption, text_identity]).encode()).hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TensorCache:
    """A folder of ``<key>.safetensors`` files."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def load(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(self.path(key))

    def save(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        _atomic_save(tensors, self.path(key))


def fill_latent_cache(samples_by_cache: dict[str, list[Sample]], adapter, batch_size: int, show_progress=True) -> int:
    """Encode every sample whose latent is not cached yet; returns how many were encoded."""
    identity = adapter.vae_cache_identity()
    todo: list[tuple[TensorCache, Sample, str]] = []
    for folder, samples in samples_by_cache.items():
        cache = TensorCache(folder)
        seen = set()
        for s in samples:
            key = latent_key(s, identity)
            if key not in seen and not cache.has(key):
                seen.add(key)
                todo.append((cache, s, key))
    if not todo:
        return 0
    # images of one batch must share a size
    todo.sort(key=lambda item: item[1].target_size)
    bar = tqdm(total=len(todo), desc="Caching VAE latents", disable=not show_progress)
    i = 0
    while i < len(todo):
        size = todo[i][1].target_size
        group = []
        while i < len(todo) and todo[i][1].target_size == size and len(group) < batch_size:
            group.append(todo[i])
            i += 1
        pixels = torch.stack([load_pixels(s) for _, s, _ in group])
        latents = adapter.encode_images(pixels)
        for (cache, _, key), latent in zip(group, latents):
            cache.save(key, {"latents": latent})
        bar.update(len(group))
    bar.close()
    return len(todo)


def fill_mask_cache(samples_by_cache: dict[str, list[Sample]], vae_scale_factor: int, show_progress=True) -> int:
    """Store every mask sample's latent-resolution weights that are not cached yet (no model needed); returns how
    many were written."""
    todo = {}
    for folder, samples in samples_by_cache.items():
        cache = TensorCache(folder)
        for s in samples:
            key = mask_key(s, vae_scale_factor)
            if key not in todo and not cache.has(key):
                todo[key] = (cache, s)
    for key, (cache, s) in tqdm(todo.items(), desc="Caching loss masks", disable=not show_progress or not todo):
        w, h = s.target_size
        cache.save(key, {"mask": load_mask(s, (h // vae_scale_factor, w // vae_scale_factor))})
    return len(todo)


def fill_text_cache(captions: list[str], adapter, cache: TensorCache, batch_size: int, show_progress=True) -> int:
    """Encode every caption whose embedding is not cached yet; returns how many were encoded."""
    identity = adapter.text_cache_identity()
    todo = sorted({c for c in captions if not cache.has(text_key(c, identity))})
    if not todo:
        return 0
    for start in tqdm(range(0, len(todo), batch_size), desc="Caching text embeds", disable=not show_progress):
        chunk = todo[start:start + batch_size]
        for caption, embedding in zip(chunk, adapter.encode_prompts(chunk)):
            cache.save(text_key(caption, identity), embedding.tensors)
    return len(todo)
