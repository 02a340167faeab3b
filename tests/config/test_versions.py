"""Config versions: one test per migration, plus the step-by-step mechanics."""

from __future__ import annotations

import pytest

from simpletuner.config import CURRENT_CONFIG_VERSION, ConfigError, load_train_config, migrate
from simpletuner.config import versions


def test_every_version_step_has_a_migration():
    assert sorted(versions.MIGRATIONS) == list(range(CURRENT_CONFIG_VERSION))


def test_no_version_means_simpletuner_format():
    assert versions.config_version_of({}) == 0
    assert versions.config_version_of({"config_version": "None"}) == 0
    assert versions.config_version_of({"config_version": "1"}) == 1


@pytest.mark.parametrize(
    "old, new",
    [
        ("flux_schedule_shift", "flow_schedule_shift"),
        ("flux_schedule_auto_shift", "flow_schedule_auto_shift"),
        ("flux_use_uniform_schedule", "flow_use_uniform_schedule"),
        ("flux_sigmoid_scale", "flow_sigmoid_scale"),
        ("flow_matching_sigmoid_scale", "flow_sigmoid_scale"),
    ],
)
def test_v0_to_v1_renames_flow_options(old, new):
    warnings: list[str] = []
    out = migrate({old: "true" if "auto" in old or "uniform" in old else 2.0}, warnings)
    assert old not in out and new in out
    assert out["config_version"] == CURRENT_CONFIG_VERSION
    assert warnings == [f"{old}: renamed to {new}"]


def test_v0_to_v1_keeps_the_new_name_when_both_are_set():
    warnings: list[str] = []
    out = migrate({"flux_schedule_shift": 1, "flow_schedule_shift": 3}, warnings)
    assert out["flow_schedule_shift"] == 3 and "flux_schedule_shift" not in out
    assert "also set" in warnings[0]


@pytest.mark.parametrize("value", ["lora", "Standard", "standard"])
def test_v0_to_v1_lora_type_spellings(value):
    assert migrate({"lora_type": value})["lora_type"] == "standard"


def test_current_config_is_not_migrated_again():
    warnings: list[str] = []
    raw = {"config_version": CURRENT_CONFIG_VERSION, "flux_schedule_shift": 1, "flux_lora_target": "x"}
    assert migrate(raw, warnings) == raw and warnings == []


@pytest.mark.parametrize("old, new, value", [("flux_lora_target", "lora_target", "context"),
                                             ("flux_guidance_value", "guidance_value", 3.5)])
def test_v1_to_v2_family_options_become_checked_values(old, new, value):
    warnings: list[str] = []
    out = versions.MIGRATIONS[1]({"config_version": 1, "model_family": "flux", old: value}, warnings)
    assert out == {"config_version": 1, "model_family": "flux", new: value}
    assert warnings == []  # SimpleTuner's spelling is a valid alias, not a deprecated name
    # and the loaded config carries it as the family-checked value
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", old: value}).config
    assert getattr(config, new) == value


def test_v1_to_v2_flux_option_on_another_family_is_dropped_with_a_warning():
    warnings: list[str] = []
    out = migrate({"config_version": 1, "model_family": "sd3", "flux_lora_target": "all"}, warnings)
    assert "flux_lora_target" not in out and "lora_target" not in out
    assert warnings == ["flux_lora_target: only applies to model_family flux, not 'sd3'; ignored"]


def test_v1_to_v2_keeps_the_new_name_when_both_are_set():
    warnings: list[str] = []
    out = migrate({"config_version": 1, "flux_lora_target": "all", "lora_target": "mmdit"}, warnings)
    assert out["lora_target"] == "mmdit" and "also set" in warnings[0]


@pytest.mark.parametrize("old, new, flavour", [("flux_fast_schedule", "flow_fast_schedule", "dev"),
                                               ("flux_attention_masked_training", "attention_masked_training", "dev")])
def test_v2_to_v3_more_flux_options_become_checked_values(old, new, flavour):
    warnings: list[str] = []
    out = versions.MIGRATIONS[2]({"config_version": 2, "model_family": "flux", old: "true"}, warnings)
    assert out == {"config_version": 2, "model_family": "flux", new: "true"} and warnings == []
    config = load_train_config({"model_family": "flux", "model_flavour": flavour, old: "true"}).config
    assert getattr(config, new) is True
    dropped = migrate({"config_version": 2, "model_family": "sd3", old: True}, warnings)
    assert old not in dropped and new not in dropped and "only applies to model_family flux" in warnings[0]


def test_flavour_defaults_fill_what_the_config_leaves_empty():
    """schnell trains on its fast schedule, LibreFlux with masked attention, unless the config says otherwise."""
    schnell = load_train_config({"model_family": "flux", "model_flavour": "schnell"}).config
    assert schnell.flow_fast_schedule is True and schnell.attention_masked_training is False
    libre = load_train_config({"model_family": "flux", "model_flavour": "libreflux"}).config
    assert libre.attention_masked_training is True and libre.flow_fast_schedule is False
    off = load_train_config({"model_family": "flux", "model_flavour": "schnell", "flux_fast_schedule": False}).config
    assert off.flow_fast_schedule is False


def test_migrations_apply_step_by_step(monkeypatch):
    calls = []

    def v1_to_v2(raw, warnings):
        calls.append(raw["config_version"])
        out = dict(raw)
        out["renamed_in_v2"] = out.pop("old_in_v1", None)
        return out

    monkeypatch.setattr(versions, "CURRENT_CONFIG_VERSION", 2)
    monkeypatch.setitem(versions.MIGRATIONS, 1, v1_to_v2)
    out = versions.migrate({"flux_schedule_shift": 2, "old_in_v1": "x"})
    assert calls == [1]  # v0→v1 ran first and recorded version 1
    assert out == {"flow_schedule_shift": 2, "renamed_in_v2": "x", "config_version": 2}


def test_newer_version_is_refused():
    with pytest.raises(ConfigError) as info:
        load_train_config({"model_family": "flux", "config_version": CURRENT_CONFIG_VERSION + 1})
    assert info.value.errors[0].path == "config_version"


def test_bad_version_values():
    with pytest.raises(ConfigError, match="config_version: expected an integer"):
        migrate({"config_version": "one"})
    with pytest.raises(ConfigError, match="config_version: must be >= 0"):
        migrate({"config_version": -1})


@pytest.mark.parametrize("value, version", [(None, 0), ("", 0), (" None ", 0), ("null", 0), ("NULL", 0), ("0", 0),
                                            (0, 0), (" 2 ", 2), (3, 3)])
def test_config_version_spellings(value, version):
    from simpletuner.config.versions import config_version_of

    assert config_version_of({"config_version": value}) == version
    assert config_version_of({}) == 0


def test_negative_version_is_refused_by_name():
    from simpletuner.config.versions import config_version_of

    with pytest.raises(ConfigError) as info:
        config_version_of({"config_version": "-1"})
    assert [(e.path, e.message) for e in info.value.errors] == [("config_version", "must be >= 0, got -1")]


def test_v2_to_v3_keeps_the_new_name_when_both_are_set():
    from simpletuner.config.versions import migrate

    warnings: list[str] = []
    out = migrate({"config_version": 2, "model_family": "flux", "flux_fast_schedule": True,
                   "flow_fast_schedule": False}, warnings)
    assert out["flow_fast_schedule"] is False and "flux_fast_schedule" not in out
    assert warnings == ["flux_fast_schedule: renamed to flow_fast_schedule, which is also set; using "
                        "flow_fast_schedule=False"]
