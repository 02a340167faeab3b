"""Training checkpoints: written atomically, rotated by ``checkpoints_total_limit``, resumed exactly.

A checkpoint folder ``checkpoint-<step>`` holds the trainable weights (``trainable.safetensors``), the optimizer
and LR-scheduler states, every RNG state, and ``training_state.json`` (step, epoch, batch position). It is written
into a temporary folder and renamed into place, so a crash never leaves a half-written checkpoint that resume
would pick up.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / "training_state.json").is_file()]


def resolve_resume(output_dir: str | Path, resume_from_checkpoint: str | None) -> Path | None:
    """``latest`` -> newest checkpoint or None when there is none; a path -> that checkpoint (must exist)."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from_checkpoint)
    if not path.is_absolute() and not path.exists():
        path = Path(output_dir) / path
    if not (path / "training_state.json").is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {resume_from_checkpoint} is not a checkpoint folder")
    return path


def rng_state(generator: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_rng_path(output_dir, step: int, rank: int) -> Path:
    """Where a non-main rank leaves its RNG state for the main process to put into ``checkpoint-<step>``."""
    return Path(output_dir) / f".rng-step{step}-rank{rank}.pt"


def save_checkpoint(output_dir, step: int, *, trainable: dict[str, torch.Tensor], optimizer, lr_scheduler,
                    generator: torch.Generator, training_state: dict, total_limit: int | None,
                    num_processes: int = 1) -> Path:
    """Write ``checkpoint-<step>`` (main process). Other ranks first save theirs with ``rank_rng_path``."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}-", dir=root))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(lr_scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(generator), tmp / "rng.pt")
        for rank in range(1, num_processes):  # each rank draws its own noise; each resumes with its own RNG
            os.replace(rank_rng_path(root, step, rank), tmp / f"rng-rank{rank}.pt")
        (tmp / "training_state.json").write_text(json.dumps({**training_state, "global_step": step}, indent=2))
        if final.exists():  # re-running the same step (e.g. after resume): replace
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if total_limit:
        for old in list_checkpoints(root)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, *, optimizer, lr_scheduler, generator: torch.Generator,
                    rank: int = 0) -> tuple[dict, dict]:
    """Restore optimizer, scheduler and this rank's RNG; returns (trainable weights, training_state)."""
    trainable = load_file(path / "trainable.safetensors")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng_file = path / (f"rng-rank{rank}.pt" if rank else "rng.pt")
    if not rng_file.is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} has no RNG state for process {rank} "
                                "(it was saved by a run with fewer processes)")
    restore_rng(torch.load(rng_file, weights_only=False), generator)
    return trainable, json.loads((path / "training_state.json").read_text())
