"""``TrainConfig``: the schema of config.json.

Field names, meanings and defaults follow SimpleTuner's ``config.json``. Every field carries a description and
a ``group`` (model, training, lora, memory, tread, validation, logging, data) in its JSON schema, from which the
web UI builds its form. Load files through :func:`simpletuner.config.load_train_config`, which also accepts
SimpleTuner's ``--key`` spellings, ``TRAINER_EXTRA_ARGS`` and older config versions, and reports unknown keys
as warnings; ``TrainConfig.model_validate`` itself rejects unknown keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .coerce import Int, Number, StrictModel, check_resolution, parse_resolution_list
from .errors import ConfigError, FieldError
from .families import (
    OBJECTIVES,
    ModelFamily,
    all_flavours,
    all_lora_targets,
    check_flavour,
    family_names,
    family_option_errors,
    get_family,
)
from .versions import CURRENT_CONFIG_VERSION

GROUPS = ("model", "training", "lora", "memory", "tread", "validation", "logging", "data")

Precision = Literal["no_change", "int8-quanto", "int4-quanto", "int2-quanto", "fp8-quanto"]


def _field(default: Any, group: str, description: str, **kwargs: Any) -> Any:
    assert group in GROUPS, group
    extra = {"group": group, **kwargs.pop("extra", {})}
    return Field(default, description=description, json_schema_extra=extra, **kwargs)


# --- TREAD ---------------------------------------------------------------------------------------------------


class TreadRoute(StrictModel):
    """One token-routing window: ``selection_ratio`` of the image tokens skip blocks start..end (inclusive)."""

    selection_ratio: float = Field(
        ge=0, lt=1, description="fraction of image tokens routed around the window, in [0, 1)"
    )
    start_layer_idx: Int = Field(description="first block of the window; negative counts from the end (-1 = last)")
    end_layer_idx: Int = Field(description="last block of the window (inclusive); negative counts from the end")


def _same_sign(*indices: int) -> bool:
    return all(i >= 0 for i in indices) or all(i < 0 for i in indices)


def _window_errors(windows: Sequence[tuple[int, int]], path: str) -> list[FieldError]:
    """Reversed and overlapping windows, among those whose indices can be compared without the model's depth:
    all non-negative or all negative (resolved windows are always comparable)."""
    errors = []
    for i, (start, end) in enumerate(windows):
        if _same_sign(start, end) and start > end:
            errors.append(
                FieldError(f"{path}[{i}].end_layer_idx", f"{end} is before start_layer_idx {start}; the window is reversed")
            )
    for i, (s1, e1) in enumerate(windows):
        for j, (s2, e2) in enumerate(windows[:i]):
            if _same_sign(s1, e1, s2, e2) and s1 <= e1 and s2 <= e2 and max(s1, s2) <= min(e1, e2):
                errors.append(
                    FieldError(f"{path}[{i}]", f"layers {s1}..{e1} overlap route {j} ({s2}..{e2})")
                )
    return errors


class TreadConfig(StrictModel):
    """SimpleTuner's ``tread_config``: ``{"routes": [{"selection_ratio", "start_layer_idx", "end_layer_idx"}, ...]}``."""

    routes: list[TreadRoute] = Field(default_factory=list, description="token-routing windows")

    @model_validator(mode="after")
    def _check_routes(self) -> TreadConfig:
        if not self.routes:
            raise ConfigError(
                [
                    FieldError(
                        "routes",
                        "TREAD training requires you to configure the routes, e.g. "
                        '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}',
                    )
                ]
            )
        errors = _window_errors([(r.start_layer_idx, r.end_layer_idx) for r in self.routes], "routes")
        if errors:
            raise ConfigError(errors)
        return self


