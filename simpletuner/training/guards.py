"""Stops a diverging run: a step whose loss is NaN or inf updates nothing, ``max_nan_loss_steps`` of them in a row
stop the run with a clear failure, and no checkpoint or final model is ever written with non-finite weights."""

from __future__ import annotations

import math

import torch


class LossNotFinite(ValueError):
    """The loss (or the weights) stopped being finite numbers; the run stops, its last checkpoint is intact."""


class NanLossGuard:
    """Counts steps in a row whose loss is not finite; more than ``tolerance`` of them stop the run."""

    def __init__(self, tolerance: int):
        self.tolerance = int(tolerance or 0)
        self.in_a_row = 0

    def check(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row > self.tolerance:
            raise LossNotFinite(
                f"loss is {loss} at step {step} ({self.in_a_row} step(s) in a row; max_nan_loss_steps="
                f"{self.tolerance}). Those steps did not update the weights; lower learning_rate or check the "
                "data, then Retry: it resumes from the last checkpoint")


def require_finite(tensors: dict[str, torch.Tensor], step: int, what: str) -> None:
    """LossNotFinite when any weight is NaN or inf (never saved as a checkpoint or a finished model)."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise LossNotFinite(f"{what} at step {step}: {len(bad)} weight tensor(s) are not finite (e.g. {bad[0]}); "
                            "not saved. Lower learning_rate or check the data, then Retry from the last checkpoint")
