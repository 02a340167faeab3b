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

from typing import Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .coerce import Int, Number, StrictModel, check_resolution, parse_resolution_list
from .distill import DistillationConfig
from . import paths
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
from .requirements import OPTIMIZERS, PRECISIONS
from .versions import CURRENT_CONFIG_VERSION

# The field groups, in the order the web UI shows them, with their labels (every field names its group).
GROUPS: dict[str, str] = {
    "model": "Model",
    "training": "Training",
    "lora": "LoRA",
    "memory": "Memory (quantization, offload)",
    "tread": "TREAD",
    "validation": "Validation",
    "logging": "Logging",
    "data": "Data",
    "distributed": "Several GPUs (FSDP, DeepSpeed)",
    "distillation": "Distillation",
}
# Upper bounds that no real run comes near; they turn typos such as max_train_steps=2**63 into clear errors.
MAX_STEPS = 1_000_000_000
MAX_BATCH = 65_536
MAX_SEED = 2**32 - 1  # numpy's seed range

Precision = Literal[PRECISIONS]
LYCORIS_ALGOS = ("lokr", "loha", "locon", "lora", "full")


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


# --- optimizer kwargs, LyCORIS ---------------------------------------------------------------------------------


def _split_outside_brackets(text: str) -> list[str]:
    """``"a=1,b=(0.9,0.99)"`` -> ``["a=1", "b=(0.9,0.99)"]``: commas inside brackets do not split."""
    depth, item, items = 0, "", []
    for ch in text:
        depth += 1 if ch in "([" else -1 if ch in ")]" else 0
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    return items


def _scalar(text: str) -> Any:
    """``"0.1"`` -> 0.1, ``"true"`` -> True, ``"none"`` -> None, ``"(0.9, 0.99)"`` -> [0.9, 0.99], else the text."""
    value = text.strip()
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if value.startswith(("(", "[")) and value.endswith((")", "]")):
        return [_scalar(v) for v in _split_outside_brackets(value[1:-1]) if v.strip()]
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def parse_optimizer_config(value: Any) -> Any:
    """SimpleTuner's ``optimizer_config``: ``"d_coef=0.1,betas=(0.9,0.99)"``, a JSON object, or a mapping."""
    if value is None or isinstance(value, Mapping):
        return dict(value) if value is not None else None
    if not isinstance(value, str):
        raise ValueError(f"expected 'key=value,key=value' or an object, got {value!r}")
    text = value.strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON: {exc.msg} at column {exc.colno}") from None
    out: dict[str, Any] = {}
    for part in _split_outside_brackets(text):  # betas=(0.9,0.99) stays one item
        if not part.strip():
            continue
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{part.strip()!r} is not key=value (e.g. 'd_coef=0.1,weight_decay=0.01')")
        if not raw.strip():
            raise ValueError(f"{key.strip()} has no value (e.g. '{key.strip()}=0.1')")
        out[key.strip()] = _scalar(raw)
    return out


