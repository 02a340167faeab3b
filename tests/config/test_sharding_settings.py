"""The sharded-training settings (fsdp_*, deepspeed_config): SimpleTuner's spellings, and every value or combination
a sharded run cannot take refused with the field's name."""

from __future__ import annotations

import json

import pytest

from simpletuner.config import ConfigError
from simpletuner.config.requirements import device_errors, missing_packages
from tests.helpers import flux_config


def _errors(**values) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        flux_config(**values)
    return {e.path: e.message for e in info.value.errors}


def test_simpletuner_spellings():
    config = flux_config(**{"--fsdp_enable": "true", "--fsdp_version": "2", "--fsdp_reshard_after_forward": "false",
                            "--fsdp_state_dict_type": "full",
                            "--fsdp_transformer_layer_cls_to_wrap": "FluxTransformerBlock, FluxSingleTransformerBlock"})
    assert config.fsdp_enable and config.fsdp_version == 2 and not config.fsdp_reshard_after_forward
    assert config.fsdp_state_dict_type == "FULL_STATE_DICT"
    assert config.fsdp_transformer_layer_cls_to_wrap == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert flux_config(fsdp_state_dict_type="sharded").fsdp_state_dict_type == "SHARDED_STATE_DICT"
    assert flux_config(fsdp_state_dict_type="SHARDED_STATE_DICT").fsdp_state_dict_type == "SHARDED_STATE_DICT"
    assert not flux_config().fsdp_enable and flux_config().deepspeed_config is None


@pytest.mark.parametrize("values, field, says", [
    ({"fsdp_version": 1}, "fsdp_version", "FSDP1 is not supported; use 2"),
    ({"fsdp_state_dict_type": "local"}, "fsdp_state_dict_type", "SHARDED_STATE_DICT"),
    ({"fsdp_transformer_layer_cls_to_wrap": "Flux-Block"}, "fsdp_transformer_layer_cls_to_wrap",
     "'Flux-Block' is not a class name"),
    ({"deepspeed_config": {"zero_optimization": {"stage": 5}}}, "deepspeed_config",
     "zero_optimization.stage: 5 is not a ZeRO stage"),
    ({"deepspeed_config": {"zero_optimization": 2}}, "deepspeed_config", "zero_optimization: expected an object"),
    ({"deepspeed_config": "[1, 2]"}, "deepspeed_config", "expected a JSON object, got list"),
    ({"deepspeed_config": {"optimizer": {"type": "Adam"}}}, "deepspeed_config",
     "optimizer: the trainer builds its own from the config's optimizer"),
    ({"deepspeed_config": {"scheduler": {"type": "WarmupLR"}}}, "deepspeed_config", "config's lr_scheduler"),
    ({"deepspeed_config": "/nowhere/ds.json"}, "deepspeed_config", "file '/nowhere/ds.json' not found"),
    ({"fsdp_enable": True, "deepspeed_config": {}}, "deepspeed_config", "cannot be combined with fsdp_enable"),
])
def test_bad_values_name_the_field(values, field, says):
    errors = _errors(**values)
    assert says in errors[field], errors


def test_deepspeed_config_from_a_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    assert flux_config(deepspeed_config=str(path)).deepspeed_config["zero_optimization"] == {"stage": 3}
    path.write_text("{not json")
    assert "ds.json: not valid JSON" in _errors(deepspeed_config=str(path))["deepspeed_config"]


@pytest.mark.parametrize("mode", [{"fsdp_enable": True}, {"deepspeed_config": {"zero_optimization": {"stage": 2}}}])
@pytest.mark.parametrize("values, field", [
    ({"use_ema": True}, "use_ema"),
    ({"enable_group_offload": True}, "enable_group_offload"),
    ({"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]}},
     "tread_config"),
    ({"compile": True}, "compile"),
    ({"validation_steps": 10, "validation_prompt": "a cat"}, "validation_steps"),
    ({"validation_on_startup": True}, "validation_on_startup"),
    ({"eval_steps_interval": 5}, "eval_steps_interval"),
    ({"base_model_precision": "int8-quanto"}, "base_model_precision"),
    ({"lora_type": "lycoris", "lycoris_config": {"algo": "lokr"}}, "lora_type"),
])
def test_what_a_sharded_run_cannot_take_is_refused(mode, values, field):
    errors = _errors(**mode, **values)
    assert f"cannot be combined with {next(iter(mode))}" in errors[field], errors


def test_devices_and_packages():
    ds = flux_config(deepspeed_config={"zero_optimization": {"stage": 2}}).__dict__
    assert [e.path for e in device_errors(ds, "cpu")] == ["deepspeed_config"]
    assert [e.path for e in device_errors(ds, "mps")] == ["deepspeed_config"]
    assert device_errors(ds, "cuda") == []
    missing = [e for e in missing_packages(ds) if e.path == "deepspeed_config"]
    assert missing and "pip install 'simpletuner[deepspeed]'" in missing[0].message  # not installed here
    fsdp_bf16 = flux_config(fsdp_enable=True, mixed_precision="bf16").__dict__
    assert "trains in fp32" in device_errors(fsdp_bf16, "cpu")[0].message
    assert device_errors(fsdp_bf16, "cuda") == []
    assert device_errors(flux_config(fsdp_enable=True).__dict__, "cpu") == []


def test_a_sharded_run_alone_is_accepted_and_each_refusal_says_why():
    assert flux_config(fsdp_enable=True).fsdp_enable
    assert flux_config(deepspeed_config={"zero_optimization": {"stage": 2}}).deepspeed_config is not None
    # use_ema False is "off", not a value to refuse
    assert flux_config(fsdp_enable=True, use_ema=False, compile=False, lora_type="standard").fsdp_enable
    both = _errors(fsdp_enable=True, deepspeed_config={"zero_optimization": {"stage": 2}})
    assert both == {"deepspeed_config": "cannot be combined with fsdp_enable; choose one"}
    assert _errors(deepspeed_config={}, use_ema=True) == {
        "use_ema": "cannot be combined with deepspeed_config yet: the EMA would average one process's shard only"}
    assert _errors(fsdp_enable=True, base_model_precision="int8-quanto") == {
        "base_model_precision": "'int8-quanto' cannot be combined with fsdp_enable: quantized weights cannot be "
                                "sharded here; use no_change"}
    assert _errors(fsdp_enable=True, lora_type="lycoris", lycoris_config={"algo": "lokr"}) == {
        "lora_type": "'lycoris' cannot be combined with fsdp_enable yet; use 'standard'"}
    # a full fine-tune has no lora_type to refuse, whatever the field holds
    assert flux_config(fsdp_enable=True, model_type="full").model_type == "full"
