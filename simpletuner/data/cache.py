"""On-disk caches of VAE latents and text embeddings, keyed by identity, never by position.

A latent's key hashes (file path, size, mtime, bucket, resize, crop, VAE identity); a text embedding's key hashes
(caption, encoder identity). A changed image or setting therefore gets a new key and only it is re-encoded, and a
warm cache lets training run without loading the VAE or the text encoders at all. A damaged entry (cut short by a
crash, a bad header) is found when the cache is filled, reported by name and encoded again; one that goes bad
while training runs stops the run with an error naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from simpletuner.config import paths
from simpletuner.config.files import safetensors_intact
from simpletuner.data.discovery import DatasetError, Sample, load_mask, load_pixels

log = logging.getLogger("simpletuner.cache")


class CacheEntryDamaged(DatasetError):
    """A cache file that does not read back (names the file); the next start encodes it again."""


def latent_key(sample: Sample, vae_identity: str) -> str:
    payload = [sample.path, sample.file_size, sample.mtime_ns, sample.target_size, sample.resize_to,
               sample.crop_box, vae_identity]
    if sample.frame_indices is not None:  # a video family's clip: which frames (image-family keys stay as they were)
        payload.append(list(sample.frame_indices))
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def mask_key(sample: Sample, vae_scale_factor: int) -> str:
    """A loss mask at latent resolution: the file and its preparation, and the VAE's downscale."""
    return latent_key(sample, f"mask/{vae_scale_factor}")


