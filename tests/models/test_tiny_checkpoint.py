"""tiny.ensure_checkpoint: the folder appears whole or not at all, also when a process's writer came out
incomplete (transformers' save_pretrained writes nothing on a rank other than 0 of a distributed run)."""

from __future__ import annotations

import json
import threading

import pytest

from simpletuner.models import tiny


def _write(folder, *, text_encoder: bool = True):
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "X", "text_encoder": ["transformers", "M"],
                                                          "scheduler": ["diffusers", "S"], "unused": [None, None]}))
    (folder / "text_encoder").mkdir()
    if text_encoder:
        (folder / "text_encoder" / "config.json").write_text("{}")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text("{}")


def test_a_complete_checkpoint_is_published(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(tmp_path))
    path = tiny.ensure_checkpoint("x", _write)
    assert (path / "text_encoder" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folder left behind


def test_an_incomplete_copy_is_never_published_and_waits_for_the_whole_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(tmp_path))
    target = tmp_path / f"x-v{tiny.TINY_FORMAT}"

    def rank0_writes_later():
        staging = tmp_path / "staging"
        staging.mkdir()
        _write(staging)
        staging.rename(target)

    timer = threading.Timer(0.5, rank0_writes_later)
    timer.start()
    try:
        path = tiny.ensure_checkpoint("x", lambda folder: _write(folder, text_encoder=False))
    finally:
        timer.join()
    assert path == target and (path / "text_encoder" / "config.json").is_file()


def test_an_incomplete_copy_with_no_other_writer_is_an_error_naming_the_part(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(tmp_path))
    original = tiny._wait_for
    monkeypatch.setattr(tiny, "_wait_for", lambda target, why: original(target, why, timeout=0.3))
    with pytest.raises(RuntimeError, match=r"text_encoder came out empty here"):
        tiny.ensure_checkpoint("x", lambda folder: _write(folder, text_encoder=False))
    assert list(tmp_path.iterdir()) == []  # nothing half-written stays
