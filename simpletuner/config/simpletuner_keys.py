"""SimpleTuner's documented keys that are not fields here, each with what this version does about it.

A SimpleTuner user's config.json and multidatabackend.json carry keys from SimpleTuner's quickstarts and examples
that this version names differently or does not implement. None of them is reported as an "unknown key":

- ``ALIASES``: SimpleTuner's other spelling of one of our fields (its newer names ``checkpoint_step_interval`` and
  ``validation_step_interval``); the value is used.
- a :class:`KeyRule`: values that ask for nothing beyond what this version does anyway (``false``, ``0``, empty,
  or the one choice we implement) are accepted without a word; any other value is refused with an error that says
  what to use instead. Keys that only name or tune something that does not exist here, and change no result
  (``refuse=False``), get a warning saying so instead.

Keys this version implements are TrainConfig / DatasetBackend fields and never appear here
(``tests/config/test_simpletuner_keys.py`` checks that).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FieldError

# SimpleTuner's current spelling -> our field (SimpleTuner accepts ours as deprecated aliases of these)
ALIASES: Mapping[str, str] = {
    "checkpoint_step_interval": "checkpointing_steps",
    "validation_step_interval": "validation_steps",
}


def _off(value: Any) -> bool:
    """false / 0 / empty / null, as SimpleTuner's JSON and command line spell them."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, str):
        return value.strip().lower() in ("", "false", "0", "0.0", "no", "off", "none", "null")
    return False