def _json_or_file(value: Any, what: str) -> Any:
    """An object (or list) as given, a JSON string, or the path of a JSON file holding it."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON: {exc.msg} at column {exc.colno}") from None
    roots = paths.roots_from_env()
    if roots is not None:  # a server's job: the file must resolve inside its allowed roots now, as it is read
        problem = paths.problem(text, roots, os.getcwd(), "file")
        if problem:
            raise ValueError(problem)
    try:
        return json.loads(Path(text).expanduser().read_text())
    except OSError:
        raise ValueError(f"file {text!r} not found (expected {what} or a JSON file holding it)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{text}: not valid JSON (line {exc.lineno}, column {exc.colno})") from None


class LycorisConfig(BaseModel):
    """SimpleTuner's lycoris_config.json: the algorithm, its size, where it applies, and any further keyword
    arguments of the algorithm (passed to lycoris' ``create_lycoris`` as they are)."""

    model_config = ConfigDict(extra="allow")

    algo: Literal[LYCORIS_ALGOS] = Field(description="lokr, loha, locon (= lora) or full")
    multiplier: float = Field(1.0, description="strength the network is applied with (1.0 to train)")
    linear_dim: Int = Field(10000, ge=1, description="rank (lokr: 10000 means 'as large as factor allows')")
    linear_alpha: float = Field(1.0, gt=0, description="alpha scaling, as in LoRA")
    factor: Int = Field(-1, description="lokr's Kronecker factor (-1 = automatic)")
    apply_preset: Optional[Union[str, dict[str, Any]]] = Field(
        None,
        description="which modules it applies to: a lycoris preset name (full, full-lin, attn-mlp, attn-only, ...) or "
                    "{target_module, target_name, module_algo_map, name_algo_map}; empty = the family's default",
    )

    @field_validator("algo", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value


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
        extra={"path": "model"},
    )
    pretrained_transformer_model_name_or_path: Optional[str] = _field(
        None, "model", "load the transformer from here instead of the base model", extra={"path": "model"}
    )
    pretrained_transformer_subfolder: Optional[str] = _field(
        None, "model", "subfolder of the transformer (or UNet) weights; empty = the family's own ('transformer', "
                       "'unet'), 'none' = the path itself", extra={"path": "subfolder"}
    )
    pretrained_vae_model_name_or_path: Optional[str] = _field(
        None, "model", "load the VAE from here instead", extra={"path": "model"}
    )
    revision: Optional[str] = _field(None, "model", "git revision of the base model on the Hub")
    variant: Optional[str] = _field(None, "model", "weights variant, e.g. 'fp16'", pattern=r"^[A-Za-z0-9_-]*$")

    # training
    output_dir: str = _field(
        "output/models", "training", "where checkpoints and the final model are written", extra={"path": "dir"}
    )
    train_batch_size: Int = _field(1, "training", "samples per device per step", ge=1, le=MAX_BATCH)
    gradient_accumulation_steps: Int = _field(
        1, "training", "micro-batches summed into one optimizer step", ge=1, le=MAX_BATCH
    )
    max_train_steps: Optional[Int] = _field(
        None, "training", "optimizer steps to train; 0 or empty = use num_train_epochs", ge=0, le=MAX_STEPS
    )
    num_train_epochs: Optional[Int] = _field(
        1, "training", "passes over the data; used when max_train_steps is 0 or empty", ge=0, le=MAX_STEPS
    )
    learning_rate: float = _field(1e-4, "training", "peak learning rate", gt=0)
    lr_scheduler: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = _field("constant", "training", "learning-rate schedule")
    lr_warmup_steps: Int = _field(0, "training", "steps of linear warmup", ge=0, le=MAX_STEPS)
    optimizer: Literal[OPTIMIZERS] = _field(
        "adamw",
        "training",
        "optimizer, by SimpleTuner's names: adamw (torch), adamw_bf16 (stochastic rounding for bf16 weights), "
        "optimi-adamw / optimi-stableadamw / optimi-lion (Kahan summation for bf16), prodigy, adamw_schedulefree, "
        "ademamix, and bitsandbytes' bnb-adamw8bit, bnb-lion8bit, bnb-ademamix8bit and their -paged variants "
        "(CUDA only)",
    )
    optimizer_config: Optional[dict[str, Any]] = _field(
        None,
        "training",
        "extra keyword arguments for the optimizer, e.g. 'd_coef=0.1,weight_decay=0.01' or a JSON object; they win "
        "over the adam_* settings",
    )
    adam_beta1: float = _field(0.9, "training", "beta1 of the Adam-family (and Lion) optimizers", ge=0, lt=1)
    adam_beta2: float = _field(0.999, "training", "beta2 of the Adam-family (and Lion) optimizers", ge=0, lt=1)
    adam_weight_decay: float = _field(1e-2, "training", "weight decay", ge=0)
    adam_epsilon: float = _field(1e-8, "training", "epsilon of the Adam-family optimizers", gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = _field("bf16", "training", "autocast precision")
    seed: Optional[Int] = _field(None, "training", "random seed; empty = not seeded", ge=0, le=MAX_SEED)
    gradient_checkpointing: bool = _field(False, "memory", "recompute activations in backward to save memory")
    gradient_checkpointing_interval: Optional[Int] = _field(
        None, "memory", "checkpoint only every n-th block (needs gradient_checkpointing)", ge=1
    )
    max_grad_norm: float = _field(2.0, "training", "clip gradients to this norm; 0 disables clipping", ge=0)
    max_nan_loss_steps: Int = _field(
        0,
        "training",
        "steps in a row whose loss is NaN or inf that are skipped (no weight update) before the run stops with "
        "a failure; 0 = stop at the first",
        ge=0,
        le=MAX_STEPS,
    )
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
    flow_fast_schedule: Optional[bool] = _field(
        None,
        "training",
        "draw sigmas from a timestep-distilled model's few-step schedule (1.0 seven times in ten, else 0.75, 0.5, "
        "0.25) instead of the sigmoid; empty = the flavour's default (on for Flux schnell). "
        "SimpleTuner: flux_fast_schedule",
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
        500, "training", "save a checkpoint every n steps; empty = only at the end", ge=1, le=MAX_STEPS
    )
    checkpoints_total_limit: Optional[Int] = _field(
        None, "training", "keep at most this many checkpoints; empty = keep all", ge=1
    )
    resume_from_checkpoint: Optional[str] = _field(
        None,
        "training",
        "'latest', a checkpoint folder (relative: from the working directory, else from output_dir), or empty to "
        "start fresh",
        extra={"path": "dir", "path_base": "either"},
    )

    # data
    data_backend_config: Optional[str] = _field(
        None,
        "data",
        "path of multidatabackend.json (relative paths are from the working directory)",
        extra={"path": "file"},
    )
    resolution: Number = _field(1024, "data", "default dataset resolution: pixels, or megapixels for 'area'")
    resolution_type: Literal["pixel", "area", "pixel_area"] = _field(
        "pixel_area",
        "data",
        "default dataset resolution type: 'pixel' = shorter edge in pixels, 'area' = megapixels, "
        "'pixel_area' = pixel edge converted to the same area",
    )
    tokenizer_max_length: Optional[Int] = _field(
        None,
        "data",
        "tokens the (main) text encoder sees per prompt; longer prompts are cut. Empty = the flavour's own "
        "(Flux: 512, schnell 256)",
        ge=1,
    )
    attention_masked_training: Optional[bool] = _field(
        None,
        "training",
        "mask padding text tokens out of the transformer's attention (training and validation); empty = the "
        "flavour's default (on for LibreFlux). SimpleTuner: flux_attention_masked_training",
    )
    caption_dropout_probability: float = _field(
        0.0, "data", "chance of training a sample with an empty caption", ge=0, le=1
    )
    vae_batch_size: Int = _field(4, "data", "images per VAE encode while caching latents", ge=1, le=MAX_BATCH)
    train_from_cache: bool = _field(
        False,
        "data",
        "split training, stage 2: train from the cache manifest that `simpletuner cache` (stage 1) wrote, never "
        "loading the text encoders or the VAE's encoder; a manifest that does not match this config is an error. "
        "DiffSynth-Studio: --task sft:train after sft:data_process",
    )
    cache_manifest: Optional[str] = _field(
        None,
        "data",
        "the cache manifest `simpletuner cache` writes and train_from_cache reads; empty = cache_manifest.json in "
        "the text_embeds backend's cache_dir",
        extra={"path": "file"},
    )

    # LoRA
    lora_rank: Int = _field(16, "lora", "LoRA rank", ge=1)
    lora_alpha: Optional[float] = _field(None, "lora", "LoRA alpha; empty = equal to lora_rank", gt=0)
    lora_dropout: float = _field(0.1, "lora", "dropout on the LoRA input, in [0, 1)", ge=0, lt=1)
    lora_init_type: Literal["default", "gaussian", "loftq", "olora", "pissa"] = _field(
        "default", "lora", "how LoRA weights are initialised (peft init_lora_weights)"
    )
    lora_type: Literal["standard", "lycoris"] = _field(
        "standard", "lora", "'standard' (a peft LoRA) or 'lycoris' (LoKr, LoHa, LoCon, full; see lycoris_config)"
    )
    lycoris_config: Optional[LycorisConfig] = _field(
        None,
        "lora",
        "the LyCORIS network for lora_type 'lycoris': a JSON file such as config/lycoris_config.json, or its "
        "contents ({algo, multiplier, linear_dim, linear_alpha, factor, apply_preset, ...})",
        extra={"path": "json"},
    )
    lora_target: Optional[str] = _field(
        None,
        "lora",
        "which layers get LoRA adapters: a preset of the model family (flux: all, mmdit, context, context+ffs, "
        "all+ffs, tiny, nano); empty = the family's default. SimpleTuner: flux_lora_target",
        extra={"enum": all_lora_targets()},
    )
    init_lora: Optional[str] = _field(
        None, "lora", "start from an existing LoRA .safetensors file", extra={"path": "file"}
    )

    # memory
    base_model_precision: Precision = _field("no_change", "memory", "quantize the base model")
    text_encoder_1_precision: Precision = _field("no_change", "memory", "quantize text encoder 1")
    text_encoder_2_precision: Precision = _field("no_change", "memory", "quantize text encoder 2")
    text_encoder_3_precision: Precision = _field("no_change", "memory", "quantize text encoder 3")
    text_encoder_4_precision: Precision = _field("no_change", "memory", "quantize text encoder 4 (HiDream's Llama)")
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
        None, "memory", "offload to files in this folder (not supported for training)", extra={"path": "dir"}
    )
    enable_model_cpu_offload: bool = _field(
        False, "memory", "keep the VAE and text encoders on the CPU and move each to the accelerator only while it "
                         "runs (caching and validation); not on a CPU-only run"
    )
    offload_during_startup: bool = _field(
        False, "memory", "while caching, never hold the VAE and the text encoders in accelerator memory at once: the "
                         "VAE leaves before the text encoders load"
    )
    vae_enable_tiling: bool = _field(
        False, "memory", "encode and decode with the VAE in overlapping tiles (less memory for large images)"
    )
    attention_mechanism: Literal["diffusers", "sdpa", "xformers", "flash-attn"] = _field(
        "sdpa", "memory", "attention implementation"
    )
    compile: bool = _field(False, "memory", "torch.compile the transformer")

    # sharded training (several processes)
    fsdp_enable: bool = _field(
        False, "distributed", "shard the transformer's weights, gradients and optimizer state across the run's "
                              "processes with FSDP2 (PyTorch's fully_shard; through accelerate's FSDP plugin on GPUs); "
                              "needs 2 or more processes (--num_processes)"
    )
    fsdp_version: Int = _field(2, "distributed", "FSDP API version; only 2 (FSDP2, DTensor shards) is supported")
    fsdp_reshard_after_forward: bool = _field(
        True, "distributed", "free each block's gathered weights after its forward and gather them again for the "
                             "backward (least memory); false keeps them until the backward (less communication)"
    )
    fsdp_state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = _field(
        "SHARDED_STATE_DICT", "distributed", "checkpoint layout with fsdp_enable: SHARDED_STATE_DICT (every process "
                                             "writes its own shard; 'sharded') or FULL_STATE_DICT (the main process "
                                             "gathers and writes whole tensors; 'full')"
    )
    fsdp_transformer_layer_cls_to_wrap: Optional[list[str]] = _field(
        None, "distributed", "class names of the blocks sharded one by one, comma-separated (e.g. "
                             "'FluxTransformerBlock,FluxSingleTransformerBlock'); empty = the model family's own "
                             "transformer blocks"
    )
    deepspeed_config: Optional[dict[str, Any]] = _field(
        None, "distributed", "DeepSpeed config passed to accelerate (ZeRO stage 2 or 3 on CUDA GPUs): a JSON object "
                             "or the path of a JSON file; 'auto' batch, accumulation and clipping values are filled "
                             "from this config", extra={"path": "json"}
    )

    # EMA
    use_ema: bool = _field(False, "training", "keep an exponential moving average of the trained weights")
    ema_decay: float = _field(0.995, "training", "EMA decay (ramped up from 0 over the first steps, as diffusers "
                                                 "does)", gt=0, lt=1)
    ema_update_interval: Int = _field(1, "training", "update the EMA every n optimizer steps", ge=1)
    ema_device: Literal["cpu", "accelerator"] = _field(
        "cpu", "memory", "where the EMA weights live: 'cpu' saves accelerator memory, 'accelerator' is faster"
    )
    regularisation_base_device: Literal["accelerator", "cpu"] = _field(
        "accelerator", "memory", "model_type full with regularisation data: where the frozen copy of the base model "
                                 "whose predictions are those samples' targets lives; 'cpu' keeps it in CPU memory and "
                                 "moves one block at a time to the accelerator while it runs (slower)"
    )
    ema_validation: Literal["none", "ema_only", "comparison"] = _field(
        "comparison", "validation", "validation images with the EMA weights: 'none', 'ema_only', or 'comparison' "
                                    "(both; EMA images are named <nickname>_ema_<size>)"
    )

    # TREAD
    tread_config: Optional[TreadConfig] = _field(
        None, "tread", "TREAD token routing: {\"routes\": [{selection_ratio, start_layer_idx, end_layer_idx}]}"
    )

    # distillation
    distillation: Optional[DistillationConfig] = _field(
        None, "distillation", "turn the model (the teacher) into a few-step student: {\"objective\": \"dmd\", "
                              "\"prompts\": [...], \"denoising_step_list\": [1000, 750, 500, 250], ...}; empty = "
                              "fine-tuning (see docs/distillation.md)"
    )

    # validation / evaluation
    validation_steps: Optional[Int] = _field(
        None, "validation", "generate validation images every n steps", ge=1, le=MAX_STEPS
    )
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
    validation_num_inference_steps: Int = _field(
        20, "validation", "denoising steps per validation image", ge=1, le=10_000
    )
    validation_seed: Optional[Int] = _field(None, "validation", "seed for validation images", ge=0, le=MAX_SEED)
    user_prompt_library: Optional[str] = _field(
        None, "validation", "JSON file of {name: prompt} used as extra validation prompts", extra={"path": "file"}
    )
    validation_num_video_frames: Optional[Int] = _field(
        None, "validation", "frames per validation video (video families); empty = the family's default", ge=1
    )
    framerate: Optional[Number] = _field(
        None, "validation", "frames per second of validation videos; empty = the family's native rate", gt=0
    )
    validation_preview: bool = _field(False, "validation", "stream decoded previews while validation images denoise")
    validation_preview_steps: Int = _field(1, "validation", "decode a preview every n denoising steps", ge=1)
    evaluation_type: Literal["none", "clip"] = _field("none", "validation", "score validation images ('clip')")
    pretrained_evaluation_model_name_or_path: str = _field(
        "openai/clip-vit-large-patch14",
        "validation",
        "CLIP model used for evaluation_type 'clip'",
        extra={"path": "model"},
    )
    eval_steps_interval: Optional[Int] = _field(
        None, "validation", "compute evaluation loss every n steps", ge=1, le=MAX_STEPS
    )

    # logging
    report_to: Literal["none", "wandb", "tensorboard", "all"] = _field("none", "logging", "experiment tracker")
    tracker_project_name: str = _field("simpletuner", "logging", "tracker project name")
    tracker_run_name: Optional[str] = _field(
        None, "logging", "tracker run name (also a folder name under logging_dir)", extra={"path": "subfolder"}
    )
    logging_dir: str = _field(
        "logs",
        "logging",
        "folder for tracker logs (under output_dir)",
        extra={"path": "dir", "path_base": "output_dir"},
    )
    webhook_config: Optional[list[WebhookConfig]] = _field(
        None,
        "logging",
        "webhook target(s): an object or list of {webhook_type, callback_url, log_level, message_prefix}",
        extra={"path": "webhook"},
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

    @field_validator("tread_config", "distillation", mode="before")
    @classmethod
    def _tread_json(cls, value: Any) -> Any:
        # SimpleTuner's command line passes tread_config (and --distillation) as a JSON string
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"is not valid JSON: {exc.msg} at column {exc.colno}") from None
        return value

    @field_validator("optimizer_config", mode="before")
    @classmethod
    def _optimizer_kwargs(cls, value: Any) -> Any:
        return parse_optimizer_config(value)

    @field_validator("lycoris_config", mode="before")
    @classmethod
    def _lycoris_file(cls, value: Any) -> Any:
        return _json_or_file(value, "an object such as {\"algo\": \"lokr\", \"factor\": 16}")

    @field_validator("fsdp_state_dict_type", mode="before")
    @classmethod
    def _state_dict_type(cls, value: Any) -> Any:
        # accelerate's spelling, or the short 'sharded' / 'full'
        if isinstance(value, str):
            text = value.strip().upper()
            return {"SHARDED": "SHARDED_STATE_DICT", "FULL": "FULL_STATE_DICT"}.get(text, text) \
                if text in ("SHARDED", "FULL", "SHARDED_STATE_DICT", "FULL_STATE_DICT") else value
        return value

    @field_validator("fsdp_version")
    @classmethod
    def _fsdp2_only(cls, value: int) -> int:
        if value == 1:
            raise ValueError("FSDP1 is not supported; use 2 (FSDP2, what accelerate recommends)")
        if value != 2:
            raise ValueError(f"{value} is not an FSDP version; use 2")
        return value

    @field_validator("fsdp_transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _class_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",") if name.strip()] or None
        for name in value or []:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"{name!r} is not a class name (expected e.g. 'FluxTransformerBlock')")
        return value

    @field_validator("deepspeed_config", mode="before")
    @classmethod
    def _deepspeed_file(cls, value: Any) -> Any:
        value = _json_or_file(value, 'an object such as {"zero_optimization": {"stage": 2}}')
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        zero = value.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError('zero_optimization: expected an object such as {"stage": 2}')
        stage = zero.get("stage")
        if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            raise ValueError(f"zero_optimization.stage: {stage!r} is not a ZeRO stage (0, 1, 2 or 3)")
        for section, ours in (("optimizer", "optimizer"), ("scheduler", "lr_scheduler")):
            if section in value:
                raise ValueError(f"{section}: the trainer builds its own from the config's {ours}; remove the "
                                 f"DeepSpeed config's {section!r} section")
        return value

    @field_validator("webhook_config", mode="before")
    @classmethod
    def _webhook_list(cls, value: Any) -> Any:
        value = _json_or_file(value, "an object or a list of them")
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
                if key not in self.model_fields_set or getattr(self, key) is None:
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
        if self.flow_fast_schedule is None:
            self.flow_fast_schedule = False
        if self.attention_masked_training is None:
            self.attention_masked_training = False
        if self.attention_masked_training and self.tread_config is not None:
            errors.append(FieldError("attention_masked_training", "cannot be combined with tread_config (routing "
                                                                  "changes which image tokens the mask covers)"))
        if self.flow_fast_schedule and self.prediction_type != "flow_matching":
            errors.append(FieldError("flow_fast_schedule", "applies to the flow_matching objective only"))
        if self.flow_fast_schedule and (self.flow_use_uniform_schedule or self.flow_schedule_auto_shift):
            other = "flow_use_uniform_schedule" if self.flow_use_uniform_schedule else "flow_schedule_auto_shift"
            errors.append(FieldError("flow_fast_schedule", f"draws its own sigmas; it cannot be combined with {other}"))

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
        if self.lora_type == "lycoris" and self.base_model_precision in ("int8-torchao", "fp8-torchao", "nf4-bnb"):
            errors.append(FieldError("base_model_precision", f"{self.base_model_precision!r} cannot carry a LyCORIS "
                                                             "network; use a quanto precision or lora_type 'standard'"))
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
                             "text_encoder_3_precision", "text_encoder_4_precision")
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
        if self.lora_type == "lycoris" and self.model_type == "lora":
            if self.lycoris_config is None:
                errors.append(FieldError("lycoris_config", "is required with lora_type 'lycoris', e.g. "
                                                           '{"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1, '
                                                           '"factor": 16}'))
            if self.lora_init_type != "default":
                errors.append(FieldError("lora_init_type", f"{self.lora_init_type!r} initialises peft LoRAs; "
                                                           "lora_type 'lycoris' initialises its own"))
            if self.init_lora:
                errors.append(FieldError("init_lora", "loads a peft LoRA; it cannot start a lora_type 'lycoris' "
                                                      "network"))
            if self.lora_target not in (None, family.default_lora_target):
                errors.append(FieldError("lora_target", "chooses peft LoRA layers; with lora_type 'lycoris' set "
                                                        "lycoris_config.apply_preset instead"))
        elif self.lycoris_config is not None and self.model_type == "lora":
            errors.append(FieldError("lycoris_config", "is only read with lora_type 'lycoris'; set lora_type or "
                                                       "remove it"))
        if self.model_type == "full" and (self.lora_type != "standard" or self.lycoris_config is not None):
            errors.append(FieldError("lora_type", "LyCORIS trains an adapter: it needs model_type 'lora'"))
        if self.optimizer_config is not None and "lr" in self.optimizer_config:
            errors.append(FieldError("optimizer_config.lr", "set learning_rate instead"))
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
        errors.extend(_sharding_errors(self))
        if self.distillation is not None:
            errors.extend(distillation_errors(self))
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


