"""Nothing accepted and ignored: every field of TrainConfig and of the data-backend schema is either read by the
code it configures (outside the config layer, which only parses) or refused with a message naming it.

Adding a field fails ``test_every_field_is_accounted_for`` until it is listed here with its reader; listing a
reader that does not read it fails ``test_each_reader_reads_its_field``; ``test_a_run_reads_what_it_configures``
then records which fields a real training run actually reads.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from simpletuner.config import ConfigError, DatasetBackend, TextEmbedsBackend, TrainConfig, load_data_backends
from tests.conftest import REPO
from tests.helpers import flux_config

T, V, E, D, M = ("simpletuner/training/trainer.py", "simpletuner/evaluation/validation.py",
                 "simpletuner/training/evaluator.py", "simpletuner/data/discovery.py", "simpletuner/models/base.py")
FLUX, OPT, LORA, OBJ = ("simpletuner/models/flux.py", "simpletuner/training/optimizers.py",
                        "simpletuner/training/lora.py", "simpletuner/models/objectives.py")
TRACK, PROMPTS = "simpletuner/evaluation/trackers.py", "simpletuner/evaluation/prompts.py"
SHARD = "simpletuner/training/sharding.py"

# field -> (module that reads it, the name it reads; default: the field itself)
TRAIN_READERS: dict[str, tuple[str, str] | str] = {
    "model_type": T, "model_family": "simpletuner/models/registry.py", "model_flavour": FLUX,
    "pretrained_model_name_or_path": M, "pretrained_transformer_model_name_or_path": M,
    "pretrained_transformer_subfolder": M, "pretrained_vae_model_name_or_path": M, "revision": M, "variant": M,
    "output_dir": T, "train_batch_size": T, "gradient_accumulation_steps": T, "max_train_steps": T,
    "num_train_epochs": T, "learning_rate": OPT, "lr_scheduler": T, "lr_warmup_steps": T, "optimizer": OPT,
    "optimizer_config": OPT, "adam_beta1": OPT, "adam_beta2": OPT, "adam_weight_decay": OPT, "adam_epsilon": OPT,
    "mixed_precision": T, "seed": T, "gradient_checkpointing": T, "gradient_checkpointing_interval": T,
    "max_grad_norm": T, "flow_schedule_shift": OBJ, "flow_schedule_auto_shift": OBJ,
    "flow_use_uniform_schedule": OBJ, "flow_sigmoid_scale": OBJ, "prediction_type": OBJ,
    "rescale_betas_zero_snr": OBJ, "flow_fast_schedule": OBJ, "guidance_value": FLUX,
    "checkpointing_steps": T, "checkpoints_total_limit": T, "resume_from_checkpoint": T,
    "data_backend_config": "simpletuner/training/cli.py", "resolution": D, "resolution_type": D,
    "tokenizer_max_length": FLUX, "attention_masked_training": FLUX, "caption_dropout_probability": T,
    "vae_batch_size": T, "lora_rank": LORA, "lora_alpha": LORA, "lora_dropout": LORA, "lora_init_type": LORA,
    "lora_type": T, "lycoris_config": LORA, "lora_target": LORA, "init_lora": LORA,
    "base_model_precision": T, "text_encoder_1_precision": (M, "text_encoder_{n}_precision"),
    "text_encoder_2_precision": (M, "text_encoder_{n}_precision"),
    "text_encoder_3_precision": (M, "text_encoder_{n}_precision"),
    "text_encoder_4_precision": (M, "text_encoder_{n}_precision"),
    "framerate": M, "validation_num_video_frames": M, "max_nan_loss_steps": T, "snr_gamma": OBJ,
    "validation_reference_image": PROMPTS,
    "base_model_default_dtype": T, "quantize_via": T, "enable_group_offload": T, "group_offload_type": T,
    "group_offload_blocks_per_group": T, "group_offload_use_stream": T, "group_offload_to_disk_path": T,
    "enable_model_cpu_offload": M, "offload_during_startup": T, "vae_enable_tiling": M,
    "attention_mechanism": T, "compile": T, "use_ema": T, "ema_decay": T, "ema_update_interval": T,
    "ema_device": T, "regularisation_base_device": T, "ema_validation": E, "tread_config": T, "validation_steps": E, "validation_on_startup": E,
    "validation_prompt": PROMPTS, "validation_negative_prompt": V, "validation_resolution": (E, "validation_resolutions"),
    "validation_guidance": V, "validation_guidance_real": V, "validation_num_inference_steps": V,
    "validation_seed": V, "user_prompt_library": PROMPTS, "validation_preview": E, "validation_preview_steps": V,
    "evaluation_type": E, "pretrained_evaluation_model_name_or_path": "simpletuner/evaluation/clip_score.py",
    "eval_steps_interval": E, "report_to": TRACK, "tracker_project_name": TRACK, "tracker_run_name": TRACK,
    "logging_dir": TRACK, "webhook_config": T, "train_from_cache": T,
    "distillation": "simpletuner/training/distill.py",
    "cache_manifest": "simpletuner/training/split.py",
    "fsdp_enable": SHARD, "fsdp_version": SHARD, "fsdp_reshard_after_forward": SHARD, "fsdp_state_dict_type": SHARD,
    "fsdp_transformer_layer_cls_to_wrap": SHARD, "deepspeed_config": SHARD,
}
# fields the config layer itself consumes, and why that is where they act
TRAIN_CONFIG_ONLY = {
    "config_version": "drives the migrations of an older config on load (simpletuner/config/versions.py)",
}
# field -> (a value, an error message naming the field) for values every run refuses
TRAIN_REFUSED = {
    "train_text_encoder": ({"train_text_encoder": True}, "train_text_encoder: training the text encoders is not "
                                                         "supported"),
}
# per family: values its table row refuses (text_encoder_3_precision is read for families with 3 encoders)
FAMILY_REFUSED = {
    "text_encoder_3_precision": ({"text_encoder_3_precision": "int8-quanto"}, "flux has 2 text encoder(s)"),
    "tokenizer_max_length": ({"tokenizer_max_length": 1024}, "longer than flux's text encoder takes (512"),
}
# per device: settings refused before anything is cached (simpletuner.config.requirements.device_errors)
DEVICE_REFUSED = {
    "enable_model_cpu_offload": ({"enable_model_cpu_offload": True}, "cpu", "no accelerator memory to offload"),
    "optimizer": ({"optimizer": "bnb-adamw8bit"}, "cpu", "uses bitsandbytes' CUDA kernels"),
    "base_model_precision": ({"base_model_precision": "nf4-bnb"}, "cpu", "quantizes with bitsandbytes on a CUDA"),
    "lora_init_type": ({"lora_init_type": "loftq"}, "cpu", "quantizes the base with bitsandbytes on a CUDA GPU"),
    "deepspeed_config": ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, "cpu", "DeepSpeed ZeRO runs on "
                                                                                          "CUDA GPUs"),
    "mixed_precision": ({"fsdp_enable": True, "mixed_precision": "bf16"}, "cpu", "a sharded CPU run trains in fp32"),
}

DATASET_READERS: dict[str, tuple[str, str] | str] = {
    "id": D, "dataset_type": T, "instance_data_dir": D, "resolution": D, "resolution_type": D,
    "minimum_image_size": D, "maximum_image_size": D, "target_downsample_size": D, "crop": D, "crop_style": D,
    "crop_aspect": D, "caption_strategy": D, "instance_prompt": D, "repeats": D,
    "is_regularisation_data": D, "cache_dir_vae": T, "probability": D, "video": D,

}
DATASET_CONFIG_ONLY = {
    "type": "only 'local' is accepted; other storage types are refused by the schema ('not supported yet')",
    "disabled": "a disabled entry is left out of the parsed backends entirely (config/data.py)",
    "conditioning_data": "pairs datasets in DataBackends.paired (config/data.py), which the data layer's with_pairs "
                         "and the adapter's reference check call",
    "conditioning_type": "folds SimpleTuner's mask spelling into dataset_type 'mask' as the entry is parsed",
}
TEXT_EMBEDS_READERS: dict[str, tuple[str, str] | str] = {"id": T, "cache_dir": T, "write_batch_size": T}
TEXT_EMBEDS_CONFIG_ONLY = {
    "dataset_type": "always 'text_embeds': it is what makes an entry the text-embeds backend",
    "type": "only 'local' is accepted",
    "default": "picks the text-embeds backend in use when there are several (config/data.py)",
    "disabled": "a disabled entry is left out of the parsed backends entirely",
}


@cache
def names_read(module: str) -> frozenset[str]:
    """Attribute names and string constants in ``module`` (getattr(config, "x") reads "x"), plus its source text
    for names built at run time (``f"text_encoder_{n}_precision"``)."""
    source = (REPO / module).read_text()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return frozenset(found)


SCHEMAS = [
    ("TrainConfig", TrainConfig, TRAIN_READERS, {**TRAIN_CONFIG_ONLY, **TRAIN_REFUSED}),
    ("DatasetBackend", DatasetBackend, DATASET_READERS, DATASET_CONFIG_ONLY),
    ("TextEmbedsBackend", TextEmbedsBackend, TEXT_EMBEDS_READERS, TEXT_EMBEDS_CONFIG_ONLY),
]


@pytest.mark.parametrize("name, model, readers, elsewhere", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_every_field_is_accounted_for(name, model, readers, elsewhere):
    fields = set(model.model_fields)
    listed = set(readers) | set(elsewhere)
    assert not fields - listed, f"{name} fields nobody reads or refuses (add the reader here): {sorted(fields - listed)}"
    assert not listed - fields, f"listed but not {name} fields: {sorted(listed - fields)}"
    assert not set(readers) & set(elsewhere)


@pytest.mark.parametrize("name, model, readers, elsewhere", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_each_reader_reads_its_field(name, model, readers, elsewhere):
    for field, reader in readers.items():
        module, token = reader if isinstance(reader, tuple) else (reader, field)
        assert not module.startswith("simpletuner/config/"), f"{field}: the config layer only parses"
        read = token in names_read(module) or ("{" in token and token in (REPO / module).read_text())
        assert read, f"{name}.{field}: {module} does not read {token!r}"


@pytest.mark.parametrize("field", sorted(TRAIN_REFUSED))
def test_refused_fields_name_themselves(field):
    values, message = TRAIN_REFUSED[field]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        flux_config(**values)


@pytest.mark.parametrize("field", sorted(FAMILY_REFUSED))
def test_family_refusals_name_the_field(field):
    values, message = FAMILY_REFUSED[field]
    with pytest.raises(ConfigError) as info:
        flux_config(**values)
    assert any(e.path == field and message in e.message for e in info.value.errors), info.value.errors


@pytest.mark.parametrize("field", sorted(DEVICE_REFUSED))
def test_device_refusals_name_the_field(field):
    from simpletuner.config.requirements import device_errors

    values, device, message = DEVICE_REFUSED[field]
    config = flux_config(**values)
    errors = device_errors(config.__dict__, device)
    assert any(e.path == field and message in e.message for e in errors), errors
    assert not [e for e in device_errors(config.__dict__, "cuda") if e.path == field]


def test_regularisation_data_is_accepted_for_lora_and_full_fine_tunes(tmp_path):
    """Both model types act on it (tests/training/test_trainer.py: the LoRA switched off, or a frozen base copy)."""
    entries = [{"id": "reg", "instance_data_dir": str(tmp_path), "is_regularisation_data": True},
               {"id": "text", "dataset_type": "text_embeds"}]
    for model_type in ("lora", "full"):
        backends = load_data_backends(entries, config=flux_config(model_type=model_type))
        assert backends.datasets[0].is_regularisation_data


def test_a_run_reads_what_it_configures(make_setup, monkeypatch):
    """A real (3-step, tiny) training run with validation, eval loss and EMA on, its config recording every field
    read: each field listed above as read by the training path is read by it."""
    from simpletuner.training.trainer import train

    config, backends = make_setup(max_train_steps=3, checkpointing_steps=2, validation_steps=3,
                                  validation_prompt="a red circle", use_ema=True, eval_steps_interval=3)
    read: set[str] = set()
    fields = set(TrainConfig.model_fields)

    class Recording(type(config)):
        def __getattribute__(self, name):
            if name in fields:
                read.add(name)
            return super().__getattribute__(name)

    recording = Recording.model_construct(**config.__dict__)
    read.clear()
    train(recording, backends)
    # fields this run's settings leave unused: their code path is off here and proven by its own test
    off_here = {"pretrained_transformer_model_name_or_path", "pretrained_vae_model_name_or_path", "revision",
                "variant", "group_offload_type", "group_offload_blocks_per_group", "group_offload_use_stream",
                "group_offload_to_disk_path", "tread_config", "lycoris_config", "init_lora", "user_prompt_library",
                "validation_preview_steps", "pretrained_evaluation_model_name_or_path", "tracker_project_name",
                "tracker_run_name", "logging_dir", "optimizer_config", "data_backend_config", "lora_type",
                "text_encoder_3_precision", "text_encoder_4_precision", "tokenizer_max_length", "pretrained_transformer_subfolder",
                "gradient_checkpointing_interval", "validation_negative_prompt", "quantize_via", "lr_warmup_steps",
                "rescale_betas_zero_snr", "flow_schedule_auto_shift", "num_train_epochs", "checkpoints_total_limit",
                "framerate", "validation_num_video_frames",  # video families (tests/e2e/test_video_families_e2e.py)
                "snr_gamma",  # DDPM objectives only (tests/models/test_objectives.py)
                # full fine-tunes with regularisation data only (tests/e2e/test_regularisation_e2e.py)
                "regularisation_base_device",
                # sharded runs only (tests/training/test_sharding.py, tests/e2e/test_fsdp_e2e.py)
                "fsdp_version", "fsdp_reshard_after_forward", "fsdp_state_dict_type",
                "fsdp_transformer_layer_cls_to_wrap",
                "cache_manifest",  # split training (tests/e2e/test_split_e2e.py)
                "distillation",  # the distillation recipe (tests/training/test_distill.py)
                # fp32 run (read under mixed precision), the tiny flavour's own weights, datasets with their own size
                "base_model_default_dtype", "pretrained_model_name_or_path", "resolution", "resolution_type"}
    expected = set(TRAIN_READERS) - off_here
    missing = expected - read
    assert not missing, f"fields the run never read: {sorted(missing)}"
