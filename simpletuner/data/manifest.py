"""The cache manifest of split training: what stage 1 (``simpletuner cache``) encoded, so stage 2 can train from the
caches alone and prove they were made for its config.

A manifest records
- the encoders' identities (the strings every cache key hashes), part by part: each encoder and tokenizer folder
  (path, revision, a digest of its config), the family's settings that change an embedding (sequence lengths,
  masks), precisions and dtype; and the VAE's, with tiling and its downscale factor;
- the data settings: every dataset's settings that decide what a sample is (folder, resolution, crops, captions,
  pairs, cache folder; not ``repeats`` or ``probability``, which only decide how often it is drawn), the defaults
  they fall back on, and the text-embeds cache folder;
- every sample once (repeats ignored) with its file's fingerprint (path, size, mtime), caption, bucket, crop, its
  paired reference image and mask, its cache key and which rank encoded it; the files skipped and why;
- the captions, the validation prompts, the negative prompt, the validation reference images and the eval samples;
- counts of each.

It is written atomically (temp file, fsync, rename). Caching writes an incomplete one first (``complete: false``),
so a stage 2 started on an interrupted cache is told so instead of training on part of it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from simpletuner.config import paths
from simpletuner.config.files import write_json
from simpletuner.data.discovery import DatasetError, Sample

FORMAT = 1
# dataset settings that decide how often a sample is drawn, never what it is (stage 2 may change them)
DRAW_SETTINGS = ("repeats", "probability", "disabled")


class CacheManifestError(DatasetError):
    """The cache manifest is missing, damaged, unfinished, or does not match the config (names the file and what
    differs)."""


def sample_record(sample: Sample) -> dict[str, Any]:
    """A sample as JSON (its pairs nested)."""
    record = asdict(sample)
    for name in ("conditioning", "mask"):
        pair = getattr(sample, name)
        record[name] = sample_record(pair) if pair is not None else None
    return record


def sample_from_record(record: dict[str, Any]) -> Sample:
    """The inverse of ``sample_record``."""
    values = dict(record)
    for name in ("target_size", "resize_to", "crop_box", "frame_indices", "original_size"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    for name in ("conditioning", "mask"):
        if values.get(name) is not None:
            values[name] = sample_from_record(values[name])
    return Sample(**{k: v for k, v in values.items() if k in Sample.__dataclass_fields__})


def dataset_settings(backend) -> dict[str, Any]:
    """A dataset's settings that decide what its samples are (everything but ``DRAW_SETTINGS``)."""
    return backend.model_dump(mode="json", exclude=set(DRAW_SETTINGS))


def write_manifest(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write the manifest atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.guard_open("cache_manifest", path.parent)  # a server's job never writes outside its roots
    write_json(path, {"format": FORMAT, **data, "written_at": time.time()}, indent=1)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest at ``path``, finished. CacheManifestError naming the file when it is missing, damaged, of another
    format, or from a caching run that did not finish."""
    path = Path(path)
    paths.guard_open("cache_manifest", path, "file")
    again = "run `simpletuner cache` with this config (it encodes only what is not cached yet)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CacheManifestError(f"cache_manifest: {path} does not exist; {again} before training from the "
                                 "cache") from None
    except OSError as exc:
        raise CacheManifestError(f"cache_manifest: {path} cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CacheManifestError(f"cache_manifest: {path} is damaged (not JSON: {exc}); {again}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise CacheManifestError(f"cache_manifest: {path} is not a cache manifest of format {FORMAT} "
                                 f"(format {found!r}); {again}")
    if not data.get("complete"):
        raise CacheManifestError(f"cache_manifest: {path}: caching did not finish (interrupted, or still running); "
                                 f"{again}; it resumes where it stopped")
    return data


def _component(part: str) -> list | None:
    """A ``component_identity`` part as its list ([family, path, folder, revision, config digest]), else None."""
    try:
        value = json.loads(part)
    except ValueError:
        return None
    return value if isinstance(value, list) and len(value) == 5 else None


def identity_differences(what: str, cached: list[str], current: list[str]) -> list[str]:
    """How the identity parts this config gives (``current``) differ from those the cache was made with, one line
    per part. A folder that is no longer on disk (its config digest is empty now) is not a difference: stage 2 runs
    without the encoders' files."""
    if len(cached) != len(current):
        return [f"{what}: this config's encoders are {_names(current)}, the cache was made with {_names(cached)}"]
    out = []
    for old, new in zip(cached, current):
        if old == new:
            continue
        old_c, new_c = _component(old), _component(new)
        if old_c is not None and new_c is not None:
            if old_c[:4] == new_c[:4] and new_c[4] == "":
                continue  # the folder's config is not here to compare (deleted after stage 1)
            labels = ("model family", "path", "folder", "revision", "config")
            diff = [f"{label} {n!r} (cached: {o!r})" for label, o, n in zip(labels, old_c, new_c) if o != n]
            out.append(f"{what}: {old_c[2]}: {', '.join(diff)}")
        else:
            out.append(f"{what}: {new!r} in this config, {old!r} when cached")
    return out


def _names(parts: list[str]) -> str:
    folders = [c[2] for c in map(_component, parts) if c is not None]
    return ", ".join(folders) or "none"


def setting_differences(where: str, cached: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``where.key: <now> in this config, <then> when cached`` for each setting that differs."""
    out = []
    for key in sorted(set(cached) | set(current)):
        old, new = cached.get(key), current.get(key)
        if old != new:
            out.append(f"{where}.{key}: {new!r} in this config, {old!r} when cached")
    return out
