"""Torch-free checks of files the trainer writes, shared by the server (reconciling a run from its folder) and the
data layer (cache entries), and the one atomic text writer of the config layer and the server."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path


def safetensors_intact(path: str | os.PathLike[str]) -> bool:
    """Whether a .safetensors file is whole: its header parses and the file is exactly as long as the header says.
    Reads the header only; a truncated or garbled file fails (bit flips inside the data do not)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                return False
            (length,) = struct.unpack("<Q", head)
            size = os.fstat(fh.fileno()).st_size
            if length > size - 8:
                return False
            header = json.loads(fh.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + length + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def read_json(path: str | os.PathLike[str]) -> dict | None:
    """A JSON object from ``path``, or None when it is missing, empty, cut short or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str | os.PathLike[str], data, indent: int | None = 2) -> None:
    """Write JSON atomically (``write_text_atomic``): a reader sees the old file or the new one, never half of
    one, even after a crash."""
    write_text_atomic(path, json.dumps(data, indent=indent))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half of it: a temporary
    file beside it, flushed, then renamed over it. Missing parent folders are made."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
