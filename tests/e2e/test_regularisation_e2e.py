"""Regularisation data (``is_regularisation_data``) in a full fine-tune, end to end: ``simpletuner train`` in a real
subprocess on the tiny Flux with ``model_type: full``. Its samples are trained towards a frozen copy of the base model
(here offloaded block by block, ``regularisation_base_device: cpu``), so a run on regularisation data alone has
nothing to learn: every logged loss is zero and the exported transformer is the base, weight for weight; beside
ordinary data the run trains and moves the weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.e2e.test_train_cli import SERIAL, losses, simpletuner

pytestmark = pytest.mark.e2e
STEPS = 3


def full_run(tmp, datasets: dict[str, bool], **overrides):
    """config.json + multidatabackend.json for a full fine-tune of the tiny Flux on copies of the sample dataset
    (name -> is_regularisation_data)."""
    config = json.loads((REPO / "config" / "config.json").read_text())
    for key in ("--lora_rank", "--lora_alpha", "--lora_dropout", "--lora_target"):
        config.pop(key)
    config.update({"--model_type": "full", "--output_dir": str(tmp / "output"), "--max_train_steps": STEPS,
                   "--checkpointing_steps": STEPS, "--learning_rate": 1e-3, "--lr_warmup_steps": 0,
                   "--data_backend_config": str(tmp / "multidatabackend.json")})
    config.update({f"--{k}": v for k, v in overrides.items()})
    backends = []
    for name, regularisation in datasets.items():
        shutil.copytree(REPO / "datasets" / "sample", tmp / name)
        backends.append({"id": name, "instance_data_dir": str(tmp / name), "caption_strategy": "textfile",
                         "resolution": 32, "resolution_type": "pixel", "is_regularisation_data": regularisation,
                         "cache_dir_vae": str(tmp / "cache" / name)})
    backends.append({"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp / "cache" / "text")})
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "multidatabackend.json").write_text(json.dumps(backends))
    return tmp / "config.json", tmp / "output"


def exported(output) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted((output / "transformer").glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def base_weights() -> dict[str, torch.Tensor]:
    from simpletuner.models.flux import FluxAdapter
    from tests.helpers import flux_config

    return FluxAdapter(flux_config()).load_transformer().state_dict()


def test_regularisation_data_alone_keeps_the_base_model(tmp_path):
    # no weight decay: a zero gradient then leaves every weight where it is
    config, output = full_run(tmp_path, {"reg": True}, adam_weight_decay=0.0, regularisation_base_device="cpu")
    proc = simpletuner("train", "--config", str(config), env=SERIAL)
    assert "frozen copy of the base transformer" in proc.stderr
    assert losses(output) == {step: 0.0 for step in range(1, STEPS + 1)}
    weights, base = exported(output), base_weights()
    assert weights.keys() == base.keys() and all(torch.equal(weights[k], base[k]) for k in base)


def test_full_fine_tune_beside_regularisation_data_trains(tmp_path):
    config, output = full_run(tmp_path, {"data": False, "reg": True})
    simpletuner("train", "--config", str(config), env=SERIAL)
    logged = losses(output)
    # a batch of ordinary data has a loss; one of regularisation data before any update has none
    assert sorted(logged) == list(range(1, STEPS + 1)) and any(v > 0 for v in logged.values())
    weights, base = exported(output), base_weights()
    assert any(not torch.equal(weights[k], base[k]) for k in base)
