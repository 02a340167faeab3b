"""PEFT LoRA on the transformer: attach, export in diffusers format, and start from an existing LoRA."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

ADAPTER_NAME = "default"


def add_lora(transformer, adapter, config) -> LoraConfig:
    """Freeze the transformer and attach a trainable LoRA on the modules of the family's ``lora_target`` preset."""
    transformer.requires_grad_(False)
    preset = config.lora_target  # the config layer fills the family's default and checks it against the family
    init = {"default": True, "gaussian": "gaussian", "loftq": "loftq", "olora": "olora", "pissa": "pissa"}[
        config.lora_init_type or "default"
    ]
    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha if config.lora_alpha is not None else config.lora_rank,
        lora_dropout=config.lora_dropout,
        init_lora_weights=init,
        target_modules=adapter.lora_target_modules(transformer, preset),
    )
    transformer.add_adapter(lora_config, adapter_name=ADAPTER_NAME)
    if config.init_lora:
        load_initial_lora(transformer, config.init_lora)
    return lora_config


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The LoRA weights with PEFT's key names (``...lora_A.weight``), detached copies on the CPU."""
    state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def load_lora_state(transformer, state: dict[str, torch.Tensor], source: str) -> None:
    """Load LoRA weights saved by ``lora_state_dict``; any mismatch is an error naming the file."""
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{source}: {len(unexpected)} LoRA keys do not match this model, e.g. {unexpected[:3]}")
    lora_params = {n for n, _ in transformer.named_parameters() if "lora_" in n}
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if k in lora_params]
    if missing:
        raise ValueError(f"{source}: missing LoRA weights for {len(missing)} modules, e.g. {missing[:3]}")


# key prefixes of the LoRA files families write: diffusers' (``transformer.``, ``unet.``), a PEFT adapter's (PixArt)
_LORA_KEY_PREFIXES = ("transformer.", "unet.", "base_model.model.")


def load_initial_lora(transformer, path: str | Path) -> None:
    """``init_lora``: start from a LoRA file a family's ``save_lora`` writes (diffusers' ``transformer.``-prefixed
    keys, or a PEFT adapter's ``adapter_model.safetensors``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"init_lora: {path} does not exist")
    try:
        loaded = load_file(path)  # safetensors only: a LoRA file is never unpickled
    except Exception as exc:  # safetensors' own error type for a pickle, a truncated file, a bad header
        raise ValueError(f"init_lora: {path} is not a readable .safetensors file ({exc})") from None
    state = {}
    for key, value in loaded.items():
        prefix = next((p for p in _LORA_KEY_PREFIXES if key.startswith(p)), "")
        state[key[len(prefix):]] = value
    load_lora_state(transformer, state, f"init_lora {path}")