def resolve_tread_routes(
    routes: Sequence[TreadRoute | Mapping[str, Any]] | TreadConfig,
    num_layers: int,
    *,
    path: str = "tread_config.routes",
) -> list[tuple[float, int, int]]:
    """Resolve route windows against a model with ``num_layers`` blocks.

    Returns ``(selection_ratio, start, end)`` per route with non-negative, inclusive block indices (-1 is the
    last block). Raises ConfigError naming e.g. ``tread_config.routes[1].end_layer_idx`` when an index is out
    of range, a window is reversed, or two windows overlap.
    """
    if isinstance(routes, TreadConfig):
        routes = routes.routes
    parsed = [r if isinstance(r, TreadRoute) else TreadRoute.model_validate(r) for r in routes]
    if not parsed:
        raise ConfigError([FieldError(path, "TREAD training requires you to configure the routes")])
    last = num_layers - 1
    errors: list[FieldError] = []
    resolved: list[tuple[float, int, int]] = []
    for i, route in enumerate(parsed):
        ends = []
        for key in ("start_layer_idx", "end_layer_idx"):
            raw = getattr(route, key)
            idx = raw + num_layers if raw < 0 else raw
            if idx > last:
                errors.append(FieldError(f"{path}[{i}].{key}", f"{raw} is past the last layer ({last})"))
            elif idx < 0:
                errors.append(
                    FieldError(f"{path}[{i}].{key}", f"{raw} is before the first layer (the model has {num_layers})")
                )
            ends.append(idx)
        resolved.append((route.selection_ratio, ends[0], ends[1]))
    if not errors:
        errors = _window_errors([(s, e) for _, s, e in resolved], path)
    if errors:
        raise ConfigError(errors)
    return resolved


# --- webhooks ------------------------------------------------------------------------------------------------


