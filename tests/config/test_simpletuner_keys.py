"""SimpleTuner's documented keys that are not our fields: accepted, refused with what to use instead, or warned about
(never "unknown key, ignored"), in config.json and in multidatabackend.json."""

from __future__ import annotations

import pytest

from simpletuner.config import ConfigError, load_train_config, parse_data_backends
from simpletuner.config.data import DatasetBackend
from simpletuner.config.simpletuner_keys import ALIASES, DATASET_KEYS, TRAIN_KEYS
from simpletuner.config.train import TrainConfig


def test_no_ruled_key_is_a_field_and_aliases_name_fields():
    # a rule for a key we implement would hide the implementation
    assert not set(TRAIN_KEYS) & set(TrainConfig.model_fields)
    assert not set(DATASET_KEYS) & set(DatasetBackend.model_fields)
    assert set(ALIASES.values()) <= set(TrainConfig.model_fields)


def _load(**keys):
    return load_train_config({"model_family": "flux", **keys})


def _errors(exc: ConfigError) -> dict[str, str]:
    return {e.path: e.message for e in exc.errors}


@pytest.mark.parametrize("key, value", [
    ("push_to_hub", "false"), ("push_to_hub", False), ("noise_offset", 0), ("noise_offset", "0.0"),
    ("lr_end", 1e-7), ("lr_num_cycles", "1"), ("data_backend_sampling", "uniform"), ("ema_cpu_only", True),
    ("checkpointing_use_tempdir", True), ("validation_lycoris_strength", 1.0), ("validation_guidance_rescale", 0.0),
    ("use_dora", "false"), ("model_card_safe_for_work", True), ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
    ("fsdp_cpu_ram_efficient_loading", False),
])
def test_values_that_ask_for_nothing_we_skip_are_accepted_silently(key, value):
    loaded = _load(**{key: value})
    assert not [w for w in loaded.warnings if key in w]


@pytest.mark.parametrize("key, value, says", [
    ("push_to_hub", "true", "hf upload"),
    ("noise_offset", 0.1, "remove it or set 0"),
    ("use_dora", True, "lora_type: lycoris"),
    ("lr_end", 1e-5, "decays linearly"),
    ("validation_guidance_rescale", 0.7, "validation_guidance_real"),
    ("data_backend_sampling", "auto-weighting", "uniform"),
    ("ema_cpu_only", False, "ema_device: accelerator"),
    ("minimum_image_size", 512, "multidatabackend.json"),
    ("fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"),
    ("fsdp_cpu_ram_efficient_loading", True, "every process loads the base weights"),
])
def test_other_values_are_refused_naming_the_key_and_what_to_use(key, value, says):
    with pytest.raises(ConfigError) as info:
        _load(**{key: value})
    message = _errors(info.value)[key]
    assert repr(value) in message and says in message


def test_a_refused_key_is_reported_beside_the_schema_errors():
    with pytest.raises(ConfigError) as info:
        _load(push_to_hub=True, learning_rate="fast")
    assert set(_errors(info.value)) == {"push_to_hub", "learning_rate"}


@pytest.mark.parametrize("key, value, says", [
    ("allow_tf32", True, "has no effect"),
    ("hub_model_id", "me/my-lora", "hf upload"),
    ("disable_benchmark", False, "validation_on_startup"),
])
def test_keys_that_change_no_result_warn(key, value, says):
    loaded = _load(**{key: value})
    [warning] = [w for w in loaded.warnings if w.startswith(f"{key}:")]
    assert says in warning and "unknown key" not in warning


def test_simpletuner_newer_spellings_are_our_fields():
    config = _load(checkpoint_step_interval=250, **{"--validation_step_interval": "100"}).config
    assert (config.checkpointing_steps, config.validation_steps) == (250, 100)


def test_flux_attention_masked_training_is_implemented_not_refused():
    config = _load(model_flavour="dev", flux_attention_masked_training=True).config
    assert config.attention_masked_training is True


