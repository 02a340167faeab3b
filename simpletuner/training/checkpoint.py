"""Training checkpoints: written atomically by every rank together, rotated by ``checkpoints_total_limit``, resumed
exactly, and read without unpickling anything.

A checkpoint folder ``checkpoint-<step>`` holds
- ``trainable.safetensors``: the trainable weights (LoRA or the full model's trainable parameters);
- ``optimizer.pt``;
- ``scheduler.pt``;
- ``rng.pt`` (rank 0) and ``rng-rank<r>.pt``: every process's RNG states, since each draws its own noise;
- ``ema.pt`` with ``use_ema``: the EMA of the trained weights and its update count;
- ``training_state.json``: the run position (``RunState``) and the world size;
- a recipe with more than one trained network (distillation: the student's critic) adds
  ``trainable-<name>.safetensors`` per further network and ``<name>.pt`` per further state (its optimizer, its
  learning-rate schedule), written and read with the rest.

A sharded run (FSDP, DeepSpeed: ``sharding.py``) writes its model and optimizer state its own way instead of
``trainable.safetensors`` / ``optimizer.pt`` (every process its shard, all of them together), and
``training_state.json`` then says how (``sharding``: the layout, the world size, every file's size); such a checkpoint
resumes with the same number of processes, and only in a sharded run.

Every rank writes into ``.checkpoint-<step>.tmp`` and the main process renames it into place once all have
finished, its files flushed to disk, so a crash never leaves a half-written checkpoint that resume would pick up
(the temp folder is removed at the next start). Resuming from ``latest`` skips a damaged newest checkpoint (a warning
names the file) for the one before it; a named checkpoint must read back whole. Nothing is ever unpickled: ``.pt``
files are read with ``torch.load(weights_only=True)`` and RNG states are stored as plain lists and tensors.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from simpletuner.config.files import write_json  # noqa: F401  (checkpoint.write_json: run summaries)
from simpletuner.training import failpoints
from simpletuner.training.state import RunState

log = logging.getLogger("simpletuner.checkpoint")

_NAME = re.compile(r"^checkpoint-(\d+)\Z")  # \Z: "$" would also match before a trailing newline
_TEMP = re.compile(r"^\.checkpoint-\d+(\.tmp|-.*)$")
_PART = re.compile(r"^[a-z][a-z0-9_]*\Z")


class CheckpointDamaged(ValueError):
    """A checkpoint file that cannot be read back whole (missing, truncated, corrupt, empty); names the file."""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / "training_state.json").is_file()]


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete temp folders a crash during a save left behind (main process, before training starts)."""
    root = Path(output_dir)
    removed = [p for p in root.iterdir() if _TEMP.match(p.name) and p.is_dir()] if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left by a crash during a checkpoint save", path)
    return removed


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


# ---- RNG states as plain data (loadable with weights_only=True) --------------------------------------------
def rng_state(generator: torch.Generator) -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt" if rank else "rng.pt"


def load_pt(path: Path):
    """A ``.pt`` state file read without unpickling code; CheckpointDamaged names it when it does not read back."""
    if not path.is_file():
        raise CheckpointDamaged(f"{path}: missing")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated, corrupt, or a pickle that wants to run code
        first = str(exc).splitlines()[0] if str(exc) else "damaged"
        raise CheckpointDamaged(f"{path}: cannot be read safely ({type(exc).__name__}: {first})") from None


def fsync_tree(folder: Path) -> None:
    """Flush a freshly written folder's files and subfolders (and the folder) to disk before it is renamed into
    place."""
    for p in [*sorted(folder.rglob("*"), reverse=True), folder]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- save / load ---------------------------------------------------------------------------------------------
