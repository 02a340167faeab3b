"""TrainConfig: defaults, SimpleTuner value spellings, field and cross-field errors, TREAD, webhooks, schema."""

from __future__ import annotations

import json

import pytest

from simpletuner.config import (
    ConfigError,
    FieldError,
    TrainConfig,
    family_names,
    get_family,
    load_train_config,
    resolve_tread_routes,
)
from simpletuner.config import paths
from simpletuner.config.errors import loc_to_path
from simpletuner.config.families import FAMILIES, PLANNED_FAMILIES, family_names
from simpletuner.config.train import TreadConfig, check_train_paths, flavour_path_errors, is_local


def load(**values) -> TrainConfig:
    return load_train_config({"model_family": "flux", **values}).config


def errors_of(**values) -> list[FieldError]:
    with pytest.raises(ConfigError) as info:
        load(**values)
    return info.value.errors


# --- defaults ------------------------------------------------------------------------------------------------


def test_defaults_fill_flavour_weights_and_alpha():
    config = load()
    assert config.model_flavour == "krea"  # SimpleTuner's Flux default
    assert config.pretrained_model_name_or_path == "black-forest-labs/FLUX.1-Krea-dev"
    assert config.model_type == "lora"
    assert config.lora_rank == 16 and config.lora_alpha == 16.0
    assert config.mixed_precision == "bf16"
    assert config.resolution == 1024 and config.resolution_type == "pixel_area"
    assert config.checkpointing_steps == 500
    assert config.attention_mechanism == "sdpa"
    assert config.tread_config is None


@pytest.mark.parametrize(
    "flavour, weights",
    [
        ("krea", "black-forest-labs/FLUX.1-Krea-dev"),
        ("schnell", "black-forest-labs/FLUX.1-schnell"),
        ("kontext", "black-forest-labs/FLUX.1-Kontext-dev"),
        ("fluxbooru", "terminusresearch/FluxBooru-v0.3"),
        ("libreflux", "jimmycarter/LibreFlux-SimpleTuner"),
        ("tiny", None),
    ],
)
def test_flavour_picks_default_weights(flavour, weights):
    assert load(model_flavour=flavour).pretrained_model_name_or_path == weights


def test_explicit_weights_are_kept():
    config = load(model_flavour="schnell", pretrained_model_name_or_path="/models/my-flux")
    assert config.pretrained_model_name_or_path == "/models/my-flux"


def test_explicit_alpha_is_kept():
    assert load(lora_rank=32, lora_alpha="8").lora_alpha == 8.0


# --- SimpleTuner's value spellings ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("1", True), ("0", False),
                                         ("yes", True), ("no", False), ("True", True), ("FALSE", False)])
def test_string_booleans(text, value):
    assert load(gradient_checkpointing=text).gradient_checkpointing is value


def test_numbers_as_strings():
    config = load(learning_rate="1e-4", max_train_steps="1e3", lora_rank="32", seed="42", lora_dropout="0.05",
                  resolution="512", checkpointing_steps="100.0")
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.max_train_steps == 1000 and isinstance(config.max_train_steps, int)
    assert config.lora_rank == 32 and config.seed == 42 and config.lora_dropout == 0.05
    assert config.resolution == 512 and isinstance(config.resolution, int)
    assert config.checkpointing_steps == 100


def test_null_spellings():
    config = load(seed="None", checkpointing_steps="null", validation_prompt=None, report_to=None,
                  evaluation_type="None", tracker_run_name="")
    assert config.seed is None and config.checkpointing_steps is None and config.validation_prompt is None
    assert config.report_to == "none" and config.evaluation_type == "none"
    assert config.tracker_run_name is None
    config = load(report_to="", pretrained_model_name_or_path="", validation_negative_prompt="")
    assert config.report_to == "none"
    assert config.pretrained_model_name_or_path == "black-forest-labs/FLUX.1-Krea-dev"
    assert config.validation_negative_prompt == ""


def test_choices_are_case_insensitive():
    config = load(mixed_precision="BF16", lr_scheduler="Cosine", base_model_precision="INT8-Quanto")
    assert (config.mixed_precision, config.lr_scheduler, config.base_model_precision) == ("bf16", "cosine", "int8-quanto")


def test_area_resolution_in_megapixels():
    config = load(resolution="1.0", resolution_type="area")
    assert config.resolution == 1.0
    assert config.validation_resolutions == [(1024, 1024)]


