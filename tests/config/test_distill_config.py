"""The ``distillation`` block: defaults, spellings, field-named errors, the step list, paths, data backends."""

from __future__ import annotations

import json

import pytest

from simpletuner.config import ConfigError, dump_train_config, load_data_backends, load_train_config
from simpletuner.config.distill import warped_step_list


def load(distillation, **values):
    return load_train_config({"model_family": "flux", "model_flavour": "tiny", "distillation": distillation,
                              "max_train_steps": 10, **values}).config


def errors_of(distillation, **values) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load(distillation, **values)
    return {e.path: e.message for e in info.value.errors}


def test_defaults():
    d = load({"prompts": ["a red circle"]}).distillation
    assert d.objective == "dmd" and d.objectives == ("dmd",) and d.has_critic
    assert d.denoising_step_list == [1000, 750, 500, 250] and d.student_timesteps == [1000, 750, 500, 250]
    assert d.student_sampler == "consistency" and d.generator_update_ratio == 5
    assert load({"objective": "ode_regression", "prompts": ["x"]}).distillation.student_sampler == "ode"


@pytest.mark.parametrize("spelling, canonical", [("DMD + GAN", "dmd+gan"), (["gan", "dmd"], "dmd+gan"),
                                                  ("sid+gan", "sid+gan"), ("ODE_Regression", "ode_regression")])
def test_objective_spellings(spelling, canonical):
    config = load({"objective": spelling, "prompts": ["x"]})
    assert config.distillation.objective == canonical
    assert set(config.distillation.objectives) == set(canonical.split("+"))


def test_a_json_string_from_the_command_line():
    config = load(json.dumps({"objective": "sid", "prompts": ["x"], "sid_alpha": 1.2}))
    assert config.distillation.objective == "sid" and config.distillation.sid_alpha == 1.2


@pytest.mark.parametrize("block, path, message", [
    ({"objective": "dmd+ode_regression"}, "distillation.objective", "cannot be combined"),
    ({"objective": "consistency"}, "distillation.objective", "'consistency' is not one of"),
    ({"denoising_step_list": [1000, 750, 800]}, "distillation.denoising_step_list[2]", "not below the step before"),
    ({"denoising_step_list": [1200, 500]}, "distillation.denoising_step_list[0]", "outside 0..1000"),
    ({"denoising_step_list": [1000, 0, 0]}, "distillation.denoising_step_list[1]", "may only come last"),
    ({"denoising_step_list": []}, "distillation.denoising_step_list", "at least one timestep"),
    ({"denoising_step_list": [1000, "half"]}, "distillation.denoising_step_list[1]", "expected an integer"),
    ({"sid_alpha": 1.2}, "distillation.sid_alpha", "applies to sid; objective is 'dmd'"),
    ({"r1_weight": 0.1}, "distillation.r1_weight", "applies to gan"),
    ({"objective": "ode_regression", "generator_update_ratio": 2}, "distillation.generator_update_ratio",
     "applies to dmd and sid and gan"),
    ({"objective": "dmd", "ode_pairs_per_prompt": 3}, "distillation.ode_pairs_per_prompt", "applies to"),
    ({"generator_learning_rate": -1}, "distillation.generator_learning_rate", "must be > 0"),
    ({"timestep_shift": 0}, "distillation.timestep_shift", "must be > 0"),
    ({"prompts": ["ok", "  "]}, "distillation.prompts[1]", "is empty"),
    ({"student_sampler": "euler"}, "distillation.student_sampler", "'euler' is not one of consistency, ode"),
    ({"critic_lr": 1e-5}, "distillation.critic_lr", "unknown key"),
    ({"num_frame_per_block": 2}, "distillation.num_frame_per_block", "applies to a causal student"),
    ({"causal": True}, "distillation.causal", "the causal (Self-Forcing) student is a Wan"),
    ({"context_noise": 1200}, "distillation.context_noise", "must be <= 1000"),
])
def test_errors_name_the_field(block, path, message):
    errors = errors_of({"prompts": ["x"], **block})
    assert path in errors and message in errors[path], errors


def test_fine_tuning_settings_it_does_not_read_are_refused():
    errors = errors_of({"prompts": ["x"]}, caption_dropout_probability=0.1,
                       tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]})
    assert errors["caption_dropout_probability"] == ("is not used by the distillation recipe; remove it (or the "
                                                     "distillation block)")
    assert "tread_config" in errors
    errors = errors_of({"prompts": ["x"]}, max_train_steps=None, num_train_epochs=3, gradient_accumulation_steps=2)
    assert errors["max_train_steps"] == ("a distillation learns from prompts, with no epochs over a dataset: set "
                                         "max_train_steps")
    assert "raise train_batch_size" in errors["gradient_accumulation_steps"]


