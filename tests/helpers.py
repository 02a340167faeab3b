"""Helpers shared by tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import types


def flux_config(**overrides):
    """A TrainConfig for the tiny Flux, validated by the real config schema."""
    from simpletuner.config import load_train_config

    values = {"model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0,
              "max_train_steps": 10, "data_backend_config": "unused.json"}
    values.update(overrides)
    return load_train_config(values).config


def namespace(**kwargs):
    return types.SimpleNamespace(**kwargs)
