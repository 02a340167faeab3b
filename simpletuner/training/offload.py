"""Group offload of a model's blocks between an accelerator and CPU memory, using diffusers' own hooks
(`diffusers.hooks.apply_group_offloading`).

Weights live on `offload_device` (CPU) and each group of blocks is moved onto `onload_device` just before it runs
and back right after, so the accelerator holds roughly one group at a time. It saves accelerator memory at the
cost of host-to-device copies (overlapped with compute when `use_stream`); on a CPU-only machine it saves nothing.

Order in the trainer: load -> quantize -> add LoRA -> gradient checkpointing -> enable_group_offload -> TREAD.
LoRA must be added first: the hooks record each group's modules and (with streams) pin their tensors when applied.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

OFFLOAD_TYPES = ("block_level", "leaf_level")


def check_offload_options(enable_group_offload: bool, enable_model_cpu_offload: bool) -> None:
    """Raise ValueError when both offload modes are requested: they move the same weights with different hooks."""
    if enable_group_offload and enable_model_cpu_offload:
        raise ValueError(
            "enable_group_offload: cannot be combined with enable_model_cpu_offload; choose one "
            "(group offload moves blocks one group at a time, model CPU offload moves whole models)"
        )


def enable_group_offload(
    module: "torch.nn.Module",
    *,
    onload_device: "torch.device | str",
    offload_device: "torch.device | str" = "cpu",
    offload_type: str = "block_level",
    blocks_per_group: int = 1,
    use_stream: bool = False,
    to_disk_path: str | None = None,
    training: bool = True,
    non_blocking: bool | None = None,
    low_cpu_mem_usage: bool = False,
) -> "torch.nn.Module":
    """Attach diffusers group-offload hooks to `module` (in place; returns it).

    Validates first: `offload_type` is block_level or leaf_level, `blocks_per_group` >= 1 (block_level only),
    `to_disk_path` is refused when `training` (diffusers writes each group to disk once and reloads that file on
    every onload, so optimizer updates to LoRA weights would be lost). Training a quanto-quantized module needs
    gradient checkpointing on every block, enabled before this call. `use_stream` needs a CUDA onload device; on
    any other device it is turned off with a log line.
    """
    import torch
    from diffusers.hooks import apply_group_offloading

    if offload_type not in OFFLOAD_TYPES:
        raise ValueError(f"group_offload_type: {offload_type!r} is not one of {', '.join(OFFLOAD_TYPES)}")
    if isinstance(blocks_per_group, bool) or not isinstance(blocks_per_group, int) or blocks_per_group < 1:
        raise ValueError(f"group_offload_blocks_per_group: {blocks_per_group!r} must be an integer >= 1")
    if to_disk_path is not None and training:
        raise ValueError(
            "group_offload_to_disk_path: not supported for training; diffusers' disk offload saves each group's "
            "weights once and reloads that file on every onload, so trained LoRA weights would be lost. "
            "Unset it (group offload to CPU memory works for training)"
        )
    if training and _has_quanto_modules(module) and not _every_block_checkpointed(module):
        raise ValueError(
            "enable_group_offload: training a quanto-quantized base (base_model_precision) under group offload needs "
            "gradient_checkpointing on every block (interval 1): without it autograd still holds the quantized "
            "weights when the hooks move them and the step fails. Enable gradient_checkpointing before group offload"
        )
    onload = torch.device(onload_device)
    offload = torch.device(offload_device)
    if use_stream and onload.type != "cuda":
        logger.warning("group_offload_use_stream: CUDA streams need a CUDA device; disabled on %s", onload.type)
        use_stream = False
    if use_stream and offload_type == "block_level" and blocks_per_group != 1:
        logger.warning("group_offload_blocks_per_group: streams prefetch one block at a time; using 1 instead of %d",
                       blocks_per_group)
        blocks_per_group = 1

    apply_group_offloading(
        module,
        onload_device=onload,
        offload_device=offload,
        offload_type=offload_type,
        num_blocks_per_group=blocks_per_group if offload_type == "block_level" else None,
        non_blocking=use_stream if non_blocking is None else non_blocking,
        use_stream=use_stream,
        low_cpu_mem_usage=low_cpu_mem_usage,
        offload_to_disk_path=to_disk_path,
    )
    logger.info("group offload: %s, %s -> %s%s", offload_type, offload, onload, " with streams" if use_stream else "")
    return module


def _has_quanto_modules(module) -> bool:
    return any(type(m).__module__.startswith("optimum.quanto") for m in module.modules())


def _every_block_checkpointed(module) -> bool:
    return bool(getattr(module, "is_gradient_checkpointing", False)) and (
        getattr(module, "_gradient_checkpointing_interval", 1) == 1
    )


def group_offload_enabled(module: "torch.nn.Module") -> bool:
    """Whether diffusers group-offload hooks are attached to `module` or any submodule."""
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return _is_group_offload_enabled(module)
