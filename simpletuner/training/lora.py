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
        load_initial_lora(transformer, config.init_lora, prefix=f"{adapter.denoiser_subfolder}.")
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


def load_initial_lora(transformer, path: str | Path, prefix: str = "transformer.") -> None:
    """``init_lora``: start from a diffusers-format LoRA file (keys prefixed with the denoiser's component name,
    ``transformer.`` or ``unet.``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"init_lora: {path} does not exist")
    state = load_file(path)
    state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    load_lora_state(transformer, state, f"init_lora {path}")
