"""Experiment trackers for ``report_to``: wandb, TensorBoard, both ("all") or none.

Logs land under ``logging_dir`` (relative to ``output_dir`` unless absolute): TensorBoard event files in
``<logging_dir>/tensorboard/<run name>``, wandb's run folder in ``<logging_dir>/wandb``. wandb honours
``WANDB_MODE`` (``offline`` needs no network and no account; ``wandb sync`` uploads later).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("simpletuner.evaluation")

# config keys never sent to a tracker (they may hold secrets)
_PRIVATE_KEYS = {"webhook_config"}


def tracker_names(report_to: str | None) -> list[str]:
    if report_to in (None, "", "none"):
        return []
    if report_to == "all":
        return ["wandb", "tensorboard"]
    if report_to in ("wandb", "tensorboard"):
        return [report_to]
    raise ValueError(f"report_to: {report_to!r} is not one of none, wandb, tensorboard, all")


def logging_dir(config) -> Path:
    folder = Path(config.logging_dir or "logs").expanduser()
    return folder if folder.is_absolute() else Path(config.output_dir) / folder


class Trackers:
    """Scalars and images to the trackers named by ``report_to``; does nothing for ``none``."""

    def __init__(self, config, *, run_name: str | None = None):
        self.names = tracker_names(config.report_to)
        self.folder = logging_dir(config)
        self.run_name = run_name or config.tracker_run_name or time.strftime("run-%Y%m%d-%H%M%S")
        self.wandb_run = None
        self.writer = None
        if not self.names:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder / "tensorboard" / self.run_name), flush_secs=10)
        if "wandb" in self.names:
            self.wandb_run = _start_wandb(config, self.folder, self.run_name)

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def log_images(self, images: dict[str, object], step: int, captions: dict[str, str] | None = None) -> None:
        """``{tag: PIL image}`` as validation images."""
        if not images:
            return
        if self.writer is not None:
            import numpy as np

            for tag, image in images.items():
                self.writer.add_image(tag, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")
        if self.wandb_run is not None:
            import wandb

            captions = captions or {}
            self.wandb_run.log({tag: wandb.Image(image, caption=captions.get(tag)) for tag, image in images.items()},
                               step=step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(config, folder: Path, run_name: str):
    try:
        import wandb
    except ImportError:
        raise ImportError("report_to: 'wandb' needs the wandb package (pip install wandb)") from None
    public = {k: v for k, v in config.model_dump(mode="json").items() if k not in _PRIVATE_KEYS}
    try:
        return wandb.init(
            project=config.tracker_project_name, name=config.tracker_run_name or run_name, dir=str(folder),
            config=public, settings=wandb.Settings(console="off"),
        )
    except Exception as exc:
        mode = os.environ.get("WANDB_MODE", "online")
        raise RuntimeError(
            f"report_to: wandb could not start (WANDB_MODE={mode}): {str(exc).rstrip('.')}. Log in with `wandb login`, or set "
            "WANDB_MODE=offline to keep the run on disk and `wandb sync` it later."
        ) from exc
