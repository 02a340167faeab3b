"""Speed and memory knobs on a diffusers transformer: `attention_mechanism`, `--compile` (torch.compile of each
block) and `gradient_checkpointing_interval`.

Order in the trainer: load -> quantize -> LoRA -> attention mechanism -> gradient checkpointing (interval)
-> group offload -> TREAD -> compile blocks.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# attention_mechanism -> (diffusers attention backend or None for the default SDPA, package it needs, trains?)
ATTENTION_MECHANISMS: dict[str, tuple[str | None, str | None, bool]] = {
    "diffusers": (None, None, True),
    "sdpa": (None, None, True),
    "xformers": ("xformers", "xformers", True),
    "flash-attn": ("flash", "flash_attn", True),
    "sageattention": ("sage", "sageattention", False),  # SageAttention kernels have no backward pass
}


def set_attention_mechanism(transformer: "torch.nn.Module", mechanism: str, *, training: bool = True) -> str | None:
    """Select the attention implementation of a diffusers model; return the diffusers backend name (None = SDPA).

    "diffusers"/"sdpa" keep torch's scaled_dot_product_attention (the default). Others need their package
    installed; backends fetched from a model hub at run time are not offered (training runs offline).
    """
    if mechanism not in ATTENTION_MECHANISMS:
        raise ValueError(f"attention_mechanism: {mechanism!r} is not one of {', '.join(ATTENTION_MECHANISMS)}")
    backend, package, trains = ATTENTION_MECHANISMS[mechanism]
    if backend is None:
        return None
    if training and not trains:
        raise ValueError(f"attention_mechanism: {mechanism} has no backward pass; use it for inference only")
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"attention_mechanism: {mechanism} needs the {package} package, which is not installed; "
                         "use sdpa")
    if not hasattr(transformer, "set_attention_backend"):
        raise ValueError(f"attention_mechanism: {type(transformer).__name__} cannot switch attention backends")
    try:
        transformer.set_attention_backend(backend)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"attention_mechanism: {mechanism} is not usable here: {error}") from error
    return backend


def _block_lists(transformer, names: Iterable[str] | None) -> list:
    import torch

    if names is None:
        return [m for m in transformer.children() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    lists = []
    for name in names:
        found = getattr(transformer, name, None)
        if not isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise ValueError(f"{type(transformer).__name__} has no block list named {name!r}")
        lists.append(found)
    return lists


def transformer_blocks(transformer: "torch.nn.Module", block_lists: Iterable[str] | None = None) -> list:
    """The transformer's blocks in execution order (every ModuleList child, or the named ones)."""
    return [block for blocks in _block_lists(transformer, block_lists) for block in blocks]


def compile_supported(device: "torch.device | str" = "cpu", **compile_kwargs) -> str | None:
    """None when torch.compile works for `device` here, else the reason (compile a tiny function and run it)."""
    import torch

    try:
        fn = torch.compile(lambda x: x * 2 + 1, **compile_kwargs)
        fn(torch.ones(4, device=device))
    except Exception as error:  # inductor raises many types: missing compiler, unsupported device, ...
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


def compile_transformer_blocks(
    transformer: "torch.nn.Module",
    *,
    block_lists: Iterable[str] | None = None,
    device: "torch.device | str | None" = None,
    **compile_kwargs,
) -> int:
    """`--compile`: torch.compile each block's forward in place; return how many were compiled.

    Each block's `forward` is compiled, not the whole model and not the block's `__call__`, so that gradient
    checkpointing, group offload and TREAD's forward hooks keep running eagerly around the compiled graphs
    (`remove_block_compilation` undoes it). Compilation is probed first;
    when it is unsupported here the model is left as it is, a warning says why, and 0 is returned.
    `compile_kwargs` go to torch.compile (e.g. mode="max-autotune", backend="eager" in tests).
    """
    if device is None:
        first = next(iter(transformer.parameters()), None)
        device = first.device if first is not None else "cpu"
    reason = compile_supported(device, **compile_kwargs)
    if reason is not None:
        logger.warning("compile: torch.compile is not supported here (%s); training without it", reason)
        return 0
    blocks = transformer_blocks(transformer, block_lists)
    import torch

    for block in blocks:
        block.forward = torch.compile(block.forward, **compile_kwargs)
    logger.info("compile: %d transformer blocks compiled", len(blocks))
    return len(blocks)


def remove_block_compilation(transformer: "torch.nn.Module", block_lists: Iterable[str] | None = None) -> None:
    """Undo compile_transformer_blocks (drop the compiled per-instance forwards)."""
    for block in transformer_blocks(transformer, block_lists):
        if "forward" in vars(block) and hasattr(vars(block)["forward"], "_torchdynamo_orig_callable"):
            del block.forward


def apply_gradient_checkpointing_interval(
    transformer: "torch.nn.Module", interval: int, *, block_lists: Iterable[str] | None = None
) -> None:
    """Enable diffusers gradient checkpointing on `transformer`, checkpointing only every `interval`-th block
    (blocks 0, interval, 2*interval, ... in execution order); the others keep their activations. interval=1 is
    ordinary gradient checkpointing. Saves less memory than checkpointing every block, recomputes less."""
    import torch

    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"gradient_checkpointing_interval: {interval!r} must be an integer >= 1")
    position = {id(block): i for i, block in enumerate(transformer_blocks(transformer, block_lists))}

    def checkpoint_every_interval(block, *args):
        i = position.get(id(block))
        if i is None or i % interval == 0:
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_every_interval)
    transformer._gradient_checkpointing_interval = interval