# settings a sharded run (fsdp_enable, deepspeed_config) cannot take yet, and why
_NOT_SHARDED = {
    "use_ema": "the EMA would average one process's shard only",
    "enable_group_offload": "group offload moves whole blocks that FSDP holds as shards",
    "tread_config": "TREAD's router is not proven on sharded blocks",
    "compile": "compiled blocks are not proven under sharding",
    "validation_steps": "every process must take part in each forward of a sharded model, and validation runs on "
                        "the main process only; validate the consolidated model (simpletuner consolidate)",
    "validation_on_startup": "validation runs on the main process only (see validation_steps)",
    "eval_steps_interval": "the eval loss runs on the main process only (see validation_steps)",
}


def _sharding_errors(config: TrainConfig) -> list[FieldError]:
    """What ``fsdp_enable`` / ``deepspeed_config`` cannot be combined with."""
    if not (config.fsdp_enable or config.deepspeed_config is not None):
        return []
    errors = []
    mode = "fsdp_enable" if config.fsdp_enable else "deepspeed_config"
    if config.fsdp_enable and config.deepspeed_config is not None:
        errors.append(FieldError("deepspeed_config", "cannot be combined with fsdp_enable; choose one"))
    for name, why in _NOT_SHARDED.items():
        if getattr(config, name) not in (None, False):
            errors.append(FieldError(name, f"cannot be combined with {mode} yet: {why}"))
    if config.base_model_precision != "no_change":
        errors.append(FieldError("base_model_precision", f"{config.base_model_precision!r} cannot be combined with "
                                                         f"{mode}: quantized weights cannot be sharded here; use "
                                                         "no_change"))
    if config.model_type == "lora" and config.lora_type == "lycoris":
        errors.append(FieldError("lora_type", f"'lycoris' cannot be combined with {mode} yet; use 'standard'"))
    return errors


