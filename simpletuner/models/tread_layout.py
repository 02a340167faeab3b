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


def slice_concat_mask(mask: Any, idx: torch.Tensor, text_len: int) -> Any:
    """An attention mask over concat(text, image) positions, (B, S) (Chroma): keep every text column and the kept
    image columns, per sample."""
    if mask is None:
        return None
    idx = idx.to(mask.device)
    if idx.shape[0] != mask.shape[0]:
        idx = idx.expand(mask.shape[0], -1)
    return torch.cat([mask[:, :text_len], mask[:, text_len:].gather(1, idx)], dim=1)


@dataclass
class JointSequence:
    """Blocks ``TreadLayout.blocks[start:]`` take text and image tokens as one sequence, text first and image last,
    in one argument, and return that sequence (AuraFlow's and Chroma's single-stream blocks). The router keeps the
    text part whole and routes the image part. ``image_tokens(model, args, kwargs)`` reads, from the transformer's
    own forward arguments, how many image tokens end the sequence (needed by a route that starts in these blocks;
    one that starts in the blocks before reuses its selection)."""

    start: int
    image_tokens: Callable[[nn.Module, tuple, dict], int]
    sequence_arg: str = "hidden_states"
    sequence_pos: int = 0
    rotary_arg: str | None = None
    rotary_pos: int | None = None
    mask_arg: str | None = None
    mask_pos: int | None = None
    output: int | None = None  # index of the sequence in the block's output tuple; None: the output is it


@dataclass(frozen=True)
class BlockArgs:
    """Where one block takes (and returns) its tokens; see ``TreadLayout.block_args``."""

    image_arg: str | None
    image_pos: int | None
    text_arg: str | None
    text_pos: int | None
    rotary_arg: str | None
    rotary_pos: int | None
    mask_arg: str | None
    mask_pos: int | None
    image_output: int | None
    joint: bool


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
    # an attention mask over concat(text, image) positions, sliced like the rotary embedding (Chroma)
    mask_arg: str | None = None
    mask_pos: int | None = None
    slice_mask: Callable[[Any, torch.Tensor, int], Any] = slice_concat_mask
    # blocks from ``joint.start`` on carry text and image as one sequence (AuraFlow, Chroma); None: none do
    joint: JointSequence | None = None

    def is_joint(self, index: int) -> bool:
        return self.joint is not None and index >= self.joint.start

    def block_args(self, index: int) -> BlockArgs:
        """Where block ``index`` takes its tokens: the fields above, or ``joint``'s from ``joint.start`` on."""
        if self.is_joint(index):
            j = self.joint
            return BlockArgs(j.sequence_arg, j.sequence_pos, None, None, j.rotary_arg, j.rotary_pos, j.mask_arg,
                             j.mask_pos, j.output, True)
        return BlockArgs(self.image_arg, self.image_pos, self.text_arg, self.text_pos, self.rotary_arg,
                         self.rotary_pos, self.mask_arg, self.mask_pos, self.image_output, False)


