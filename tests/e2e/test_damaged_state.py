"""`simpletuner train` recovers from damaged state (issue 15): a truncated newest checkpoint and an empty
training_state.json are reported by file and the run resumes from the checkpoint before them; a damaged cache
entry is encoded again; a crash's half-written checkpoint folder is removed. Real subprocesses, tiny Flux."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import simpletuner, write_run

pytestmark = pytest.mark.e2e


def _steps(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "training_log.jsonl").read_text().splitlines()]


def test_damaged_checkpoints_cache_entries_and_save_leftovers_are_recovered_from(tmp_path):
    dataset = tmp_path / "sample"
    shutil.copytree(REPO / "datasets" / "sample", dataset)
    config, output = write_run(tmp_path, dataset, max_train_steps=6, checkpointing_steps=2,
                               checkpoints_total_limit=None, resume_from_checkpoint="latest")
    simpletuner("train", "--config", str(config))
    assert _steps(output) == list(range(1, 7))

    truncated = output / "checkpoint-6" / "trainable.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])  # cut short (a full disk, a torn write)
    emptied = output / "checkpoint-4" / "training_state.json"
    emptied.write_text("")
    entry = sorted((tmp_path / "cache" / "vae").rglob("*.safetensors"))[3]
    entry.write_bytes(entry.read_bytes()[:50])
    leftover = output / ".checkpoint-8.tmp"  # what a kill during a save leaves
    leftover.mkdir()
    (leftover / "trainable.safetensors").write_bytes(b"half")

    proc = simpletuner("train", "--config", str(config), "--set", "max_train_steps=8")
    err = proc.stderr
    assert f"{truncated}: damaged" in err and f"{emptied}: empty or damaged" in err
    assert "resuming from the checkpoint before it" in err
    assert f"{entry}: damaged cache entry; encoding it again" in err
    assert f"removed {leftover}" in err and not leftover.exists()
    assert "Traceback" not in err
    assert _steps(output) == list(range(1, 7)) + list(range(3, 9))  # resumed from checkpoint-2
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["global_step"] == 8 and summary["latents_encoded"] == 1 and summary["captions_encoded"] == 0

    # a checkpoint named explicitly must read back whole: a one-line error naming the file, no traceback
    emptied.write_text("")  # (the resumed run wrote checkpoint-4 afresh)
    proc = simpletuner("train", "--config", str(config), "--set", "max_train_steps=10",
                       "--set", f"resume_from_checkpoint={emptied.parent}", check=False)
    assert proc.returncode == 1
    assert f"error: {emptied}: empty or damaged" in proc.stderr and "Traceback" not in proc.stderr
