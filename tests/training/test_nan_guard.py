"""A run whose loss turns NaN/inf stops with a clear failure (``max_nan_loss_steps`` in a row are skipped first),
and never ends "succeeded" with a NaN LoRA. The real trainer, in-process, on the tiny Flux."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from simpletuner.config import load_data_backends, load_train_config
from simpletuner.training.trainer import train


def test_guard_counts_steps_in_a_row():
    from simpletuner.training.guards import LossNotFinite, NanLossGuard

    guard = NanLossGuard(2)
    for step, loss in enumerate([0.5, float("nan"), float("inf"), 0.4, float("nan"), float("nan")], start=1):
        guard.check(step, loss)
    with pytest.raises(LossNotFinite, match="step 7.*3 step\\(s\\) in a row.*max_nan_loss_steps=2"):
        guard.check(7, float("nan"))


def test_require_finite_names_the_tensor():
    from simpletuner.training.guards import LossNotFinite, require_finite

    require_finite({"a": torch.ones(2), "steps": torch.tensor([3])}, 5, "checkpoint")
    with pytest.raises(LossNotFinite, match="checkpoint at step 5.*lora_B"):
        require_finite({"lora_A": torch.ones(2), "lora_B": torch.tensor([1.0, float("nan")])}, 5, "checkpoint")


def _setup(tmp: Path, dataset: Path, out: str, **extra):
    config = load_train_config({
        "model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0, "lora_rank": 4,
        "train_batch_size": 1, "learning_rate": 1e-3, "output_dir": str(tmp / out), "report_to": "none",
        "checkpointing_steps": 4, **extra}).config
    backends = load_data_backends([
        {"id": "s", "instance_data_dir": str(dataset), "caption_strategy": "textfile", "resolution": 64,
         "resolution_type": "pixel", "cache_dir_vae": str(tmp / "cache" / "vae")},
        {"id": "te", "dataset_type": "text_embeds", "cache_dir": str(tmp / "cache" / "text")}], config=config)
    return config, backends


def _poison(cache: Path, how_many: int | None = None) -> int:
    files = sorted(cache.rglob("*.safetensors"))[:how_many]
    for f in files:
        t = load_file(f)
        save_file({k: torch.full_like(v, float("nan")) for k, v in t.items()}, f)
    return len(files)


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny_flux_path):
    """Caches filled by one short run (shared: each test copies them)."""
    import shutil

    from tests.conftest import REPO

    tmp = tmp_path_factory.mktemp("nan")
    shutil.copytree(REPO / "datasets" / "sample", tmp / "sample")
    train(*_setup(tmp, tmp / "sample", "warmup", max_train_steps=1))
    return tmp


def _copy(warm, tmp_path):
    import shutil

    shutil.copytree(warm / "cache", tmp_path / "cache")
    return tmp_path


def test_nan_loss_stops_the_run_without_saving_nan_weights(warm, tmp_path):
    tmp = _copy(warm, tmp_path)
    _poison(tmp / "cache" / "vae")  # every latent NaN: every step's loss is NaN
    with pytest.raises(ValueError, match="loss is nan at step 1"):  # LossNotFinite
        train(*_setup(tmp, warm / "sample", "run", max_train_steps=6))
    out = tmp / "run"
    assert not (out / "pytorch_lora_weights.safetensors").exists() and not (out / "run_summary.json").exists()
    assert not list(out.glob("checkpoint-*"))


def test_tolerated_nan_steps_update_nothing_and_the_run_succeeds(warm, tmp_path):
    tmp = _copy(warm, tmp_path)
    assert _poison(tmp / "cache" / "vae", how_many=1) == 1  # one image of twelve
    result = train(*_setup(tmp, warm / "sample", "run", max_train_steps=12, max_nan_loss_steps=1))
    assert sum(1 for loss in result.losses if math.isnan(loss)) == 1  # each image once per epoch
    lora = load_file(result.lora_path)
    assert all(torch.isfinite(t).all() for t in lora.values())
    assert json.loads((tmp / "run" / "run_summary.json").read_text())["global_step"] == 12