def distillation_errors(config: TrainConfig) -> list[FieldError]:
    """Fine-tuning settings the distillation recipe does not read, refused when they are turned on."""
    refused = {
        "tread_config": config.tread_config is not None,
        "caption_dropout_probability": bool(config.caption_dropout_probability),
        "eval_steps_interval": config.eval_steps_interval is not None,
        "lora_type": config.model_type == "lora" and config.lora_type == "lycoris",
    }
    errors = [FieldError(name, "is not used by the distillation recipe; remove it (or the distillation block)")
              for name, on in refused.items() if on]
    if not config.max_train_steps:
        errors.append(FieldError("max_train_steps", "a distillation learns from prompts, with no epochs over a "
                                                    "dataset: set max_train_steps"))
    if config.distillation.causal and config.model_family != "wan":
        errors.append(FieldError("distillation.causal", f"the causal (Self-Forcing) student is a Wan; model_family is "
                                                        f"{config.model_family!r}"))
    if config.gradient_accumulation_steps != 1:
        errors.append(FieldError("gradient_accumulation_steps", "the distillation recipe steps every network every "
                                                                "step; raise train_batch_size instead"))
    if config.fsdp_enable or config.deepspeed_config is not None:
        errors.append(FieldError("fsdp_enable" if config.fsdp_enable else "deepspeed_config",
                                 "the distillation recipe runs unsharded (its critic and GAN head are not sharded); "
                                 "remove it (or the distillation block)"))
    if config.train_from_cache:
        errors.append(FieldError("train_from_cache", "the distillation recipe encodes its prompts itself; remove it "
                                                     "(or the distillation block)"))
    return errors


