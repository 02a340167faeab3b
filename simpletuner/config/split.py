"""Split training's one shared fact, torch-free: where the cache manifest of a config lives.

``simpletuner cache`` (stage 1) writes it and ``train_from_cache`` (stage 2) reads it; the server compares the two
jobs of a pair by it, so a train job never waits on a cache job that fills another cache.
"""

from __future__ import annotations

import os

MANIFEST_NAME = "cache_manifest.json"


def cache_manifest_path(cache_manifest: str | None, text_cache_dir: str,
                        base: str | os.PathLike[str] | None = None) -> str:
    """The ``cache_manifest`` setting, else ``cache_manifest.json`` in the text_embeds backend's ``cache_dir``;
    relative paths are read from ``base`` (default: the working directory), as the trainer reads them. Not resolved
    through symlinks: the caller checks the path where it opens it."""
    value = cache_manifest or os.path.join(text_cache_dir, MANIFEST_NAME)
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        path = os.path.join(os.fspath(base) if base is not None else os.getcwd(), path)
    return os.path.normpath(path)