def save_checkpoint(output_dir, state: RunState, *, trainable: dict[str, torch.Tensor] | None, optimizer,
                    lr_scheduler, total_limit: int | None, rank: int = 0, world_size: int = 1,
                    barrier: Callable[[], None] | None = None, shards=None,
                    ema_state: dict | None = None, extra: Callable[[Path], None] | None = None,
                    extra_trainable: Mapping[str, dict[str, torch.Tensor]] | None = None,
                    extra_states: Mapping[str, dict] | None = None) -> Path:
    """Write ``checkpoint-<state.global_step>``; every rank calls this (``barrier`` synchronises them).

    ``trainable`` is needed on the main process only, and the main process saves the (replicated) optimizer state;
    with ``shards`` (a sharded run, ``sharding.py``) every rank writes its part of both through ``shards.save``.
    ``extra(folder)`` (main process) writes more files into the checkpoint before it is published (the LoRA as users
    load it), so they appear with it or not at all. ``extra_trainable`` / ``extra_states`` (main process): further
    networks' weights and further states by name (``trainable-<name>.safetensors``, ``<name>.pt``).
    """
    for name in [*(extra_trainable or {}), *(extra_states or {})]:
        if not _PART.match(name) or name in ("optimizer", "scheduler", "rng", "ema", "trainable"):
            raise ValueError(f"checkpoint part name {name!r} is not a plain lowercase name of its own")
    barrier = barrier or (lambda: None)
    root = Path(output_dir)
    step = state.global_step
    final = root / f"checkpoint-{step}"
    tmp = root / f".checkpoint-{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    try:
        torch.save(rng_state(state.generator), tmp / _rng_file(rank))
        if shards is not None:
            shards.save(tmp)  # every rank its part, together
        barrier()
        if rank == 0:
            if shards is None:
                save_file({k: v.detach().cpu().contiguous() for k, v in (trainable or {}).items()},
                          tmp / "trainable.safetensors")
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            failpoints.hit("checkpoint.save", step)  # crash drills: die with the checkpoint half-written
            torch.save(lr_scheduler.state_dict(), tmp / "scheduler.pt")
            if ema_state is not None:
                torch.save(ema_state, tmp / "ema.pt")
            for name, tensors in (extra_trainable or {}).items():
                save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                          tmp / f"trainable-{name}.safetensors")
            for name, part in (extra_states or {}).items():
                torch.save(part, tmp / f"{name}.pt")
            if extra is not None:
                extra(tmp)
            meta = {**state.position(), "world_size": world_size}
            if shards is not None:
                meta["sharding"] = shards.describe(tmp)
            (tmp / "training_state.json").write_text(json.dumps(meta, indent=2))
            fsync_tree(tmp)
            if final.exists():  # re-running the same step (e.g. after resume): replace
                shutil.rmtree(final)
            tmp.rename(final)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if rank == 0 and total_limit:
        for old in list_checkpoints(root)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_training_state(path: Path) -> dict:
    """``training_state.json`` of a checkpoint; CheckpointDamaged naming the file when it is empty or damaged."""
    file = Path(path) / "training_state.json"
    try:
        saved = json.loads(file.read_text())
        int(saved["global_step"]), int(saved["epoch"]), int(saved["batch_in_epoch"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointDamaged(f"{file}: empty or damaged, not a readable training state ({exc})") from None
    return saved


def read_checkpoint(path: Path, rank: int = 0, world_size: int = 1, shards=None, *, extra_trainable=(),
                    extra_states=()) -> dict:
    """Every file of ``checkpoint-<step>`` this rank restores, read into memory (a sharded run's tensors are only
    checked: they are read straight into its shards); CheckpointDamaged names the first one that is missing or does
    not read back whole, so a damaged checkpoint restores nothing. Every rank's RNG file is read on every rank, so
    all ranks judge a checkpoint alike. ``extra_trainable`` / ``extra_states`` name the further parts a recipe saved
    (each must be there)."""
    path = Path(path)
    saved = read_training_state(path)
    sharding = saved.get("sharding")
    saved_world = int(saved.get("world_size", 1))
    if sharding and shards is None:
        raise ValueError(f"resume_from_checkpoint: {path} holds the sharded state of a {sharding.get('kind')} run "
                         f"with {saved_world} processes; resume it with the same sharding and number of processes, "
                         f"or turn it into weights with `simpletuner consolidate {path}`")
    if shards is not None and not sharding:
        raise ValueError(f"resume_from_checkpoint: {path} was written by a run without sharding; this run shards "
                         f"its state ({shards.kind}): resume it without fsdp_enable / deepspeed_config, or start over")
    if sharding and saved_world != world_size:
        raise ValueError(f"resume_from_checkpoint: {path} holds the shards of {saved_world} processes; resume it "
                         f"with {saved_world} processes (this run has {world_size})")
    if not (path / _rng_file(rank)).is_file() and rank >= saved_world:
        raise FileNotFoundError(f"resume_from_checkpoint: {path} has no RNG state for process {rank} "
                                "(it was saved by a run with fewer processes)")
    parts: dict = {"state": saved}
    if sharding:
        from simpletuner.training.sharding import read_parts

        parts["shards"] = read_parts(path, sharding)
    else:
        try:
            parts["trainable"] = load_file(path / "trainable.safetensors")
        except Exception as exc:  # safetensors' own error type: a truncated file, a bad header
            raise CheckpointDamaged(f"{path / 'trainable.safetensors'}: damaged ({exc})") from None
        parts["optimizer"] = load_pt(path / "optimizer.pt")
    parts["extra_trainable"] = {}
    for name in extra_trainable:
        file = path / f"trainable-{name}.safetensors"
        if not file.is_file():
            raise CheckpointDamaged(f"{file}: missing")
        try:
            parts["extra_trainable"][name] = load_file(file)
        except Exception as exc:
            raise CheckpointDamaged(f"{file}: damaged ({exc})") from None
    parts["extra_states"] = {name: load_pt(path / f"{name}.pt") for name in extra_states}
    parts["scheduler"] = load_pt(path / "scheduler.pt")
    if (path / "ema.pt").is_file():
        parts["ema"], parts["ema_file"] = load_pt(path / "ema.pt"), str(path / "ema.pt")
    for r in range(saved_world):
        rng = load_pt(path / _rng_file(r))
        if r == rank:
            parts["rng"] = rng
    return parts


def _restore(path: Path, parts: dict, state: RunState, optimizer, lr_scheduler, ema=None, shards=None,
             extra_trainable=None, extra_states=None) -> dict[str, torch.Tensor] | None:
    for name, load in (extra_trainable or {}).items():  # first, with the EMA: they check shapes against the models
        load(parts["extra_trainable"][name], f"{path}/trainable-{name}.safetensors")
    if ema is not None and "ema" in parts:
        ema.load_state_dict(parts["ema"], parts["ema_file"])
    for name, target in (extra_states or {}).items():
        target.load_state_dict(parts["extra_states"][name])
    if "shards" in parts:
        shards.load(path, parts["shards"])  # the weights and the optimizer, every rank together
    else:
        optimizer.load_state_dict(parts["optimizer"])
    lr_scheduler.load_state_dict(parts["scheduler"])
    restore_rng(parts["rng"], state.generator)
    state.restore_position(parts["state"])
    return parts.get("trainable")


def load_checkpoint(path: Path, state: RunState, *, optimizer, lr_scheduler, rank: int = 0,
                    world_size: int = 1, ema=None, shards=None, extra_trainable=None,
                    extra_states=None) -> dict[str, torch.Tensor] | None:
    """Restore optimizer, scheduler, the EMA (when ``ema`` is given), this rank's RNG and the run position into
    ``state``; returns the trainable weights (None for a sharded run, whose ``shards`` restores them itself).
    Everything is read (and checked) before anything is restored. A sharded checkpoint needs the world size it was
    saved with. ``extra_trainable`` maps a further network's name to ``load(weights, source)``; ``extra_states`` a
    further state's name to an object with ``load_state_dict``."""
    path = Path(path)
    parts = read_checkpoint(path, rank, world_size, shards, extra_trainable=tuple(extra_trainable or ()),
                            extra_states=tuple(extra_states or ()))
    return _restore(path, parts, state, optimizer, lr_scheduler, ema, shards, extra_trainable, extra_states)


def resume(output_dir: str | Path, resume_from_checkpoint: str | None, state: RunState, *, optimizer, lr_scheduler,
           rank: int = 0, world_size: int = 1, ema=None, shards=None, extra_trainable=None,
           extra_states=None) -> tuple[Path, dict[str, torch.Tensor] | None] | None:
    """Restore ``resume_from_checkpoint`` into ``state``; returns (path, trainable weights or None when ``shards``
    restored them), or None when there is nothing to resume. With ``latest`` a damaged newest checkpoint is
    reported by file and the one before it used. ``extra_trainable`` / ``extra_states`` as for
    ``load_checkpoint``."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint != "latest":
        path = resolve_resume(output_dir, resume_from_checkpoint)
        return path, load_checkpoint(path, state, optimizer=optimizer, lr_scheduler=lr_scheduler, rank=rank,
                                     world_size=world_size, ema=ema, shards=shards,
                                     extra_trainable=extra_trainable, extra_states=extra_states)
    for path in reversed(list_checkpoints(output_dir)):
        try:
            parts = read_checkpoint(path, rank, world_size, shards, extra_trainable=tuple(extra_trainable or ()),
                                    extra_states=tuple(extra_states or ()))
        except CheckpointDamaged as exc:
            log.warning("%s; resuming from the checkpoint before it", exc)
            continue
        return path, _restore(path, parts, state, optimizer, lr_scheduler, ema, shards, extra_trainable,
                              extra_states)
    return None