class WebhookConfig(StrictModel):
    """One webhook target, in SimpleTuner's format."""

    webhook_type: Literal["raw", "discord"] = Field(
        description="'raw' POSTs JSON events (the job server); 'discord' posts messages to a Discord webhook"
    )
    callback_url: str = Field(description="http(s) URL the events are sent to")
    log_level: Literal["info", "warning", "error", "critical"] = Field(
        "info", description="lowest level of message that is sent"
    )
    message_prefix: Optional[str] = Field(None, description="text put in front of every message")
    ssl_no_verify: bool = Field(False, description="skip TLS certificate checks (self-signed servers)")
    secret: Optional[str] = Field(None, description="shared secret used to sign raw payloads (HMAC)")

    @field_validator("callback_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not (url.startswith("http://") or url.startswith("https://")) or len(url.split("://", 1)[1]) == 0:
            raise ValueError(f"{url!r} is not an http(s) URL")
        return url


# --- the config ----------------------------------------------------------------------------------------------


class TrainConfig(StrictModel):
    """A validated training config (config.json)."""

    # model
    config_version: Int = _field(
        CURRENT_CONFIG_VERSION,
        "model",
        "schema version of this config; older versions are migrated on load (absent = SimpleTuner's format)",
        ge=0,
        extra={"readOnly": True},
    )
    model_type: Literal["lora", "full"] = _field("lora", "model", "train a LoRA adapter or the full model")
    model_family: str = _field(..., "model", "model family to train", extra={"enum": family_names()})
    model_flavour: Optional[str] = _field(
        None,
        "model",
        "variant of the family; picks the default weights ('tiny' is a small random model for trying things out). "
        "Each family has its own (see /api/system/model-families); defaults to the family's default flavour.",
        extra={"enum": all_flavours()},
    )
    pretrained_model_name_or_path: Optional[str] = _field(
        None,
        "model",
        "base model: a Hugging Face repo id or a local diffusers folder. Defaults to the flavour's weights "
        "(none for flavour 'tiny', whose checkpoint the trainer generates).",
    )
    pretrained_transformer_model_name_or_path: Optional[str] = _field(
        None, "model", "load the transformer from here instead of the base model"
    )
    pretrained_transformer_subfolder: Optional[str] = _field(
        None, "model", "subfolder of the transformer (or UNet) weights; empty = the family's own ('transformer', "
                       "'unet'), 'none' = the path itself"
    )
    pretrained_vae_model_name_or_path: Optional[str] = _field(None, "model", "load the VAE from here instead")
    revision: Optional[str] = _field(None, "model", "git revision of the base model on the Hub")
    variant: Optional[str] = _field(None, "model", "weights variant, e.g. 'fp16'")

    # training
    output_dir: str = _field("output/models", "training", "where checkpoints and the final model are written")
    train_batch_size: Int = _field(1, "training", "samples per device per step", ge=1)
    gradient_accumulation_steps: Int = _field(1, "training", "micro-batches summed into one optimizer step", ge=1)
    max_train_steps: Optional[Int] = _field(
        None, "training", "optimizer steps to train; 0 or empty = use num_train_epochs", ge=0
    )
    num_train_epochs: Optional[Int] = _field(
        1, "training", "passes over the data; used when max_train_steps is 0 or empty", ge=0
    )
    learning_rate: float = _field(1e-4, "training", "peak learning rate", gt=0)
    lr_scheduler: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = _field("constant", "training", "learning-rate schedule")
    lr_warmup_steps: Int = _field(0, "training", "steps of linear warmup", ge=0)
    optimizer: Literal["adamw", "adamw_bf16"] = _field(
        "adamw", "training", "'adamw' (torch AdamW) or 'adamw_bf16' (AdamW with stochastic rounding for bf16 weights)"
    )
    adam_beta1: float = _field(0.9, "training", "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = _field(0.999, "training", "AdamW beta2", ge=0, lt=1)
    adam_weight_decay: float = _field(1e-2, "training", "AdamW weight decay", ge=0)
    adam_epsilon: float = _field(1e-8, "training", "AdamW epsilon", gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = _field("bf16", "training", "autocast precision")
    seed: Optional[Int] = _field(None, "training", "random seed; empty = not seeded")
    gradient_checkpointing: bool = _field(False, "memory", "recompute activations in backward to save memory")
    gradient_checkpointing_interval: Optional[Int] = _field(
        None, "memory", "checkpoint only every n-th block (needs gradient_checkpointing)", ge=1
    )
    max_grad_norm: float = _field(2.0, "training", "clip gradients to this norm; 0 disables clipping", ge=0)
    train_text_encoder: bool = _field(False, "training", "training the text encoders is not supported")

    # flow matching
    flow_schedule_shift: float = _field(3.0, "training", "shift of the flow-matching timestep schedule", ge=0)
    flow_schedule_auto_shift: bool = _field(
        False, "training", "shift the schedule by image size (resolution-dependent shift) instead of a fixed value"
    )
    flow_use_uniform_schedule: bool = _field(
        False, "training", "sample timesteps uniformly instead of from a sigmoid (logit-normal) distribution"
    )
    flow_sigmoid_scale: float = _field(1.0, "training", "scale of the sigmoid timestep sampling", gt=0)
    prediction_type: Optional[Literal[OBJECTIVES]] = _field(
        None,
        "training",
        "training objective: flow_matching (velocity), epsilon or v_prediction; each family allows its own, and "
        "empty means the family's default",
    )
    rescale_betas_zero_snr: bool = _field(
        False,
        "training",
        "rescale the DDPM noise schedule to zero terminal SNR (epsilon / v_prediction objectives only; pair it "
        "with v_prediction)",
    )
    snr_gamma: Optional[float] = _field(
        None,
        "training",
        "min-SNR loss weighting (Hang et al. 2023): each sample's loss is weighted by min(SNR, gamma) / SNR "
        "(epsilon) or / (SNR + 1) (v_prediction); 5 is the paper's value; empty or 0 = off. DDPM objectives only",
        ge=0,
    )
    guidance_value: Optional[float] = _field(
        None,
        "training",
        "value fed to a guidance-distilled transformer's guidance embedding during training (Flux dev: 1.0); "
        "only for families that have one. SimpleTuner: flux_guidance_value",
        ge=0,
    )

    # checkpoints
    checkpointing_steps: Optional[Int] = _field(
        500, "training", "save a checkpoint every n steps; empty = only at the end", ge=1
    )
    checkpoints_total_limit: Optional[Int] = _field(
        None, "training", "keep at most this many checkpoints; empty = keep all", ge=1
    )
    resume_from_checkpoint: Optional[str] = _field(
        None, "training", "'latest', a checkpoint folder, or empty to start fresh"
    )

    # data
    data_backend_config: Optional[str] = _field(
        None, "data", "path of multidatabackend.json (relative paths are from the working directory)"
    )
    resolution: Number = _field(1024, "data", "default dataset resolution: pixels, or megapixels for 'area'")
    resolution_type: Literal["pixel", "area", "pixel_area"] = _field(
        "pixel_area",
        "data",
        "default dataset resolution type: 'pixel' = shorter edge in pixels, 'area' = megapixels, "
        "'pixel_area' = pixel edge converted to the same area",
    )
    caption_dropout_probability: float = _field(
        0.0, "data", "chance of training a sample with an empty caption", ge=0, le=1
    )
    vae_batch_size: Int = _field(4, "data", "images per VAE encode while caching latents", ge=1)

    # LoRA
    lora_rank: Int = _field(16, "lora", "LoRA rank", ge=1)
    lora_alpha: Optional[float] = _field(None, "lora", "LoRA alpha; empty = equal to lora_rank", gt=0)
    lora_dropout: float = _field(0.1, "lora", "dropout on the LoRA input, in [0, 1)", ge=0, lt=1)
    lora_init_type: Literal["default", "gaussian", "loftq", "olora", "pissa"] = _field(
        "default", "lora", "how LoRA weights are initialised (peft init_lora_weights)"
    )
    lora_type: Literal["standard"] = _field(
        "standard", "lora", "LoRA implementation; only 'standard' (peft) is supported"
    )
    lora_target: Optional[str] = _field(
        None,
        "lora",
        "which layers get LoRA adapters: a preset of the model family (flux: all, mmdit, context, context+ffs, "
        "all+ffs, tiny, nano); empty = the family's default. SimpleTuner: flux_lora_target",
        extra={"enum": all_lora_targets()},
    )
    init_lora: Optional[str] = _field(None, "lora", "start from an existing LoRA .safetensors file")

    # memory
    base_model_precision: Precision = _field("no_change", "memory", "quantize the base model")
    text_encoder_1_precision: Precision = _field("no_change", "memory", "quantize text encoder 1")
    text_encoder_2_precision: Precision = _field("no_change", "memory", "quantize text encoder 2")
    text_encoder_3_precision: Precision = _field("no_change", "memory", "quantize text encoder 3")
    base_model_default_dtype: Literal["bf16", "fp32"] = _field(
        "bf16", "memory", "dtype of the base model's unquantized weights"
    )
    quantize_via: Literal["cpu", "accelerator"] = _field("accelerator", "memory", "where quantization runs")
    enable_group_offload: bool = _field(False, "memory", "offload transformer blocks to the CPU between uses")
    group_offload_type: Literal["block_level", "leaf_level"] = _field(
        "block_level", "memory", "granularity of group offload"
    )
    group_offload_blocks_per_group: Int = _field(1, "memory", "blocks moved together (block_level)", ge=1)
    group_offload_use_stream: bool = _field(False, "memory", "overlap transfers with compute on a CUDA stream")
    group_offload_to_disk_path: Optional[str] = _field(
        None, "memory", "offload to files in this folder (not supported for training)"
    )
    enable_model_cpu_offload: bool = _field(False, "memory", "keep idle models on the CPU")
    attention_mechanism: Literal["diffusers", "sdpa", "xformers", "flash-attn"] = _field(
        "sdpa", "memory", "attention implementation"
    )
    compile: bool = _field(False, "memory", "torch.compile the transformer")

    # TREAD
    tread_config: Optional[TreadConfig] = _field(
        None, "tread", "TREAD token routing: {\"routes\": [{selection_ratio, start_layer_idx, end_layer_idx}]}"
    )

    # validation / evaluation
    validation_steps: Optional[Int] = _field(None, "validation", "generate validation images every n steps", ge=1)
    validation_on_startup: bool = _field(False, "validation", "also validate before the first step")
    validation_prompt: Optional[str] = _field(None, "validation", "prompt for validation images")
    validation_negative_prompt: Optional[str] = _field(None, "validation", "negative prompt (real CFG only)")
    validation_reference_image: Optional[str] = _field(
        None, "validation", "edit models (Flux Kontext, Qwen-Image-Edit): the image validation_prompt edits, cropped "
                            "to each validation resolution (user_prompt_library entries name their own)"
    )
    validation_resolution: Optional[str] = _field(
        None, "validation", "'1024', '1024x768' or a comma-separated list; empty = the training resolution"
    )
    validation_guidance: float = _field(3.0, "validation", "guidance scale for validation images", ge=0)
    validation_guidance_real: float = _field(
        1.0, "validation", "real classifier-free guidance scale (1 = off)", ge=1
    )
    validation_num_inference_steps: Int = _field(20, "validation", "denoising steps per validation image", ge=1)
    validation_seed: Optional[Int] = _field(None, "validation", "seed for validation images")
    user_prompt_library: Optional[str] = _field(
        None, "validation", "JSON file of {name: prompt} used as extra validation prompts"
    )
    validation_preview: bool = _field(False, "validation", "stream decoded previews while validation images denoise")
    validation_preview_steps: Int = _field(1, "validation", "decode a preview every n denoising steps", ge=1)
    evaluation_type: Literal["none", "clip"] = _field("none", "validation", "score validation images ('clip')")
    pretrained_evaluation_model_name_or_path: str = _field(
        "openai/clip-vit-large-patch14", "validation", "CLIP model used for evaluation_type 'clip'"
    )
    eval_steps_interval: Optional[Int] = _field(None, "validation", "compute evaluation loss every n steps", ge=1)

    # logging
    report_to: Literal["none", "wandb", "tensorboard", "all"] = _field("none", "logging", "experiment tracker")
    tracker_project_name: str = _field("simpletuner", "logging", "tracker project name")
    tracker_run_name: Optional[str] = _field(None, "logging", "tracker run name")
    logging_dir: str = _field("logs", "logging", "folder for tracker logs (under output_dir)")
    webhook_config: Optional[list[WebhookConfig]] = _field(
        None,
        "logging",
        "webhook target(s): an object or list of {webhook_type, callback_url, log_level, message_prefix}",
    )

    # ---- field-level parsing ----

    @field_validator("model_family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        try:
            get_family(name)
        except ConfigError as exc:
            raise ValueError(exc.errors[0].message) from None
        return name

    @field_validator("train_text_encoder")
    @classmethod
    def _no_text_encoder_training(cls, value: bool) -> bool:
        if value:
            raise ValueError("training the text encoders is not supported; remove train_text_encoder")
        return value

    @field_validator("validation_resolution", mode="before")
    @classmethod
    def _resolution_text(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(int(value)) if float(value).is_integer() else str(value)
        if isinstance(value, str):
            parse_resolution_list(value)  # raises ValueError with the bad item
        return value

    @field_validator("tread_config", mode="before")
    @classmethod
    def _tread_json(cls, value: Any) -> Any:
        # SimpleTuner's command line passes tread_config as a JSON string
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"is not valid JSON: {exc.msg} at column {exc.colno}") from None
        return value

    @field_validator("webhook_config", mode="before")
    @classmethod
    def _webhook_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith(("{", "[")):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"is not valid JSON: {exc.msg} at column {exc.colno}") from None
            else:
                try:
                    value = json.loads(Path(text).read_text())
                except OSError:
                    raise ValueError(f"file {text!r} not found (expected an object, a list or a JSON file)") from None
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{text}: not valid JSON (line {exc.lineno}, column {exc.colno})") from None
        if isinstance(value, dict):
            value = [value]
        return value

    # ---- cross-field rules and defaults ----

    @model_validator(mode="after")
    def _check_and_fill(self) -> TrainConfig:
        errors: list[FieldError] = []
        family = get_family(self.model_family)
        if self.model_flavour is None:
            self.model_flavour = family.default_flavour
        try:
            check_flavour(family, self.model_flavour)
        except ConfigError as exc:
            errors.extend(exc.errors)
        else:
            if self.pretrained_model_name_or_path is None:
                self.pretrained_model_name_or_path = family.default_weights(self.model_flavour)
            # what the flavour implies (a v-prediction fine-tune's objective), unless the config says otherwise
            for key, value in family.flavour_defaults.get(self.model_flavour, {}).items():
                if key not in self.model_fields_set:
                    setattr(self, key, value)
        errors.extend(family_option_errors(family, self.__dict__))
        if self.lora_target is None:
            self.lora_target = family.default_lora_target
        if self.prediction_type is None:
            self.prediction_type = family.default_objective
        if self.rescale_betas_zero_snr and self.prediction_type == "flow_matching":
            errors.append(FieldError("rescale_betas_zero_snr", "applies to the DDPM objectives (epsilon, "
                                                               "v_prediction), not flow_matching"))
        if self.snr_gamma and self.prediction_type == "flow_matching":
            errors.append(FieldError("snr_gamma", "min-SNR weighting applies to the DDPM objectives (epsilon, "
                                                  "v_prediction), not flow_matching"))
        if self.guidance_value is None and family.guidance_embeds:
            self.guidance_value = family.default_guidance_value

        if not self.max_train_steps and not self.num_train_epochs:
            errors.append(
                FieldError("max_train_steps", "set max_train_steps or num_train_epochs to a positive number")
            )
        if self.max_train_steps and self.lr_warmup_steps > self.max_train_steps:
            errors.append(
                FieldError(
                    "lr_warmup_steps",
                    f"{self.lr_warmup_steps} warmup steps exceed max_train_steps ({self.max_train_steps})",
                )
            )
        if self.gradient_checkpointing_interval is not None and not self.gradient_checkpointing:
            errors.append(
                FieldError("gradient_checkpointing_interval", "needs gradient_checkpointing set to true")
            )
        message = check_resolution(self.resolution, self.resolution_type)
        if message:
            errors.append(FieldError("resolution", message))

        quantized = self.base_model_precision != "no_change"
        if self.model_type == "full" and quantized:
            errors.append(
                FieldError(
                    "base_model_precision",
                    f"{self.base_model_precision!r} cannot be used with model_type 'full' "
                    "(quantized weights cannot be trained); use no_change or model_type 'lora'",
                )
            )
        if self.model_type == "lora" and self.lora_init_type == "loftq":
            quanto = [
                name
                for name in ("base_model_precision", "text_encoder_1_precision", "text_encoder_2_precision",
                             "text_encoder_3_precision")
                if getattr(self, name).endswith("-quanto")
            ]
            if quanto:
                errors.append(
                    FieldError(
                        "lora_init_type",
                        f"'loftq' cannot be combined with quanto quantization ({', '.join(quanto)}); "
                        "LoftQ quantizes the weights itself",
                    )
                )
        if self.model_type == "full" and self.init_lora:
            errors.append(FieldError("init_lora", "needs model_type 'lora'"))
        if self.optimizer == "adamw_bf16" and self.base_model_default_dtype != "bf16":
            errors.append(FieldError("optimizer", "'adamw_bf16' needs base_model_default_dtype 'bf16'"))
        if self.enable_group_offload and self.enable_model_cpu_offload:
            errors.append(
                FieldError(
                    "enable_model_cpu_offload", "cannot be combined with enable_group_offload; choose one"
                )
            )
        if self.enable_group_offload and self.group_offload_to_disk_path:
            errors.append(
                FieldError(
                    "group_offload_to_disk_path",
                    "group offload to disk loses LoRA updates during training (diffusers 0.42); "
                    "leave it empty to offload to CPU memory",
                )
            )
        if (
            self.enable_group_offload
            and quantized
            and not (self.gradient_checkpointing and (self.gradient_checkpointing_interval or 1) == 1)
        ):
            # autograd would still hold the quantized weights when the offload hooks move them
            errors.append(
                FieldError(
                    "enable_group_offload",
                    f"with a quantized base ({self.base_model_precision}) needs gradient_checkpointing on every "
                    "block (gradient_checkpointing true, gradient_checkpointing_interval empty or 1)",
                )
            )
        if self.model_type == "lora" and self.lora_alpha is None:
            self.lora_alpha = float(self.lora_rank)
        if errors:
            raise ConfigError(errors)
        return self

    # ---- derived values ----

    @property
    def family(self) -> ModelFamily:
        """The :class:`~simpletuner.config.families.ModelFamily` of ``model_family``."""
        return get_family(self.model_family)

    @property
    def validation_resolutions(self) -> list[tuple[int, int]]:
        """Validation sizes as (width, height); the training resolution when ``validation_resolution`` is empty."""
        if self.validation_resolution:
            return parse_resolution_list(self.validation_resolution)
        if self.resolution_type == "area":
            side = int(round((self.resolution * 1_000_000) ** 0.5 / 64) * 64) or 64
            return [(side, side)]
        side = int(self.resolution)
        return [(side, side)]


def check_train_paths(config: TrainConfig, cwd: str | os.PathLike[str] | None = None) -> list[str]:
    """Warnings (``path: message``) for files and folders named in ``config`` that do not exist.

    Relative paths are taken from ``cwd`` (default: the working directory), as SimpleTuner does. Hub repo ids
    are not checked; only values that look like local paths.
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    warnings = []

    def local(value: str | None) -> Path | None:
        if not value:
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() else base / path

    for name in ("user_prompt_library", "init_lora"):
        path = local(getattr(config, name))
        if path is not None and not path.exists():
            warnings.append(f"{name}: file {getattr(config, name)!r} does not exist")
    for name in (
        "pretrained_model_name_or_path",
        "pretrained_transformer_model_name_or_path",
        "pretrained_vae_model_name_or_path",
    ):
        value = getattr(config, name)
        looks_local = bool(value) and (value.startswith(("/", "./", "../", "~")) or value.count("/") > 1)
        if looks_local and not local(value).exists():  # type: ignore[union-attr]
            warnings.append(f"{name}: folder {value!r} does not exist (and is not a Hugging Face repo id)")
    return warnings