def _dataset(**keys):
    return [{"id": "pics", "type": "local", "instance_data_dir": "x", **keys},
            {"id": "text", "type": "local", "dataset_type": "text_embeds", "default": True, "cache_dir": "c"}]


def test_dataset_keys_accepted_warned_and_refused():
    quiet = parse_data_backends(_dataset(metadata_backend="discovery", skip_file_discovery="", hash_filenames=True))
    assert not [w for w in quiet.warnings if "pics" in w]
    warned = parse_data_backends(_dataset(skip_file_discovery="vae aspect"))
    assert [w for w in warned.warnings if w.startswith("datasets[pics].skip_file_discovery: has no effect")]
    with pytest.raises(ConfigError) as info:
        parse_data_backends(_dataset(metadata_backend="parquet", maximum_aspect_ratio=2.0))
    errors = _errors(info.value)
    assert "'discovery'" in errors["datasets[pics].metadata_backend"]
    assert "not implemented" in errors["datasets[pics].maximum_aspect_ratio"]


@pytest.mark.parametrize("spelling", [None, False, 0, 0.0, "", " ", "false", " FALSE ", "0", "0.0", "no", "Off",
                                      "none", "NULL"])
def test_every_off_spelling_of_a_key_asking_for_nothing_is_accepted(spelling):
    """SimpleTuner's JSON and command line spell "off" many ways; each is accepted silently (push_to_hub)."""
    assert "push_to_hub" not in " ".join(_load(push_to_hub=spelling).warnings)


@pytest.mark.parametrize("spelling", [True, 1, "true", "on", "0.00", "nope", "n", [], {}])
def test_a_value_that_is_not_off_is_refused(spelling):
    with pytest.raises(ConfigError) as info:
        _load(push_to_hub=spelling)
    assert "hf upload" in _errors(info.value)["push_to_hub"]


@pytest.mark.parametrize("spelling, accepted", [
    (True, True), ("true", True), (" TRUE ", True), ("1", True), ("yes", True), ("On", True),
    (False, False), (1, False), ("enabled", False), ("0", False), (None, False),
])
def test_ema_cpu_only_is_accepted_only_when_on(spelling, accepted):
    """ema_cpu_only asks for the default (ema_device: cpu) only when it is on; off asks for the accelerator."""
    if accepted:
        assert "ema_cpu_only" not in " ".join(_load(ema_cpu_only=spelling).warnings)
        return
    with pytest.raises(ConfigError) as info:
        _load(ema_cpu_only=spelling)
    assert "ema_device: accelerator" in _errors(info.value)["ema_cpu_only"]


def test_equals_compares_numbers_as_numbers_and_text_without_case():
    from simpletuner.config.simpletuner_keys import _equals

    one, uniform, both = _equals(1), _equals("uniform"), _equals(1e-7, "auto")
    assert one(1) and one(1.0) and one("1") and one(" 1.0 ") and one(0) and one("off") and one(None)  # off: accepted
    assert not one(2) and not one("one") and not one([1]) and not one("1e-7")
    assert uniform(" Uniform ") and uniform("") and not uniform("uniformly") and not uniform(1)
    assert both(1e-7) and both("1e-07") and both("AUTO") and not both("1e-6") and not both(True)


def test_apply_rules_goes_on_past_an_accepted_key():
    from simpletuner.config.simpletuner_keys import apply_rules

    rest, errors, warnings = apply_rules({"push_to_hub": False, "lora_rank": 4, "allow_tf32": True, "seed": 1,
                                          "noise_offset": 0.5}, TRAIN_KEYS, prefix="x.")
    assert rest == {"lora_rank": 4, "seed": 1}
    assert errors == [("x.noise_offset", "0.5: " + TRAIN_KEYS["noise_offset"].message)]
    assert warnings == ["x.allow_tf32: " + TRAIN_KEYS["allow_tf32"].message]