@pytest.mark.parametrize("values, field, message", [
    ({"eval_steps_interval": 5}, "eval_steps_interval", "is not used by the distillation recipe; remove it (or the "
                                                        "distillation block)"),
    ({"lora_type": "lycoris", "lycoris_config": {"algo": "lokr"}}, "lora_type", "is not used by the distillation"),
    ({"fsdp_enable": True}, "fsdp_enable", "the distillation recipe runs unsharded (its critic and GAN head are not "
                                           "sharded); remove it (or the distillation block)"),
    ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, "deepspeed_config", "runs unsharded"),
    ({"train_from_cache": True}, "train_from_cache", "the distillation recipe encodes its prompts itself; remove it "
                                                     "(or the distillation block)"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps", "the distillation recipe steps every network "
                                                                        "every step; raise train_batch_size instead"),
])
def test_each_refused_setting_is_named_with_its_reason(values, field, message):
    errors = errors_of({"prompts": ["x"]}, **values)
    assert message in errors[field], errors


def test_what_a_distillation_takes_is_not_refused():
    config = load({"prompts": ["x"]}, eval_steps_interval=None, caption_dropout_probability=0.0, lora_type="standard",
                  gradient_accumulation_steps=1, train_from_cache=False)
    assert config.distillation.prompts == ["x"]
    assert load({"prompts": ["x"]}, model_type="full").model_type == "full"


def test_a_causal_wan_student():
    config = load_train_config({"model_family": "wan", "model_flavour": "tiny", "max_train_steps": 1,
                                "distillation": {"prompts": ["x"], "causal": True, "num_frame_per_block": 2,
                                                 "local_attn_size": 4, "context_noise": 100}}).config
    assert config.distillation.causal and config.distillation.num_frame_per_block == 2
    with pytest.raises(ConfigError, match="distillation.local_attn_size: 1 frames is less than a block"):
        load_train_config({"model_family": "wan", "model_flavour": "tiny", "max_train_steps": 1,
                           "distillation": {"prompts": ["x"], "causal": True, "local_attn_size": 1}})


def test_warped_step_list_follows_the_shifted_schedule():
    d = load({"prompts": ["x"], "timestep_shift": 5.0, "warp_denoising_step": True,
              "denoising_step_list": [1000, 750, 500, 250, 0]}).distillation
    assert [round(t, 1) for t in warped_step_list(d)] == [1000.0, 937.5, 833.3, 625.0, 0.0]
    assert d.student_timesteps == [1000, 750, 500, 250]  # the trailing 0 is the clean end, not a student step
    plain = load({"prompts": ["x"], "timestep_shift": 5.0}).distillation
    assert warped_step_list(plain) == [1000.0, 750.0, 500.0, 250.0]


def test_a_dumped_config_reads_back_unchanged():
    config = load({"objective": "ode_regression", "prompts": ["x"], "denoising_step_list": [1000, 500, 0]})
    dumped = dump_train_config(config)
    again = load_train_config(dumped).config
    assert dump_train_config(again) == dumped and again.distillation == config.distillation


def test_a_distillation_needs_no_image_dataset():
    text_only = [{"id": "text", "dataset_type": "text_embeds", "cache_dir": "cache/text"}]
    backends = load_data_backends(text_only, config=load({"prompts": ["x"]}))
    assert backends.image_datasets == [] and backends.text_embeds.id == "text"
    with pytest.raises(ConfigError, match="no enabled image dataset"):
        load_data_backends(text_only, config=load_train_config({"model_family": "flux"}).config)


def test_nested_path_fields_are_checked_against_the_roots(tmp_path):
    from simpletuner.config import paths
    from simpletuner.server.validation import check_paths

    roots = [tmp_path / "allowed"]
    roots[0].mkdir()
    problems = check_paths({"distillation": {"prompt_file": "/etc/passwd", "pairs_cache_dir": "pairs"}}, [],
                           roots, roots[0])
    assert [p.path for p in problems] == ["train_config.distillation.prompt_file"]
    config = load({"prompt_file": str(tmp_path / "outside.txt")})
    found = {name: spec.kind for name, _, spec in paths.config_paths(config)}
    assert found["distillation.prompt_file"] == "file" and found["distillation.pairs_cache_dir"] == "dir"
    assert found["distillation.student_init"] == "model"