def _on(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"))


def _never(value: Any) -> bool:
    return False


@dataclass(frozen=True)
class KeyRule:
    """What happens to a documented SimpleTuner key that is not a field: ``accepts(value)`` true -> silently
    accepted (it asks for nothing we do not do); otherwise an error (``refuse``) or a warning with ``message``."""

    message: str
    accepts: Callable[[Any], bool] = _off
    refuse: bool = True


_NO_HUB_UPLOAD = ("uploading to the Hugging Face Hub is not built in; after training, upload the output folder "
                  "with `hf upload <repo id> <output_dir>`")


def _any(value: Any) -> bool:
    return True


def _equals(*accepted: Any) -> Callable[[Any], bool]:
    """Accepts ``accepted`` values (numbers compared as numbers, strings case-insensitively) and off values."""
    def accepts(value: Any) -> bool:
        if _off(value):
            return True
        for want in accepted:
            try:
                if isinstance(want, (int, float)) and float(value) == float(want):
                    return True
            except (TypeError, ValueError):
                pass
            if isinstance(value, str) and isinstance(want, str) and value.strip().lower() == want:
                return True
        return False

    return accepts


_NO_EFFECT = "has no effect in this version"

TRAIN_KEYS: Mapping[str, KeyRule] = {
    # --- memory and speed ---
    "allow_tf32": KeyRule(
        f"{_NO_EFFECT}: PyTorch's default matmul precision is used (TF32 is a GPU speed setting that never changes "
        "what is trained)", accepts=_off, refuse=False),
    "fuse_qkv_projections": KeyRule(
        f"{_NO_EFFECT}: attention runs through attention_mechanism (sdpa by default); remove it",
        accepts=_off, refuse=False),
    "checkpointing_use_tempdir": KeyRule(
        "is always on here: checkpoints are written to a temporary folder and renamed into place",
        accepts=_any),
    "metadata_update_interval": KeyRule(
        f"{_NO_EFFECT}: image sizes are read once per file and kept with the cache", accepts=_any),
    "i_know_what_i_am_doing": KeyRule(
        f"{_NO_EFFECT}: the checks here cannot be switched off; each error says what to change",
        accepts=_off, refuse=False),
    "fsdp_auto_wrap_policy": KeyRule(
        "only TRANSFORMER_BASED_WRAP is implemented: each block named by fsdp_transformer_layer_cls_to_wrap (the "
        "family's transformer blocks by default) is sharded on its own; remove it or set TRANSFORMER_BASED_WRAP",
        accepts=_equals("transformer_based_wrap")),
    "fsdp_cpu_ram_efficient_loading": KeyRule(
        "is not implemented: every process loads the base weights before they are sharded; remove it or set "
        "false"),
    # --- Hub publishing ---
    "push_to_hub": KeyRule(_NO_HUB_UPLOAD),
    "push_checkpoints_to_hub": KeyRule(_NO_HUB_UPLOAD),
    "hub_model_id": KeyRule(
        "names the Hub repository for push_to_hub, which this version does not do, so it has no effect; upload "
        "with `hf upload <hub_model_id> <output_dir>`", accepts=_never, refuse=False),
    "model_card_safe_for_work": KeyRule(
        "belongs to the Hub model card, which this version does not write (see push_to_hub)", accepts=_any),
    # --- training ---
    "noise_offset": KeyRule(
        "is not implemented in this version (flow-matching and epsilon objectives train with plain Gaussian "
        "noise); remove it or set 0"),
    "noise_offset_probability": KeyRule(
        "tunes noise_offset, which this version does not implement", accepts=_any),
    "use_dora": KeyRule(
        "is not built into lora_type: standard; for weight-decomposed LoRA use lora_type: lycoris with "
        "\"dora_wd\": true in lycoris_config"),
    "lr_end": KeyRule(
        "is not read: lr_scheduler polynomial decays linearly (power 1) to 1e-7 here; remove lr_end or use another "
        "lr_scheduler", accepts=_equals(1e-7)),
    "lr_num_cycles": KeyRule(
        "is not read: cosine_with_restarts makes one cycle here; remove lr_num_cycles or set it to 1",
        accepts=_equals(1)),
    "ema_cpu_only": KeyRule(
        "is spelled ema_device here: ema_device: cpu (the default) or ema_device: accelerator",
        accepts=_on),
    "ema_foreach_disable": KeyRule(f"{_NO_EFFECT}: the EMA update is one fused step", accepts=_any),
    "ema_warmup_steps": KeyRule(
        "is not read: the EMA decay ramps up from 0 over the first steps (as diffusers does), with no separate "
        "warmup; remove it"),
    "disable_bucket_pruning": KeyRule(
        f"{_NO_EFFECT}: no bucket is pruned here; a bucket with fewer images than the batch size trains with the "
        "images it has", accepts=_any),
    "delete_unwanted_images": KeyRule(
        "is refused: this version never deletes files from a dataset; images below minimum_image_size are skipped "
        "and counted in the dataset summary instead"),
    "disable_assistant_lora": KeyRule(
        "is not read: no assistant LoRA is loaded in this version (see assistant_lora_path)", accepts=_any),
    "assistant_lora_path": KeyRule(
        "is not implemented in this version (FLUX.1 schnell's training adapter); train schnell without it or use "
        "model_flavour dev"),
    "data_backend_sampling": KeyRule(
        "only 'uniform' is implemented (every dataset's images in proportion to their count and repeats); remove "
        "it or set 'uniform'", accepts=_equals("uniform")),
    # --- validation ---
    "validation_torch_compile": KeyRule(
        "is not a separate switch here; set compile: true, which compiles the transformer's blocks for training "
        "and validation alike"),
    "validation_guidance_rescale": KeyRule(
        "is not supported by the validation pipelines here; set validation_guidance (and validation_guidance_real "
        "for true classifier-free guidance) instead"),
    "validation_noise_scheduler": KeyRule(
        "is not read: validation uses the model's own scheduler (scheduler/scheduler_config.json); remove it"),
    "validation_lycoris_strength": KeyRule(
        "is not implemented: validation applies the LyCORIS network at strength 1.0; remove it or set 1.0",
        accepts=_equals(1)),
    "disable_benchmark": KeyRule(
        "base-model comparison images are not made by this version; for images of the untrained model set "
        "validation_on_startup: true", accepts=_on, refuse=False),
    # --- data defaults ---
    "minimum_image_size": KeyRule(
        "is set per dataset here: put minimum_image_size on the datasets in multidatabackend.json"),
    "aspect_bucket_rounding": KeyRule(
        "has no effect here: an image's bucket is its exact target size (a multiple of the family's pixel "
        "multiple), so there is nothing to round", accepts=_never, refuse=False),
}


def _discovery(value: Any) -> bool:
    return _off(value) or (isinstance(value, str) and value.strip().lower() == "discovery")


_DATASET_SCHEDULE = ("is not implemented: every dataset trains from the first step to the last; remove it (or split "
                     "the run in two jobs with different multidatabackend.json files)")

DATASET_KEYS: Mapping[str, KeyRule] = {
    "metadata_backend": KeyRule(
        "only 'discovery' (image sizes read from the files, the default) is supported; remove metadata_backend or "
        "set it to 'discovery'", accepts=_discovery),
    "skip_file_discovery": KeyRule(
        "has no effect here: folders are always scanned, and a warm cache is found by each file's fingerprint, so "
        "nothing is encoded twice", refuse=False),
    "preserve_data_backend_cache": KeyRule(
        f"{_NO_EFFECT}: caches are kept and reused by fingerprint, and rebuilt only for files that changed",
        accepts=_any),
    "hash_filenames": KeyRule(f"{_NO_EFFECT}: cache files are named by content fingerprints", accepts=_any),
    "vae_cache_clear_each_epoch": KeyRule(
        "is not implemented: each file's latents are encoded once and reused every epoch; remove it"),
    "prepend_instance_prompt": KeyRule(
        "is not implemented: put the trigger word in the captions, or use caption_strategy: instanceprompt"),
    "only_instance_prompt": KeyRule(
        "is spelled caption_strategy: instanceprompt here (with instance_prompt)"),
    "conditioning": KeyRule(
        "(generated conditioning: canny, depth, ...) is not implemented; make the conditioning images yourself and "
        "add them as a dataset_type: conditioning backend named by conditioning_data on this dataset"),
    "source_dataset_id": KeyRule(
        "is not read: pair a conditioning dataset the other way round, with conditioning_data on the image "
        "dataset naming it"),
    "aspect_bucket_alignment": KeyRule(
        f"{_NO_EFFECT}: buckets are aligned to the family's pixel multiple", accepts=_any),
    "aspect_bucket_rounding": KeyRule(
        f"{_NO_EFFECT}: an image's bucket is its exact target size", accepts=_any),
    "maximum_aspect_ratio": KeyRule(
        "is not implemented: images of every aspect ratio train; remove it or move those images out of the folder"),
    "minimum_aspect_ratio": KeyRule(
        "is not implemented: images of every aspect ratio train; remove it or move those images out of the folder"),
    "text_embeds": KeyRule(
        "is not read: every dataset uses the one dataset_type: text_embeds backend", accepts=_any),
    "image_embeds": KeyRule(
        "is not read: latents are cached in each dataset's cache_dir_vae", accepts=_any),
    "start_epoch": KeyRule(_DATASET_SCHEDULE),
    "start_step": KeyRule(_DATASET_SCHEDULE),
    "end_epoch": KeyRule(_DATASET_SCHEDULE),
    "end_step": KeyRule(_DATASET_SCHEDULE),
}


def apply_rules(values: dict[str, Any], rules: Mapping[str, KeyRule], prefix: str = "") -> tuple[
        dict[str, Any], list[FieldError], list[str]]:
    """Remove the ruled keys from ``values``: (the rest, errors for refused values, warnings)."""
    rest, errors, warnings = {}, [], []
    for key, value in values.items():
        rule = rules.get(key)
        if rule is None:
            rest[key] = value
        elif rule.accepts(value):
            continue
        elif rule.refuse:
            errors.append(FieldError(f"{prefix}{key}", f"{value!r}: {rule.message}"))
        else:
            warnings.append(f"{prefix}{key}: {rule.message}")
    return rest, errors, warnings
