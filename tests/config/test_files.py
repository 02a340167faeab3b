"""Torch-free checks of files the trainer writes: whole .safetensors files, JSON objects."""

from __future__ import annotations

import json
import struct

import pytest

from simpletuner.config.files import read_json, safetensors_intact


def write_safetensors(path, tensors: dict[str, bytes], metadata: dict | None = None, tail: bytes = b""):
    """A .safetensors file built by hand (the format: 8-byte header length, JSON header, data) plus ``tail``."""
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, raw in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(raw)], "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data + tail)
    return path


def test_a_whole_file_is_intact(tmp_path):
    assert safetensors_intact(write_safetensors(tmp_path / "a.safetensors", {"a": b"1234", "b": b"56"},
                                                metadata={"format": "pt"}))
    assert safetensors_intact(write_safetensors(tmp_path / "empty.safetensors", {}))  # no tensors: header only


def test_a_file_saved_by_safetensors_is_intact(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3, 4), "y": torch.ones(2)}, tmp_path / "t.safetensors")
    assert safetensors_intact(tmp_path / "t.safetensors")


@pytest.mark.parametrize("damage", ["cut-data", "extra-bytes", "cut-header", "short", "empty", "garbled-header",
                                    "header-not-object", "missing", "length-past-end"])
def test_damaged_files_are_not_intact(tmp_path, damage):
    path = write_safetensors(tmp_path / "a.safetensors", {"a": b"1234", "b": b"5678"})
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    if damage == "cut-data":
        path.write_bytes(raw[:-1])
    elif damage == "extra-bytes":
        path.write_bytes(raw + b"\0")
    elif damage == "cut-header":
        path.write_bytes(raw[:8 + length - 1])
    elif damage == "short":
        path.write_bytes(raw[:7])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbled-header":
        path.write_bytes(raw[:8] + b"x" * length + raw[8 + length:])
    elif damage == "header-not-object":
        blob = b"[1, 2]"
        path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    elif damage == "missing":
        path.unlink()
    elif damage == "length-past-end":
        path.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    assert not safetensors_intact(path)


def test_the_header_length_may_reach_exactly_the_end(tmp_path):
    blob = b"{}"
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert safetensors_intact(path)
    path.write_bytes(struct.pack("<Q", len(blob) + 1) + blob)
    assert not safetensors_intact(path)


def test_read_json(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"step": 3}))
    assert read_json(path) == {"step": 3}
    for text in ("", '{"step": ', "[1, 2]", "3"):
        path.write_text(text)
        assert read_json(path) is None, text
    assert read_json(tmp_path / "missing.json") is None
