"""Read tracker files back: TensorBoard event files and wandb's offline run log (``run-<id>.wandb``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7  # record header: crc32c (4), length (2, little endian), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for run_dir in sorted({p.parent for p in Path(folder).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return found


def tensorboard_image_tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for run_dir in {p.parent for p in Path(folder).rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(run_dir), size_guidance={"images": 0})
        acc.Reload()
        tags.update(acc.Tags()["images"])
    return tags


def wandb_records(path: Path) -> list[bytes]:
    """The raw records of a wandb transaction log: a 7-byte file header (":W&B", magic, version), then
    LevelDB-log-format records in 32 KiB blocks (records may be split across blocks)."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file")
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        body = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            records.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            records.append(pending + body)
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of the file
            break
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """Each ``run.log`` row of an offline run, as {key: value} (``_step`` included)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = list(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one run-*.wandb file, found {files}")
    rows = []
    for raw in wandb_records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wandb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """{key: {step: value}} for the numeric values of an offline run's history."""
    found: dict[str, dict[int, float]] = {}
    for row in wandb_history(run_dir):
        step = row.get("_step")
        for key, value in row.items():
            if not key.startswith("_") and isinstance(value, (int, float)):
                found.setdefault(key, {})[step] = value
    return found