# --- errors name the field -----------------------------------------------------------------------------------

BAD_INPUTS = [
    pytest.param({"model_family": "sd9"}, "model_family", "not a known model family; available: ", id="family"),
    pytest.param({"model_family": "omnigen"}, "model_family", "planned but not supported yet", id="planned-family"),
    pytest.param({"model_flavour": "pro"}, "model_flavour", "one of dev, krea, schnell, kontext", id="flavour"),
    pytest.param({"model_type": "lycoris"}, "model_type", "'lycoris' is not one of lora, full", id="model-type"),
    pytest.param(
        {"lr_scheduler": "cosin"},
        "lr_scheduler",
        "'cosin' is not one of constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial",
        id="scheduler",
    ),
    pytest.param({"learning_rate": "0"}, "learning_rate", "must be > 0", id="lr-zero"),
    pytest.param({"learning_rate": "fast"}, "learning_rate", "expected a number, got 'fast'", id="lr-text"),
    pytest.param({"lora_rank": "sixteen"}, "lora_rank", "expected an integer", id="rank-text"),
    pytest.param({"lora_dropout": 1}, "lora_dropout", "must be < 1", id="dropout"),
    pytest.param({"caption_dropout_probability": 1.5}, "caption_dropout_probability", "must be <= 1", id="cdp"),
    pytest.param({"gradient_checkpointing": "maybe"}, "gradient_checkpointing", "expected true or false",
                 id="bool"),
    pytest.param({"mixed_precision": "fp8"}, "mixed_precision", "not one of no, bf16, fp16", id="precision"),
    pytest.param({"base_model_precision": "int3-quanto"}, "base_model_precision", "int8-quanto", id="quant"),
    pytest.param({"max_train_steps": 0, "num_train_epochs": 0}, "max_train_steps",
                 "set max_train_steps or num_train_epochs", id="no-length"),
    pytest.param({"max_train_steps": 100, "lr_warmup_steps": 200}, "lr_warmup_steps",
                 "exceed max_train_steps (100)", id="warmup"),
    pytest.param({"model_type": "full", "base_model_precision": "int8-quanto"}, "base_model_precision",
                 "cannot be used with model_type 'full'", id="full-quantized"),
    pytest.param({"lora_init_type": "loftq", "base_model_precision": "int4-quanto"}, "lora_init_type",
                 "'loftq' cannot be combined with quanto", id="loftq-quanto"),
    pytest.param({"lora_init_type": "loftq", "text_encoder_2_precision": "int8-quanto"}, "lora_init_type",
                 "text_encoder_2_precision", id="loftq-te-quanto"),
    pytest.param({"enable_group_offload": True, "enable_model_cpu_offload": "true"}, "enable_model_cpu_offload",
                 "cannot be combined with enable_group_offload", id="offloads"),
    pytest.param({"enable_group_offload": True, "group_offload_to_disk_path": "/tmp/x"},
                 "group_offload_to_disk_path", "loses LoRA updates", id="disk-offload"),
    pytest.param({"enable_group_offload": True, "base_model_precision": "int8-quanto"}, "enable_group_offload",
                 "needs gradient_checkpointing on every block", id="offload-quanto"),
    pytest.param({"gradient_checkpointing_interval": 2}, "gradient_checkpointing_interval",
                 "needs gradient_checkpointing", id="gc-interval"),
    pytest.param({"gradient_checkpointing": True, "gradient_checkpointing_interval": 0},
                 "gradient_checkpointing_interval", "must be >= 1", id="gc-interval-zero"),
    pytest.param({"train_text_encoder": "true"}, "train_text_encoder", "not supported", id="text-encoder"),
    pytest.param({"optimizer": "adamw_bf16", "base_model_default_dtype": "fp32"}, "optimizer",
                 "needs base_model_default_dtype 'bf16'", id="adamw-bf16"),
    pytest.param({"flux_lora_target": "everything"}, "lora_target",
                 "'everything' is not a flux LoRA preset; one of all, mmdit, context, context+ffs", id="lora-target"),
    pytest.param({"lora_target": "attention"}, "lora_target", "not a flux LoRA preset", id="lora-target-new"),
    pytest.param({"prediction_type": "epsilon"}, "prediction_type",
                 "'epsilon' is not how flux is trained; one of flow_matching", id="prediction-type-family"),
    pytest.param({"prediction_type": "x0"}, "prediction_type", "flow_matching", id="prediction-type"),
    pytest.param({"text_encoder_3_precision": "int8-quanto"}, "text_encoder_3_precision",
                 "flux has 2 text encoder(s); there is no text encoder 3", id="text-encoder-3"),
    pytest.param({"text_encoder_4_precision": "int8-quanto"}, "text_encoder_4_precision",
                 "flux has 2 text encoder(s); there is no text encoder 4", id="text-encoder-4"),
    pytest.param({"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr", "not flow_matching", id="zsnr-flow"),
    pytest.param({"lora_init_type": "kaiming"}, "lora_init_type", "default, gaussian, loftq, olora, pissa",
                 id="lora-init"),
    pytest.param({"report_to": "comet"}, "report_to", "none, wandb, tensorboard, all", id="report-to"),
    pytest.param({"validation_resolution": "1024x"}, "validation_resolution", "'1024x' is not a size",
                 id="validation-resolution"),
    pytest.param({"resolution": 1024, "resolution_type": "area"}, "resolution", "megapixels", id="area-pixels"),
    pytest.param({"resolution": 512.5}, "resolution", "not a whole number of pixels", id="fraction-pixels"),
    pytest.param({"checkpoints_total_limit": 0}, "checkpoints_total_limit", "must be >= 1", id="ckpt-limit"),
    pytest.param({"validation_steps": -5}, "validation_steps", "must be >= 1", id="validation-steps"),
    pytest.param({"model_type": "full", "init_lora": "a.safetensors"}, "init_lora", "needs model_type 'lora'",
                 id="init-lora-full"),
    pytest.param({"lora_type": "lycoris"}, "lycoris_config", "is required with lora_type 'lycoris'", id="lycoris-without-config"),
    pytest.param({"lora_type": "dora"}, "lora_type", "'dora' is not one of standard, lycoris", id="lora-type"),
    pytest.param({"optimizer": "bnb-adamw9bit"}, "optimizer", "'bnb-adamw9bit' is not one of adamw, adamw_bf16", id="optimizer"),
    pytest.param({"optimizer_config": "d_coef"}, "optimizer_config", "is not key=value", id="optimizer-config"),
    pytest.param({"optimizer_config": "lr=3"}, "optimizer_config.lr", "set learning_rate instead", id="optimizer-config-lr"),
    pytest.param({"tokenizer_max_length": 513}, "tokenizer_max_length", "longer than flux", id="tokenizer-length"),
    pytest.param({"flow_fast_schedule": True, "flow_use_uniform_schedule": True}, "flow_fast_schedule", "cannot be combined", id="fast-schedule"),
    pytest.param({"lycoris_config": {"algo": "lokr"}}, "lycoris_config", "only read with lora_type", id="lycoris-config-alone"),
    pytest.param({"lora_type": "lycoris", "lycoris_config": {"algo": "oft"}}, "lycoris_config.algo", "one of lokr, loha, locon, lora, full", id="lycoris-algo"),
    pytest.param({"tread_config": {"routes": []}}, "tread_config.routes",
                 "TREAD training requires you to configure the routes", id="tread-empty"),
    pytest.param({"tread_config": {}}, "tread_config.routes",
                 "TREAD training requires you to configure the routes", id="tread-no-routes"),
    pytest.param({"tread_config": {"routes": [{"selection_ratio": 1.0, "start_layer_idx": 2, "end_layer_idx": 5}]}},
                 "tread_config.routes[0].selection_ratio", "must be < 1", id="tread-ratio"),
    pytest.param({"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2}]}},
                 "tread_config.routes[0].end_layer_idx", "is required", id="tread-missing"),
    pytest.param({"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 5,
                                               "ratio": 1}]}},
                 "tread_config.routes[0].ratio", "unknown key", id="tread-extra"),
    pytest.param({"webhook_config": {"webhook_type": "raw", "callback_url": "localhost:8001/hook"}},
                 "webhook_config[0].callback_url", "is not an http(s) URL", id="webhook-url"),
    pytest.param({"webhook_config": [{"webhook_type": "slack", "callback_url": "https://x"}]},
                 "webhook_config[0].webhook_type", "'slack' is not one of raw, discord", id="webhook-type"),
    pytest.param({"webhook_config": [{"webhook_type": "raw", "callback_url": "https://x", "log_level": "debug"}]},
                 "webhook_config[0].log_level", "info, warning, error, critical", id="webhook-level"),
    pytest.param({"config_version": 99}, "config_version", "newer than this SimpleTuner understands",
                 id="version"),
]