def text_key(caption: str, text_identity: str, reference: Sample | None = None) -> str:
    """A caption's embedding; with ``reference``, the caption encoded with that reference image (a family whose
    prompt embedding sees the image it edits: the file and its preparation are part of the key)."""
    payload = [caption, text_identity]
    if reference is not None:
        payload.append(latent_key(reference, "prompt-reference"))
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.guard_open("cache", path.parent)  # a server's job never writes outside its roots
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
        """Cached and whole; a damaged entry is removed (with a warning naming it), so it is encoded again."""
        path = self.path(key)
        if not path.is_file():
            return False
        if safetensors_intact(path):
            return True
        log.warning("%s: damaged cache entry; encoding it again", path)
        path.unlink(missing_ok=True)
        return False

    def load(self, key: str) -> dict[str, torch.Tensor]:
        path = self.path(key)
        try:
            return load_file(path)
        except Exception as exc:  # safetensors' own error type, OSError, ...
            raise CacheEntryDamaged(f"{path}: cache entry cannot be read ({exc}); it is encoded again when "
                                    "the run is started again (Retry)") from None

    def save(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        _atomic_save(tensors, self.path(key))


def shard_of(items: list, shard: tuple[int, int] | None) -> list:
    """This rank's share of ``items`` (rank, world size): every ``world``-th item from ``rank`` on. ``items`` must be
    the same list in the same order on every rank (discovery is deterministic), cached or not, so the shares never
    overlap or miss one, whatever another rank has written meanwhile."""
    if shard is None:
        return items
    rank, world = shard
    return items[rank::world]


def fill_latent_cache(samples_by_cache: dict[str, list[Sample]], adapter, batch_size: int, show_progress=True,
                      unreadable: list[tuple[Sample, str]] | None = None, on_progress=None, *,
                      references: bool = False, shard: tuple[int, int] | None = None,
                      on_saved: Callable[[str], None] | None = None) -> int:
    """Encode every sample whose latent is not cached yet; returns how many were encoded. ``on_progress(done,
    total)`` is called after each batch (the trainer reports it to the server).

    A file that cannot be decoded is appended to ``unreadable`` as (sample, reason) and left out (with
    ``unreadable=None`` the error is raised instead). The adapter's ``latent_cache_entries`` gives what is stored
    per sample (the latents, plus any conditioning the family caches beside them); with ``references`` the samples
    are reference images, stored as ``{"latents": adapter.encode_references(...)}`` under the adapter's
    ``reference_cache_identity``. With ``shard`` (rank, world size) only this rank's share of the distinct entries
    is encoded (see ``shard_of``); ``on_saved(key)`` is called after each entry is written."""
    identity = adapter.reference_cache_identity() if references else adapter.vae_cache_identity()
    wanted: dict[tuple[str, str], tuple[TensorCache, Sample, str]] = {}
    for folder, samples in samples_by_cache.items():
        cache = TensorCache(folder)
        for s in samples:
            key = latent_key(s, identity)
            wanted.setdefault((folder, key), (cache, s, key))
    todo = [item for item in shard_of(list(wanted.values()), shard) if not item[0].has(item[2])]
    if not todo:
        return 0
    # samples of one batch must share a bucket (size, and frame count for video)
    todo.sort(key=lambda item: item[1].bucket)
    bar = tqdm(total=len(todo), desc="Caching VAE latents", disable=not show_progress)
    encoded = 0
    i = 0
    while i < len(todo):
        bucket = todo[i][1].bucket
        group, pixels = [], []
        while i < len(todo) and todo[i][1].bucket == bucket and len(group) < batch_size:
            item = todo[i]
            i += 1
            try:
                pixels.append(load_pixels(item[1]))
            except Exception as exc:
                if unreadable is None:
                    raise ValueError(f"{item[1].path}: cannot be decoded: {exc}") from exc
                unreadable.append((item[1], f"cannot be decoded: {exc}"))
                bar.update(1)
                continue
            group.append(item)
        if not group:
            continue
        batch = torch.stack(pixels)
        entries = ([{"latents": latent} for latent in adapter.encode_references(batch)] if references
                   else adapter.latent_cache_entries(batch))
        for (cache, _, key), entry in zip(group, entries):
            cache.save(key, entry)
            if on_saved is not None:
                on_saved(key)
        encoded += len(group)
        bar.update(len(group))
        if on_progress is not None:
            on_progress(i, len(todo))
    bar.close()
    return encoded


def fill_mask_cache(samples_by_cache: dict[str, list[Sample]], vae_scale_factor: int, show_progress=True, *,
                    shard: tuple[int, int] | None = None) -> int:
    """Store every mask sample's latent-resolution weights that are not cached yet (no model needed); returns how
    many were written (with ``shard``, of this rank's share)."""
    wanted = {}
    for folder, samples in samples_by_cache.items():
        cache = TensorCache(folder)
        for s in samples:
            wanted.setdefault(mask_key(s, vae_scale_factor), (cache, s))
    todo = {key: wanted[key] for key in shard_of(list(wanted), shard) if not wanted[key][0].has(key)}
    for key, (cache, s) in tqdm(todo.items(), desc="Caching loss masks", disable=not show_progress or not todo):
        w, h = s.target_size
        cache.save(key, {"mask": load_mask(s, (h // vae_scale_factor, w // vae_scale_factor))})
    return len(todo)


def negative_identity(text_identity: str) -> str:
    """The text identity a negative prompt's embedding is cached under (encoded by ``encode_negative_prompts``)."""
    return text_identity + "|negative"


def fill_text_cache(captions: list[str], adapter, cache: TensorCache, batch_size: int, show_progress=True, *,
                    negative: bool = False, references: list[Sample] | None = None,
                    shard: tuple[int, int] | None = None, on_progress=None) -> int:
    """Encode every caption whose embedding is not cached yet (as negative prompts with ``negative``); returns how
    many were encoded (with ``shard``, of this rank's share of the distinct captions). ``references`` (one per
    caption) are the reference images the captions are encoded with, for a family whose prompt embedding sees the
    image it edits (``adapter.prompt_takes_reference``). ``on_progress(done, total)`` is called after each batch."""
    identity = adapter.text_cache_identity()
    if negative:
        identity = negative_identity(identity)
    pairs = list(zip(captions, references)) if references is not None else [(c, None) for c in captions]
    wanted: dict[str, tuple[str, Sample | None]] = {}
    for caption, reference in pairs:
        wanted.setdefault(text_key(caption, identity, reference), (caption, reference))
    # the same order on every rank (by caption, then key), sharded before the cached ones are left out
    ordered = sorted(wanted.items(), key=lambda item: (item[1][0], item[0]))
    todo = dict(item for item in shard_of(ordered, shard) if not cache.has(item[0]))
    if not todo:
        return 0
    items = sorted(todo.items(), key=lambda item: (item[1][0], item[0]))
    for start in tqdm(range(0, len(items), batch_size), desc="Caching text embeds", disable=not show_progress):
        chunk = items[start:start + batch_size]
        prompts = [caption for _, (caption, _) in chunk]
        if references is not None:
            pixels = [load_pixels(reference) for _, (_, reference) in chunk]
            embeddings = adapter.encode_text(prompts, pixels, negative=negative)
        else:
            embeddings = (adapter.encode_negative_prompts if negative else adapter.encode_prompts)(prompts)
        for (key, _), embedding in zip(chunk, embeddings):
            cache.save(key, embedding.tensors)
        if on_progress is not None:
            on_progress(start + len(chunk), len(items))
    return len(todo)
