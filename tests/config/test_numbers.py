"""Non-finite and absurd numbers are refused with the field named (issue 15: `inf` learning rate, 2**63 steps)."""

from __future__ import annotations

import pytest

from simpletuner.config import ConfigError, load_data_backends, load_train_config


def errors_of(**values) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_train_config({"model_family": "flux", "model_flavour": "tiny", **values})
    return {e.path: e.message for e in info.value.errors}


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "1e400", float("inf"), float("nan")])
def test_non_finite_learning_rate_is_refused(value):
    assert "finite" in errors_of(learning_rate=value)["learning_rate"]


@pytest.mark.parametrize("field", ["lora_alpha", "max_grad_norm", "flow_schedule_shift", "adam_epsilon",
                                   "validation_guidance", "caption_dropout_probability", "resolution"])
def test_every_float_field_refuses_inf_and_nan(field):
    for value in ("inf", float("nan")):
        assert "finite" in errors_of(**{field: value})[field]


@pytest.mark.parametrize("field, value", [
    ("max_train_steps", 2**63), ("max_train_steps", 10**12), ("num_train_epochs", 2**40), ("seed", 2**63),
    ("seed", -1), ("checkpointing_steps", 2**63), ("train_batch_size", 2**31), ("lr_warmup_steps", 2**62),
    ("validation_num_inference_steps", 10**6), ("resolution", 10**9),
])
def test_absurd_integers_are_refused(field, value):
    assert field in errors_of(**{field: value})


def test_sensible_large_values_still_load():
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 500_000,
                                "seed": 2**32 - 1, "learning_rate": "1e-4"}).config
    assert config.max_train_steps == 500_000 and config.seed == 2**32 - 1


def test_data_backend_numbers_are_bounded_and_finite():
    entries = [{"id": "d", "instance_data_dir": "x", "resolution": "inf", "repeats": 2**63},
               {"id": "te", "dataset_type": "text_embeds"}]
    with pytest.raises(ConfigError) as info:
        load_data_backends(entries)
    paths = {e.path for e in info.value.errors}
    assert {"datasets[d].resolution", "datasets[d].repeats"} <= paths


def test_nan_loss_tolerance_is_a_config_field():
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "max_nan_loss_steps": "3"}).config
    assert config.max_nan_loss_steps == 3
    assert "max_nan_loss_steps" in errors_of(max_nan_loss_steps=-1)