@pytest.mark.parametrize("values, path, message", BAD_INPUTS)
def test_bad_input_names_the_field(values, path, message):
    errors = errors_of(**values)
    matching = [e for e in errors if e.path == path]
    assert matching, f"no error for {path}: {errors}"
    assert any(message in e.message for e in matching), matching


def test_every_field_error_is_reported_at_once():
    errors = errors_of(lr_scheduler="cosin", lora_rank="x", mixed_precision="fp8")
    assert {e.path for e in errors} == {"lr_scheduler", "lora_rank", "mixed_precision"}


def test_cross_field_errors_are_reported_together():
    errors = errors_of(model_type="full", base_model_precision="int8-quanto", enable_group_offload=True,
                       enable_model_cpu_offload=True, max_train_steps=10, lr_warmup_steps=20)
    assert {e.path for e in errors} == {"base_model_precision", "enable_model_cpu_offload", "enable_group_offload",
                                      "lr_warmup_steps"}


def test_direct_model_validate_rejects_unknown_keys():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        TrainConfig.model_validate({"model_family": "flux", "learning_rat": 1})


# --- TREAD ---------------------------------------------------------------------------------------------------


def route(ratio, start, end):
    return {"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}


def test_tread_config_accepts_simpletuner_routes():
    config = load(tread_config={"routes": [route("0.5", "2", -2)]})
    assert config.tread_config.routes[0].selection_ratio == 0.5
    assert config.tread_config.routes[0].end_layer_idx == -2


def test_tread_config_as_a_json_string():
    text = json.dumps({"routes": [route(0.5, 2, -2)]})
    config = load_train_config({"model_family": "flux", "TRAINER_EXTRA_ARGS": f"--tread_config='{text}'"}).config
    assert config.tread_config.routes[0].start_layer_idx == 2
    errors = errors_of(tread_config="{routes: []}")
    assert errors[0].path == "tread_config" and "not valid JSON" in errors[0].message


def test_tread_reversed_window():
    errors = errors_of(tread_config={"routes": [route(0.5, 6, 2)]})
    assert [str(e) for e in errors] == [
        "tread_config.routes[0].end_layer_idx: 2 is before start_layer_idx 6; the window is reversed"
    ]


def test_tread_overlapping_windows():
    errors = errors_of(tread_config={"routes": [route(0.5, 0, 4), route(0.25, 3, 8)]})
    assert errors[0].path == "tread_config.routes[1]"
    assert "overlap route 0" in errors[0].message


@pytest.mark.parametrize("routes, errors", [
    # windows that share one layer overlap; neighbours do not
    ([(0, 3), (3, 5)], ["tread_config.routes[1]: layers 3..5 overlap route 0 (0..3)"]),
    ([(0, 3), (4, 5)], []),
    ([(4, 5), (0, 3)], []),
    ([(2, 2), (2, 2)], ["tread_config.routes[1]: layers 2..2 overlap route 0 (2..2)"]),
    # every pair is compared: the third overlaps both earlier ones
    ([(0, 1), (5, 6), (1, 5)], ["tread_config.routes[2]: layers 1..5 overlap route 0 (0..1)",
                                "tread_config.routes[2]: layers 1..5 overlap route 1 (5..6)"]),
    # negative windows compare with each other as they are
    ([(-4, -2), (-3, -1)], ["tread_config.routes[1]: layers -3..-1 overlap route 0 (-4..-2)"]),
    ([(-1, -3)], ["tread_config.routes[0].end_layer_idx: -3 is before start_layer_idx -1; the window is reversed"]),
    # a reversed window is reported once, as reversed, not also as an overlap
    ([(0, 4), (6, 2)], ["tread_config.routes[1].end_layer_idx: 2 is before start_layer_idx 6; the window is reversed"]),
    # a mixed-sign window waits for the model's depth: neither reversed nor overlapping yet
    ([(5, -8), (0, 9)], []),
    ([(0, 3), (-2, 1)], []),
    ([(0, -1)], []),  # the whole model: 0 counts as non-negative
    # one index of the pair of a different sign from the other three: wait for the depth
    ([(-5, 3), (1, 4)], []),
    ([(-5, 3), (-4, -2)], []),
    ([(1, 4), (-5, 3)], []),
    ([(-4, -2), (-5, 3)], []),
])
def test_tread_windows_compared_before_the_depth_is_known(routes, errors):
    given = {"routes": [route(0.5, a, b) for a, b in routes]}
    if errors:
        assert [str(e) for e in errors_of(tread_config=given)] == errors
    else:
        assert len(load(tread_config=given).tread_config.routes) == len(routes)


def test_tread_windows_with_mixed_signs_wait_for_the_depth():
    # 2..-2 and 5..8 overlap or not depending on the depth: only resolve_tread_routes can say.
    config = load(tread_config={"routes": [route(0.5, 2, -2), route(0.5, -8, -5)]})
    with pytest.raises(ConfigError):
        resolve_tread_routes(config.tread_config, 19)


def test_resolve_tread_routes_negative_indices():
    assert resolve_tread_routes([route(0.5, 2, -2)], 19) == [(0.5, 2, 17)]
    assert resolve_tread_routes([route(0.5, 0, 3), route(0.25, -3, -1)], 10) == [(0.5, 0, 3), (0.25, 7, 9)]


def test_resolve_tread_routes_past_the_last_layer():
    with pytest.raises(ConfigError) as info:
        resolve_tread_routes([route(0.5, 0, 3), route(0.5, 5, 40)], 19)
    assert str(info.value) == "tread_config.routes[1].end_layer_idx: 40 is past the last layer (18)"


def test_resolve_tread_routes_before_the_first_layer():
    with pytest.raises(ConfigError) as info:
        resolve_tread_routes([route(0.5, -30, 3)], 19)
    assert info.value.errors[0].path == "tread_config.routes[0].start_layer_idx"
    assert "before the first layer" in info.value.errors[0].message


def test_resolve_tread_routes_without_routes_names_the_field():
    for empty in ([], TreadConfig.model_construct(routes=[])):
        with pytest.raises(ConfigError) as info:
            resolve_tread_routes(empty, 19)
        assert info.value.errors == [FieldError("tread_config.routes",
                                                "TREAD training requires you to configure the routes")]
    with pytest.raises(ConfigError) as info:
        resolve_tread_routes([], 19, path="student.tread_config.routes")
    assert [e.path for e in info.value.errors] == ["student.tread_config.routes"]


def test_resolve_tread_routes_overlap_after_resolving():
    with pytest.raises(ConfigError) as info:
        resolve_tread_routes([route(0.5, 2, -2), route(0.5, -4, -1)], 19)
    assert info.value.errors[0].path == "tread_config.routes[1]"


# --- webhooks, validation sizes --------------------------------------------------------------------------------


def test_webhook_object_becomes_a_list():
    config = load(webhook_config={"webhook_type": "raw", "callback_url": "http://127.0.0.1:8001/api/jobs/1/events",
                                  "log_level": "INFO", "message_prefix": "job 1"})
    assert len(config.webhook_config) == 1
    assert config.webhook_config[0].log_level == "info"


def test_webhook_json_string_and_file(tmp_path):
    hooks = [{"webhook_type": "discord", "callback_url": "https://discord.example/api/webhooks/1"}]
    assert load(webhook_config=json.dumps(hooks)).webhook_config[0].webhook_type == "discord"
    path = tmp_path / "webhooks.json"
    path.write_text(json.dumps(hooks[0]))
    assert load(webhook_config=str(path)).webhook_config[0].callback_url.startswith("https://")
    errors = errors_of(webhook_config=str(tmp_path / "missing.json"))
    assert errors[0].path == "webhook_config" and "not found" in errors[0].message


def test_webhook_file_in_a_server_job_must_resolve_inside_its_roots(tmp_path, monkeypatch):
    """A server's job reads webhook_config's file only inside the allowed roots, checked as it is read (a link swapped
    in after the server's own check is caught here), as lycoris_config and deepspeed_config are."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    hook = json.dumps({"webhook_type": "raw", "callback_url": "https://example.test/hook"})
    (root / "hooks.json").write_text(hook)
    (outside / "hooks.json").write_text(hook)
    (root / "link.json").symlink_to(outside / "hooks.json")
    monkeypatch.setenv(paths.ROOTS_ENV, json.dumps([str(root)]))
    monkeypatch.chdir(root)
    assert load(webhook_config="hooks.json").webhook_config[0].callback_url == "https://example.test/hook"
    for name in ("link.json", str(outside / "hooks.json"), "../outside/hooks.json"):
        errors = errors_of(webhook_config=name)
        assert [e.path for e in errors] == ["webhook_config"] and "resolves to" in errors[0].message, name
    assert load(webhook_config=hook).webhook_config[0].webhook_type == "raw"  # inline JSON is no file
    monkeypatch.delenv(paths.ROOTS_ENV)
    assert len(load(webhook_config=str(outside / "hooks.json")).webhook_config) == 1  # the user's own run


def test_webhook_file_that_is_not_json_names_the_file_and_the_place(tmp_path):
    path = tmp_path / "hooks.json"
    path.write_text('{"webhook_type": "raw",\n "callback_url": }')
    errors = errors_of(webhook_config=str(path))
    assert errors[0].path == "webhook_config"
    assert errors[0].message.endswith(f"{path}: not valid JSON (line 2, column 18)")
    errors = errors_of(webhook_config='[{"webhook_type": "raw"')
    assert errors[0].path == "webhook_config" and "is not valid JSON" in errors[0].message


# --- optimizer_config: SimpleTuner's key=value text ------------------------------------------------------------


@pytest.mark.parametrize("text, parsed", [
    ("d_coef=0.1", {"d_coef": 0.1}),
    (" d_coef = 2 , weight_decay=0.01 ", {"d_coef": 2, "weight_decay": 0.01}),
    ("betas=(0.9,0.99),eps=1e-8", {"betas": [0.9, 0.99], "eps": 1e-8}),
    ("betas=[0.9, 0.99, ]", {"betas": [0.9, 0.99]}),
    ("nested=((1,2),3)", {"nested": [[1, 2], 3]}),
    ("a=1,,b=2,", {"a": 1, "b": 2}),
    ("decouple=TRUE,amsgrad=false ,foreach=None,fused=null", {"decouple": True, "amsgrad": False,
                                                               "foreach": None, "fused": None}),
    ("schedule=warmup_stable_decay,name=(x", {"schedule": "warmup_stable_decay", "name": "(x"}),
    ("ratio=x)", {"ratio": "x)"}),
    ("k=-3", {"k": -3}),
    ("path=a=b", {"path": "a=b"}),  # the first '=' splits
    ("name=AdamX,eps=1e-8", {"name": "AdamX", "eps": 1e-8}),  # letters never open or close a bracket
    ('{"betas": [0.9, 0.99], "eps": 1e-8}', {"betas": [0.9, 0.99], "eps": 1e-8}),
])
def test_optimizer_config_text(text, parsed):
    value = load(optimizer_config=text).optimizer_config
    assert value == parsed
    # 2 stays an int and 2.0 a float: an optimizer may check the type of a count
    assert [type(v) for v in value.values()] == [type(v) for v in parsed.values()]


def test_optimizer_config_as_a_mapping_or_empty():
    given = {"d_coef": 0.5}
    config = load(optimizer_config=given)
    assert config.optimizer_config == {"d_coef": 0.5} and config.optimizer_config is not given  # a copy
    for empty in ("", "   ", None):
        assert load(optimizer_config=empty).optimizer_config is None


@pytest.mark.parametrize("value, message", [
    ("d_coef", "'d_coef' is not key=value (e.g. 'd_coef=0.1,weight_decay=0.01')"),
    ("=0.1", "'=0.1' is not key=value"),
    (" =0.1", "'=0.1' is not key=value"),
    ("d_coef=", "d_coef has no value"),
    ("a=1, d_coef = ,b=2", "d_coef has no value"),
    ('{"d_coef": 0.1', "is not valid JSON: Expecting ',' delimiter at column 15"),
    (3, "expected 'key=value,key=value' or an object, got 3"),
])
def test_optimizer_config_errors_name_the_bad_item(value, message):
    errors = errors_of(optimizer_config=value)
    assert [e.path for e in errors] == ["optimizer_config"]
    assert message in errors[0].message


def test_validation_resolutions():
    assert load(validation_resolution="1024x768, 512").validation_resolutions == [(1024, 768), (512, 512)]
    assert load(validation_resolution=768).validation_resolutions == [(768, 768)]
    assert load(resolution=512).validation_resolutions == [(512, 512)]


# --- schema for the UI ----------------------------------------------------------------------------------------


def test_every_field_has_a_description_and_a_group_the_form_shows():
    """The web UI builds one form section per group the schema route returns; a field whose group it does not
    return would never be shown."""
    from simpletuner.server.routes.schema import train_config_schema

    served = train_config_schema()
    shown = [g["id"] for g in served["groups"]]
    assert shown[:3] == ["model", "training", "lora"] and len(set(shown)) == len(shown)
    properties = served["schema"]["properties"]
    assert set(properties) == set(TrainConfig.model_fields)
    for name, prop in properties.items():
        assert prop.get("description"), name
        assert prop.get("group") in shown, name
    assert properties["model_family"]["enum"] == family_names() and "flux" in family_names()  # the table
    assert properties["config_version"]["readOnly"] is True
    # a field put in a group the form does not know is refused when the schema is defined
    from simpletuner.config.train import _field

    with pytest.raises(AssertionError):
        _field(None, "not-a-group", "x")


# --- families and errors --------------------------------------------------------------------------------------


def test_a_field_carries_its_group_and_extra_schema_keys():
    """``_field`` runs while TrainConfig's class body is executed, once at import; called here directly so that what
    it builds is checked (the schema route and the web UI's form read these keys)."""
    from simpletuner.config.train import GROUPS, _field

    field = _field(3, "lora", "rank of the adapter", ge=1, extra={"enum": [1, 2, 3]})
    assert field.default == 3 and field.description == "rank of the adapter"
    assert field.json_schema_extra == {"group": "lora", "enum": [1, 2, 3]}
    assert [m.ge for m in field.metadata if hasattr(m, "ge")] == [1]
    assert _field(None, "model", "x").json_schema_extra == {"group": "model"}
    with pytest.raises(AssertionError, match="no-such-group"):
        _field(None, "no-such-group", "x")
    assert TrainConfig.model_fields["model_type"].json_schema_extra == {"group": "model"}
    assert set(GROUPS) >= {f.json_schema_extra["group"] for f in TrainConfig.model_fields.values()}


def test_family_table():
    flux = get_family("flux")
    assert flux.default_flavour == "krea"
    assert flux.flavours["tiny"] is None
    assert flux.lora_targets == ("all", "mmdit", "context", "context+ffs", "all+ffs", "tiny", "nano")
    planned = next(n for n in PLANNED_FAMILIES if n not in family_names())
    with pytest.raises(ConfigError, match=f"model_family: '{planned}' is a SimpleTuner family that is planned"):
        get_family(planned)


def test_config_error_text():
    error = ConfigError([FieldError("a.b", "bad"), ("c", "worse")], source="config.json")
    assert str(error) == "config.json: a.b: bad\nconfig.json: c: worse"
    assert str(ConfigError([FieldError("x", "y")])) == "x: y"
    assert isinstance(error, ValueError)
    assert loc_to_path(("tread_config", "routes", 1, "end_layer_idx")) == "tread_config.routes[1].end_layer_idx"
    assert loc_to_path((2, "resolution")) == "[2].resolution"


def test_check_train_paths(tmp_path):
    config = load(user_prompt_library="prompts.json", init_lora="missing.safetensors",
                  pretrained_model_name_or_path="./models/flux")
    warnings = check_train_paths(config, cwd=tmp_path)
    assert any(w.startswith("user_prompt_library:") for w in warnings)
    assert any(w.startswith("init_lora:") for w in warnings)
    assert any(w.startswith("pretrained_model_name_or_path:") for w in warnings)
    (tmp_path / "prompts.json").write_text("{}")
    assert not any(w.startswith("user_prompt_library") for w in check_train_paths(config, cwd=tmp_path))
    assert check_train_paths(load(), cwd=tmp_path) == []  # a Hub id is not a local path


@pytest.mark.parametrize("value, local", [
    ("black-forest-labs/FLUX.1-dev", False),  # a Hub repo id: owner/name
    ("flux", False),
    ("owner/name/sub", True),  # more than one '/'
    ("/abs/models/flux", True),
    ("/flux", True),
    ("./flux", True),
    ("../flux", True),
    ("~/flux", True),
    (".\\flux", True),
    ("models\\flux", True),
])
def test_is_local_tells_a_path_from_a_hub_id(value, local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local(value) is local


def test_is_local_is_true_for_any_existing_file_or_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not is_local("owner/name")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert is_local("owner/name") and is_local("owner")  # exists here, so a local folder, not a repo id
    monkeypatch.setenv("HOME", str(tmp_path))
    assert is_local("~")


def test_check_train_paths_names_each_missing_path_relative_to_the_given_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"
    (project / "models" / "vae").mkdir(parents=True)
    (project / "lora.safetensors").write_bytes(b"")
    config = load(user_prompt_library=str(tmp_path / "absent.json"), init_lora="lora.safetensors",
                  pretrained_model_name_or_path="./models/flux", pretrained_vae_model_name_or_path="./models/vae",
                  pretrained_transformer_model_name_or_path="owner/transformer")
    assert check_train_paths(config, cwd=project) == [
        f"user_prompt_library: file {str(tmp_path / 'absent.json')!r} does not exist",
        "pretrained_model_name_or_path: folder './models/flux' does not exist (and is not a Hugging Face repo id)",
    ]
    monkeypatch.chdir(project)  # the default folder is the working directory
    assert [w.split(":")[0] for w in check_train_paths(config)] == ["user_prompt_library",
                                                                    "pretrained_model_name_or_path"]
    monkeypatch.setenv("HOME", str(project))
    assert check_train_paths(load(init_lora="~/lora.safetensors"), cwd=tmp_path) == []  # ~ is the user's home
    assert check_train_paths(load(init_lora="~/gone.safetensors"), cwd=tmp_path) == [
        "init_lora: file '~/gone.safetensors' does not exist"]


def test_a_tiny_flavour_with_other_weights_is_a_contradiction(tmp_path):
    (tmp_path / "vae").mkdir()
    assert flavour_path_errors(load(model_flavour="tiny", pretrained_model_name_or_path=None,
                                    pretrained_vae_model_name_or_path=str(tmp_path / "vae"))) == []
    errors = flavour_path_errors(load(model_flavour="tiny", pretrained_model_name_or_path="owner/flux",
                                      pretrained_transformer_model_name_or_path="owner/transformer",
                                      pretrained_vae_model_name_or_path=str(tmp_path / "vae")))
    assert [e.path for e in errors] == ["pretrained_model_name_or_path", "pretrained_transformer_model_name_or_path"]
    assert errors[0].message == (
        "model_flavour 'tiny' is a small model generated on this machine, and pretrained_model_name_or_path names the "
        "Hub model 'owner/flux', whose weights do not belong to it; set pretrained_model_name_or_path to null for "
        "'tiny', or set model_flavour to the flavour of those weights")
    # the base model path names the weights whatever it is: a local folder too
    local = flavour_path_errors(load(model_flavour="tiny", pretrained_model_name_or_path=str(tmp_path / "vae"),
                                     pretrained_vae_model_name_or_path=None))
    assert [e.path for e in local] == ["pretrained_model_name_or_path"]
    assert f"names the local folder {str(tmp_path / 'vae')!r}" in local[0].message
    # with no base model path, the transformer's is still checked
    alone = flavour_path_errors(load(model_flavour="tiny", pretrained_model_name_or_path=None,
                                     pretrained_transformer_model_name_or_path="owner/transformer"))
    assert [e.path for e in alone] == ["pretrained_transformer_model_name_or_path"]
    # a flavour with real weights: the paths are the user's to choose
    assert flavour_path_errors(load(model_flavour="krea", pretrained_model_name_or_path="owner/flux")) == []


def test_tiny_flavours_are_the_locally_written_ones():
    from simpletuner.config.families import tiny_flavours

    assert tiny_flavours(get_family("flux")) == ["tiny"]
    assert tiny_flavours(get_family("wan")) == ["tiny", "tiny-i2v", "tiny-2.2-high", "tiny-2.2-low"]
    for name in family_names():  # every family has one, and each has no hub weights
        family = get_family(name)
        assert "tiny" in tiny_flavours(family)
        assert all(family.flavours[f] is None for f in tiny_flavours(family))