def is_local(path: str) -> bool:
    """Whether a model path means a file or folder on this machine rather than a Hugging Face repo id (owner/name):
    it exists, or it is written as a path (absolute, ./, ../, ~, a backslash, or more than one '/')."""
    if Path(path).expanduser().exists():
        return True
    return path.startswith(("/", "./", "../", "~", ".\\")) or "\\" in path or path.count("/") > 1


MODEL_PATH_FIELDS = (
    "pretrained_model_name_or_path",
    "pretrained_transformer_model_name_or_path",
    "pretrained_vae_model_name_or_path",
)


def flavour_path_errors(config: TrainConfig) -> list[FieldError]:
    """Contradictions between a flavour whose weights are generated on this machine (``tiny``) and model paths
    that name other weights: any ``pretrained_model_name_or_path`` (the flavour decides the model), and a Hub id as
    the transformer or VAE (a local folder is fine: a test or a user's own tiny parts)."""
    family = config.family
    flavour = config.model_flavour
    if flavour not in family.flavours or family.flavours[flavour] is not None:
        return []
    errors = []
    for name in MODEL_PATH_FIELDS:
        value = getattr(config, name)
        if not value or (name != "pretrained_model_name_or_path" and is_local(value)):
            continue
        kind = "the local folder" if is_local(value) else "the Hub model"
        errors.append(FieldError(
            name, f"model_flavour {flavour!r} is a small model generated on this machine, and {name} names {kind} "
                  f"{value!r}, whose weights do not belong to it; set {name} to null for {flavour!r}, or set "
                  "model_flavour to the flavour of those weights"))
    return errors


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
    for name in MODEL_PATH_FIELDS:
        value = getattr(config, name)
        if value and is_local(value) and not local(value).exists():  # type: ignore[union-attr]
            warnings.append(f"{name}: folder {value!r} does not exist (and is not a Hugging Face repo id)")
    return warnings
