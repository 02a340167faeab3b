"""Loading SimpleTuner's config.json: --keys, TRAINER_EXTRA_ARGS, folding, unknown keys, files, round trips."""

from __future__ import annotations

import json

import pytest

from simpletuner.config import (
    CURRENT_CONFIG_VERSION,
    ConfigError,
    dump_train_config,
    load_train_config,
    prepare_train_config,
    write_train_config,
)
from simpletuner.config.loader import parse_extra_args, read_json


def test_simpletuner_config_validates(make_config):
    loaded = load_train_config(make_config())
    config = loaded.config
    assert config.model_family == "flux" and config.model_flavour == "dev"
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.max_train_steps == 1000 and config.num_train_epochs == 0
    assert config.gradient_checkpointing is True
    assert config.base_model_precision == "int8-quanto"
    assert config.resume_from_checkpoint == "latest"
    assert config.validation_resolutions == [(1024, 1024), (1280, 768)]
    # from TRAINER_EXTRA_ARGS
    assert config.lora_alpha == 16.0 and config.validation_on_startup is True and config.vae_batch_size == 8
    # migrated from SimpleTuner's old name
    assert config.flow_schedule_shift == 1.0
    assert loaded.warnings == ["flux_schedule_shift: renamed to flow_schedule_shift"]
    assert loaded.source is None


def test_simpletuner_config_from_file(write_json, make_config):
    path = write_json("config/config.json", make_config())
    loaded = load_train_config(path)
    assert loaded.source == str(path)
    assert loaded.config.seed == 42


def test_trainer_extra_args_win_over_file_keys(make_config):
    config = load_train_config(make_config(TRAINER_EXTRA_ARGS="--lora_rank=64 --seed 7")).config
    assert config.lora_rank == 64 and config.seed == 7


def test_parse_extra_args():
    warnings: list[str] = []
    parsed = parse_extra_args("--a=1 --b 'two words' --flag --c=x=y stray", warnings)
    assert parsed == {"a": "1", "b": "two words", "flag": True, "c": "x=y"}
    assert warnings == ["TRAINER_EXTRA_ARGS: 'stray' is not a --key or --key=value; ignored"]


@pytest.mark.parametrize("text, parsed, ignored", [
    ("stray --a=1 --b 2", {"a": "1", "b": "2"}, ["stray"]),  # a stray word: what follows it is still read
    ("--a=1 --flag", {"a": "1", "flag": True}, []),  # a bare flag last: true
    (["--x", "7", "loose", "--y"], {"x": "7", "y": True}, ["loose"]),  # a list of arguments, as the CLI passes
])
def test_parse_extra_args_reads_past_stray_words_and_a_last_bare_flag(text, parsed, ignored):
    warnings: list[str] = []
    assert parse_extra_args(text, warnings) == parsed
    assert warnings == [f"TRAINER_EXTRA_ARGS: {word!r} is not a --key or --key=value; ignored" for word in ignored]


def test_prepare_refuses_what_load_refuses_naming_the_key(make_config, write_json):
    path = write_json("config.json", make_config(noise_offset=0.1))
    with pytest.raises(ConfigError) as info:
        prepare_train_config(path)
    assert [e.path for e in info.value.errors] == ["noise_offset"] and info.value.source == str(path)
    assert "0.1: is not implemented" in info.value.errors[0].message


