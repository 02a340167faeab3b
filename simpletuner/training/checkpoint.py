"""Training checkpoints: written atomically, rotated by ``checkpoints_total_limit``, resumed exactly.

A checkpoint folder ``checkpoint-<step>`` holds the trainable weights (``trainable.safetensors``), the optimizer
and LR-scheduler states, every RNG state, and ``training_state.json`` (step, epoch, batch position). It is written
into a temporary folder, flushed to disk and renamed into place, so a crash never leaves a half-written checkpoint
that resume would pick up; the temporary folders such a crash leaves are removed at the next start. Resuming from
``latest`` skips a damaged newest checkpoint (a warning names the file) for the one before it. Nothing is ever
unpickled: ``.pt`` files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from simpletuner.training import failpoints

_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger("simpletuner.checkpoint")


class CheckpointDamaged(ValueError):
    """A checkpoint file that cannot be read back whole (truncated, corrupt, empty); names the file."""


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
        failpoints.hit("checkpoint.save", step)  # crash drills: die with the checkpoint half-written
        torch.save(lr_scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(generator), tmp / "rng.pt")
        for rank in range(1, num_processes):  # each rank draws its own noise; each resumes with its own RNG
            os.replace(rank_rng_path(root, step, rank), tmp / f"rng-rank{rank}.pt")
        (tmp / "training_state.json").write_text(json.dumps({**training_state, "global_step": step}, indent=2))
        _fsync_tree(tmp)
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
    """Restore optimizer, scheduler and this rank's RNG; returns (trainable weights, training_state).
    Every file is read (and checked) before anything is restored; CheckpointDamaged names a bad one."""
    parts = read_checkpoint(path, rank)
    optimizer.load_state_dict(parts["optimizer"])
    lr_scheduler.load_state_dict(parts["scheduler"])
    restore_rng(parts["rng"], generator)
    return parts["trainable"], parts["state"]


def _fsync_tree(folder: Path) -> None:
    """Flush a freshly written folder's files (and the folder) to disk before it is renamed into place."""
    for p in [*folder.iterdir(), folder]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _safe_torch_load(path: Path):
    """A ``.pt`` state file read without unpickling code: tensors, numbers, strings and numpy RNG arrays only."""
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # truncated, corrupt, or a pickle that wants to run code
        raise CheckpointDamaged(f"{path}: cannot be read safely ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else 'damaged'})") from None


def read_checkpoint(path: Path, rank: int = 0) -> dict:
    """Every file of ``checkpoint-<step>`` read into memory: CheckpointDamaged names the first one that is
    missing or does not read back whole (so a damaged checkpoint restores nothing)."""
    path = Path(path)
    state_file = path / "training_state.json"
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
            raise ValueError("no global_step")
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"{state_file}: empty or damaged ({exc})") from None
    others = sorted(path.glob("rng-rank*.pt"))
    rng_file = path / (f"rng-rank{rank}.pt" if rank else "rng.pt")
    if rank and not rng_file.is_file() and (path / "rng.pt").is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} has no RNG state for process {rank} "
                                "(it was saved by a run with fewer processes)")
    parts = {"state": state}
    try:
        parts["trainable"] = load_file(path / "trainable.safetensors")
    except Exception as exc:  # safetensors' own error type; a truncated file, a bad header
        raise CheckpointDamaged(f"{path / 'trainable.safetensors'}: damaged ({exc})") from None
    for name in ("optimizer.pt", "scheduler.pt"):
        if not (path / name).is_file():
            raise CheckpointDamaged(f"{path / name}: missing")
        parts[name[:-3]] = _safe_torch_load(path / name)
    for rng in [path / "rng.pt", *others]:  # every rank's, so all ranks judge a checkpoint alike
        if not rng.is_file():
            raise CheckpointDamaged(f"{rng}: missing")
        loaded = _safe_torch_load(rng)
        if rng == rng_file:
            parts["rng"] = loaded
    return parts


def remove_save_leftovers(output_dir: str | Path) -> list[Path]:
    """Remove what a crash during a save leaves behind: ``.checkpoint-<step>-*`` temporary folders and other
    ranks' ``.rng-step*`` files. Call at start, on the main process only; returns what was removed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    removed = []
    for p in root.iterdir():
        if p.name.startswith(".checkpoint-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif p.name.startswith(".rng-step") and p.name.endswith(".pt"):
            p.unlink(missing_ok=True)
            removed.append(p)
    for p in removed:
        log.warning("removed %s, left by a crash during a checkpoint save", p)
    return removed


def resume(output_dir: str | Path, resume_from_checkpoint: str | None, *, optimizer, lr_scheduler,
           generator: torch.Generator, rank: int = 0) -> tuple[Path, dict, dict] | None:
    """Clean up after a crashed save, then restore ``resume_from_checkpoint``; returns (path, trainable weights,
    training_state), or None when there is nothing to resume. With ``latest`` a damaged newest checkpoint is
    reported by file and the previous one is used; a named checkpoint must read back whole."""
    if rank == 0:
        remove_save_leftovers(output_dir)
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint != "latest":
        path = resolve_resume(output_dir, resume_from_checkpoint)
        return path, *load_checkpoint(path, optimizer=optimizer, lr_scheduler=lr_scheduler, generator=generator,
                                      rank=rank)
    for path in reversed(list_checkpoints(output_dir)):
        try:
            parts = read_checkpoint(path, rank)
        except CheckpointDamaged as exc:
            log.warning("%s; resuming from the checkpoint before it", exc)
            continue
        optimizer.load_state_dict(parts["optimizer"])
        lr_scheduler.load_state_dict(parts["scheduler"])
        restore_rng(parts["rng"], generator)
        return path, parts["trainable"], parts["state"]
    return None


def write_json(path: str | Path, data) -> None:
    """Write JSON atomically (temp file + rename): a reader never sees half a file, even after a crash."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
