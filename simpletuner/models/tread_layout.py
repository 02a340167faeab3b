"""How a family's transformer blocks carry tokens, for the TREAD router (``simpletuner.training.tread``).

A family's adapter returns a ``TreadLayout`` from ``tread_layout(transformer)``: which blocks a route may index,
where the image tokens, the text tokens and the rotary embedding sit in each block's arguments, and how to slice
the rotary embedding to the kept tokens. The router itself (hooks, token selection) is a training-loop part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


def slice_concat_rotary(rotary: Any, idx: torch.Tensor, text_len: int) -> Any:
    """Rotary embedding laid out over concat(text, image) positions (Flux: a (cos, sin) tuple of (S, D) tensors, no
    batch dim): keep every text position and the kept image positions. Needs a batch-shared selection."""
    if rotary is None:
        return None
    kept = idx[0]
    if idx.shape[0] > 1 and idx.stride(0) != 0 and not bool((idx == kept).all()):  # stride 0: shared (expanded)
        raise ValueError("slice_concat_rotary: RoPE without a batch dimension needs shared_selection=True")
    tensors = rotary if isinstance(rotary, (tuple, list)) else (rotary,)
    rows = torch.cat([torch.arange(text_len, device=kept.device), kept + text_len]).to(tensors[0].device)
    sliced = tuple(t.index_select(0, rows) for t in tensors)
    return type(rotary)(sliced) if isinstance(rotary, (tuple, list)) else sliced[0]


@dataclass
class TreadLayout:
    """How a model family's blocks carry tokens. Defaults describe diffusers' Flux blocks (double and single):
    `block(hidden_states=img, encoder_hidden_states=txt, temb, image_rotary_emb, joint_attention_kwargs)` ->
    `(encoder_hidden_states, hidden_states)`; with gradient checkpointing the same arguments arrive positionally."""

    blocks: list[nn.Module]
    image_arg: str = "hidden_states"
    image_pos: int = 0
    text_arg: str | None = "encoder_hidden_states"  # only its length is used (for slicing positions)
    text_pos: int | None = 1
    rotary_arg: str | None = "image_rotary_emb"
    rotary_pos: int | None = 3
    image_output: int | None = 1  # index of the image tokens in the block's output tuple; None: output is them
    slice_rotary: Callable[[Any, torch.Tensor, int], Any] = slice_concat_rotary
    shared_selection: bool = True