def test_write_train_config_is_atomic(make_config, tmp_path, monkeypatch):
    config = load_train_config(make_config()).config
    path = tmp_path / "deep" / "er" / "config.json"
    write_train_config(config, path)
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n") and text.startswith('{\n  "') and json.loads(text) == dump_train_config(config)
    changed = load_train_config(make_config(), overrides={"seed": 99}).config

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr("os.fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_train_config(changed, path)
    assert path.read_text(encoding="utf-8") == text  # the old file, whole
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temporary left


def test_dashes_and_underscores_are_folded():
    config = load_train_config({"--model-family": "flux", "learning-rate": "3e-4", "--lora_rank": 4}).config
    assert config.learning_rate == pytest.approx(3e-4) and config.lora_rank == 4


def test_same_key_twice_with_different_values_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_train_config({"model_family": "flux", "--learning_rate": 1e-4, "learning-rate": 2e-4})
    assert info.value.errors[0].path == "learning_rate"
    assert "given twice with different values" in info.value.errors[0].message
    # the same value twice is fine
    load_train_config({"model_family": "flux", "--learning_rate": 1e-4, "learning_rate": 1e-4})


def test_unknown_keys_warn_with_a_suggestion():
    loaded = load_train_config({"model_family": "flux", "--learning_rat": 1, "lora_rnak": 4, "sparkles": True,
                                "push_to_hub": "false"})
    assert "learning_rat: unknown key, ignored; did you mean 'learning_rate'?" in loaded.warnings
    assert "lora_rnak: unknown key, ignored; did you mean 'lora_rank'?" in loaded.warnings
    assert "sparkles: unknown key, ignored" in loaded.warnings
    assert not [w for w in loaded.warnings if w.startswith("push_to_hub")]  # off: asks for nothing we skip
    assert loaded.config.learning_rate == pytest.approx(1e-4)


def test_overrides_win_and_use_the_same_spellings(make_config):
    config = load_train_config(make_config(), overrides={"--max_train_steps": "10", "lr-warmup-steps": 0}).config
    assert config.max_train_steps == 10 and config.lr_warmup_steps == 0


def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "model_family": "flux",\n  "lora_rank": 16,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert info.value.source == str(path)
    assert "not valid JSON" in str(info.value) and "line 4, column 1" in str(info.value)
    assert str(info.value).startswith(str(path))


def test_missing_file_and_wrong_top_level(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_train_config(tmp_path / "nope.json")
    path = tmp_path / "list.json"
    path.write_text("[]")
    with pytest.raises(ConfigError, match="expected a JSON object of settings, got list"):
        load_train_config(path)


def test_a_file_that_cannot_be_read_is_one_error_on_the_file_itself(tmp_path):
    """Missing, unreadable or not JSON: one error with no field path (it is the file's), saying which."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,,}')
    folder = tmp_path / "a-folder.json"
    folder.mkdir()
    for path, message in ((tmp_path / "nope.json", "file not found"),
                          (folder, "cannot be read: Is a directory"),
                          (bad, "not valid JSON: Expecting property name enclosed in double quotes (line 1, "
                                "column 9)")):
        with pytest.raises(ConfigError) as info:
            read_json(path)
        assert info.value.errors == [("", message)] and info.value.source == str(path)
        assert str(info.value) == f"{path}: {message}"


def test_errors_from_a_file_are_attributed_to_it(write_json):
    path = write_json("config.json", {"model_family": "flux", "lr_scheduler": "cosin"})
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert str(info.value) == (
        f"{path}: lr_scheduler: 'cosin' is not one of constant, constant_with_warmup, linear, cosine, "
        "cosine_with_restarts, polynomial"
    )


def test_dump_round_trips(make_config, tmp_path):
    config = load_train_config(
        make_config(
            tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]},
            webhook_config={"webhook_type": "raw", "callback_url": "http://localhost:8001/hook"},
        )
    ).config
    dumped = dump_train_config(config)
    assert json.loads(json.dumps(dumped)) == dumped
    assert dumped["config_version"] == config.config_version
    again = load_train_config(dumped)
    assert again.config == config and again.warnings == []
    path = tmp_path / "out" / "config.json"
    write_train_config(config, path)
    assert load_train_config(path).config == config


def test_prepare_returns_normalised_values(make_config):
    values, warnings, source = prepare_train_config(make_config())
    assert values["data_backend_config"] == "config/multidatabackend.json"
    assert values["config_version"] == CURRENT_CONFIG_VERSION and "flux_schedule_shift" not in values
    assert source is None and warnings


def test_key_spellings_and_trainer_extra_args_in_the_file(write_json):
    loaded = load_train_config({"model_family": "flux", "--": 1, "--TRAINER_EXTRA_ARGS": "--seed 7 stray",
                                "lora_rank": 8, "vae_dtype": "bf16"}, overrides={"": 2})
    assert (loaded.config.seed, loaded.config.lora_rank) == (7, 8)  # keys after TRAINER_EXTRA_ARGS still read
    assert "'--': empty key ignored" in loaded.warnings and "'': empty key ignored" in loaded.warnings
    assert "TRAINER_EXTRA_ARGS: 'stray' is not a --key or --key=value; ignored" in loaded.warnings
    assert "vae_dtype: unknown key, ignored" in loaded.warnings  # nothing close enough to suggest


@pytest.mark.parametrize("raw, error", [
    ({"model_family": "flux", 1: "x"}, ("1", "keys must be strings")),
    ({"model_family": "flux", "TRAINER_EXTRA_ARGS": 5},
     ("TRAINER_EXTRA_ARGS", "expected a string of --key=value arguments, got 5")),
    ({"model_family": "flux", "--seed": 1, "seed": 2},
     ("seed", "given twice with different values (as '--seed': 1 and 'seed': 2)")),
])
def test_key_errors_are_pinned_whole(raw, error):
    with pytest.raises(ConfigError) as info:
        load_train_config(raw)
    assert info.value.errors == [error]


def test_errors_before_and_after_validation_name_the_file(write_json):
    twice = write_json("twice.json", {"model_family": "flux", "--seed": 1, "seed": 2})
    refused = write_json("refused.json", {"model_family": "flux", "noise_offset": 0.1})
    listed = write_json("list.json", [1])
    for path in (twice, refused, listed):
        with pytest.raises(ConfigError) as info:
            load_train_config(path)
        assert info.value.source == str(path) and str(info.value).startswith(f"{path}: ")
    with pytest.raises(ConfigError) as info:
        load_train_config(listed)
    assert info.value.errors == [("", "expected a JSON object of settings, got list")]
