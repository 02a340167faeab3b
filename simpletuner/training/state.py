"""Where a run is, in one object: step, epoch, data position, the trainer's RNG, and its losses.

The loop advances it; checkpoints save and restore it (``checkpoint.py``); the evaluator and reporter read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class RunState:
    """One process's training position. ``generator`` draws everything random in a step (noise, timesteps, caption
    dropout, TREAD's token choice), seeded per process, so a resumed run draws what an uninterrupted one would."""

    generator: torch.Generator
    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    last_loss: float | None = None
    best_loss: float | None = None
    # this process's step losses since it started (a resumed run's earlier losses are in training_log.jsonl)
    losses: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, seed: int | None, process_index: int = 0) -> RunState:
        return cls(generator=torch.Generator().manual_seed((seed or 0) + process_index))

    def record_step(self, loss: float) -> None:
        """One optimizer step finished with ``loss``."""
        self.global_step += 1
        self.losses.append(loss)
        self.last_loss = loss
        if math.isfinite(loss) and (self.best_loss is None or loss < self.best_loss):
            self.best_loss = loss

    def next_epoch(self) -> None:
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def position(self) -> dict:
        """What ``training_state.json`` records (JSON-safe)."""
        return {"global_step": self.global_step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "last_loss": self.last_loss, "best_loss": self.best_loss}

    def restore_position(self, saved: dict) -> None:
        self.global_step = int(saved["global_step"])
        self.epoch = int(saved["epoch"])
        self.batch_in_epoch = int(saved["batch_in_epoch"])
        self.last_loss = saved.get("last_loss")
        self.best_loss = saved.get("best_loss")
