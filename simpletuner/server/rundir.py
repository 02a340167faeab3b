"""What a job's run directory says about it (torch-free): its checkpoints, whether its trainer finished (the run
summary and the final model on disk, whole), and how a retry prepares it.

``RUN_DIR/output`` is the trainer's ``output_dir``. A retry that resumes keeps it (the trainer resumes from its
newest valid checkpoint); one that starts over moves it aside to ``output.attempt-<n>``, so nothing is deleted.
"""

from __future__ import annotations

import re
from pathlib import Path

from simpletuner.config.files import read_json, safetensors_intact

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
SUMMARY = "run_summary.json"
CACHE_SUMMARY = "cache_summary.json"  # a cache job's (split training, stage 1)
LORA_NAMES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")


def output_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / "output"


def checkpoints(output: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders (they have training_state.json), oldest first."""
    root = Path(output)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [(step, p) for step, p in sorted(found) if (p / "training_state.json").is_file()]


def newest_checkpoint(output: str | Path) -> tuple[int, Path] | None:
    found = checkpoints(output)
    return found[-1] if found else None


def finished_on_disk(run_dir: str | Path) -> dict | None:
    """The run summary when the trainer finished: ``run_summary.json`` reads back and the final model it names
    is on disk and whole (a cache job: ``cache_summary.json`` and the finished manifest it names). None otherwise
    (still running, crashed, or cut short while saving)."""
    output = output_of(run_dir)
    summary = read_json(output / SUMMARY)
    if summary is None:
        cached = read_json(output / CACHE_SUMMARY)
        manifest = read_json(cached["cache_manifest"]) if cached and isinstance(cached.get("cache_manifest"), str) \
            else None
        return cached if manifest is not None and manifest.get("complete") is True else None
    lora, model = summary.get("lora_path"), summary.get("model_path")
    if isinstance(lora, str) and lora:
        return summary if safetensors_intact(lora) else None
    if isinstance(model, str) and model:
        folder = Path(model)
        weights = sorted(folder.glob("*.safetensors"))
        return summary if weights and all(safetensors_intact(w) for w in weights) else None
    return None


def prepare_attempt(run_dir: str | Path, attempt: int, start_over: bool) -> str | None:
    """Before attempt ``attempt`` (> 1) runs: a stale run summary never speaks for it; starting over moves the
    previous output aside. Returns where it was moved, if it was."""
    output = output_of(run_dir)
    if start_over and output.exists():
        target = Path(run_dir) / f"output.attempt-{attempt - 1}"
        n = 1
        while target.exists():
            n += 1
            target = Path(run_dir) / f"output.attempt-{attempt - 1}.{n}"
        output.rename(target)
        return str(target)
    (output / SUMMARY).unlink(missing_ok=True)
    return None
