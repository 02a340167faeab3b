"""TREAD token routing for DiT training (Krause et al. 2025, "TREAD: Token Routing for Efficient Architecture-agnostic
Diffusion Training", arXiv 2501.04765).

A route covers a window of transformer blocks. At the route's first block a subset of the image tokens is selected;
only those go through the route's blocks, the rest skip them unchanged, and after the route's last block the
processed tokens are scattered back into the full sequence. Every token keeps a gradient path (kept tokens through
the blocks, routed-around tokens through the skip), text tokens are never dropped, and the attention cost inside
the route falls with the square of the kept fraction.

`selection_ratio` is the fraction of image tokens routed AROUND the blocks: 0.5 keeps round(0.5 * N) tokens.

Usage (the transformer's own forward is untouched; everything happens in removable forward hooks):

    layout = TreadLayout(blocks=list(t.transformer_blocks) + list(t.single_transformer_blocks))
    handle = apply_tread(t, [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}], layout)
    ...                      # training forwards are routed; eval / no_grad forwards run the full sequence
    with handle.force_keep(mask):   # bool per image token; these tokens are always kept
        loss = ...
    handle.remove()

Routing is active when the handle is enabled and the block is in training mode with grad enabled (or
`handle.route_in_eval` is set). The selection is drawn once per forward and stored on the route's input tensor, so
gradient checkpointing's recompute (which re-runs the block hooks with the same input tensors) reuses it.

Blocks that take text and image as one sequence (the layout's ``JointSequence``: AuraFlow's and Chroma's
single-stream blocks) keep the text part whole and route the image part. A route crossing from separate-stream blocks
into them is run as two parts sharing one selection: the image tokens are merged back before the model concatenates
the streams and gathered again after, which equals carrying the subset across.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from simpletuner.models.tread_layout import JointSequence, TreadLayout, slice_concat_rotary

__all__ = [
    "JointSequence",  # re-exported from simpletuner.models.tread_layout
    "TREADRouter",
    "TreadHandle",
    "TreadLayout",
    "TreadRoute",
    "apply_tread",
    "resolve_routes",
    "slice_concat_rotary",  # re-exported from simpletuner.models.tread_layout
]

FIELD = "tread_config.routes"


@dataclass(frozen=True)
class TreadRoute:
    """One resolved route: blocks start_layer_idx..end_layer_idx (inclusive, non-negative) see a token subset."""

    selection_ratio: float
    start_layer_idx: int
    end_layer_idx: int


_ROUTE_FIELDS = ("selection_ratio", "start_layer_idx", "end_layer_idx")


def _route_value(route: Any, i: int, name: str) -> Any:
    if isinstance(route, tuple) and not hasattr(route, name):  # (selection_ratio, start, end)
        if len(route) != 3:
            raise ValueError(f"{FIELD}[{i}]: expected (selection_ratio, start_layer_idx, end_layer_idx)")
        return route[_ROUTE_FIELDS.index(name)]
    if isinstance(route, Mapping):
        if name not in route:
            raise ValueError(f"{FIELD}[{i}].{name}: missing")
        return route[name]
    if not hasattr(route, name):
        raise ValueError(f"{FIELD}[{i}].{name}: missing")
    return getattr(route, name)


def resolve_routes(routes: Sequence[Any] | None, num_layers: int) -> list[TreadRoute]:
    """Validate routes (dicts, objects with selection_ratio/start_layer_idx/end_layer_idx attributes such as the
    config's TreadRoute, or (selection_ratio, start, end) tuples) against a model with `num_layers` blocks; resolve negative indices (-1 = last block). Raises ValueError naming the field."""
    if not routes:
        raise ValueError(f"{FIELD}: TREAD training requires you to configure the routes")
    if num_layers < 1:
        raise ValueError(f"{FIELD}: the model has no blocks to route")
    resolved: list[TreadRoute] = []
    for i, route in enumerate(routes):
        ratio = _route_value(route, i, "selection_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"{FIELD}[{i}].selection_ratio: {ratio!r} must be a number in [0, 1)")
        indices = []
        for name in ("start_layer_idx", "end_layer_idx"):
            raw = _route_value(route, i, name)
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise ValueError(f"{FIELD}[{i}].{name}: {raw!r} must be an integer layer index")
            idx = raw + num_layers if raw < 0 else raw
            if idx >= num_layers:
                raise ValueError(f"{FIELD}[{i}].{name}: {raw} is past the last layer ({num_layers - 1})")
            if idx < 0:
                raise ValueError(f"{FIELD}[{i}].{name}: {raw} is before the first layer (the model has {num_layers})")
            indices.append(idx)
        start, end = indices
        if end < start:
            raise ValueError(
                f"{FIELD}[{i}].end_layer_idx: {_route_value(route, i, 'end_layer_idx')} resolves to layer {end}, "
                f"before start_layer_idx (layer {start})"
            )
        resolved.append(TreadRoute(float(ratio), start, end))
    order = sorted(range(len(resolved)), key=lambda j: resolved[j].start_layer_idx)
    for a, b in itertools.pairwise(order):
        if resolved[b].start_layer_idx <= resolved[a].end_layer_idx:
            raise ValueError(
                f"{FIELD}[{b}].start_layer_idx: layers {resolved[b].start_layer_idx}..{resolved[b].end_layer_idx} "
                f"overlap routes[{a}] (layers {resolved[a].start_layer_idx}..{resolved[a].end_layer_idx})"
            )
    return resolved


class TREADRouter:
    """Chooses which image tokens a route keeps, and moves tokens in and out of the kept subset.

    Score per token = importance_weight * (rank of its L1 norm, scaled to [0, 1])
                      + (1 - importance_weight) * uniform noise;
    the highest-scoring tokens are kept. importance_weight=0 is purely random routing (the paper's default),
    1 keeps the largest-norm tokens deterministically.
    """

    def __init__(self, *, importance_weight: float = 0.5, generator: torch.Generator | None = None):
        if not 0 <= importance_weight <= 1:
            raise ValueError(f"importance_weight: {importance_weight} must be in [0, 1]")
        self.importance_weight = importance_weight
        self.generator = generator

    @staticmethod
    def kept_count(num_tokens: int, selection_ratio: float, num_forced: int = 0) -> int:
        """Tokens a route keeps: the forced ones plus round((1 - selection_ratio) * the rest), at least one."""
        free = num_tokens - num_forced
        kept = num_forced + math.floor((1.0 - selection_ratio) * free + 0.5)
        return max(1, min(num_tokens, kept))

    def select(
        self,
        tokens: torch.Tensor,
        selection_ratio: float,
        *,
        force_keep: torch.Tensor | None = None,
        shared: bool = True,
    ) -> torch.Tensor:
        """Indices (batch, kept) of the image tokens to keep, ascending. `tokens` is (batch, N, dim).

        `force_keep` (bool, (N,) or (batch, N)) marks tokens that are always kept. With `shared` one subset serves
        the whole batch (needed where positions/RoPE have no batch dimension, as in Flux); a forced token in any
        sample is then kept for all of them.
        """
        batch, num, _ = tokens.shape
        with torch.no_grad():
            norms = tokens.detach().float().abs().sum(-1)  # (B, N)
            if shared:
                norms = norms.mean(0, keepdim=True)
            ranks = norms.argsort(-1).argsort(-1).float() / max(num - 1, 1)
            gen = self.generator
            noise_device = gen.device if gen is not None else tokens.device
            noise = torch.rand(ranks.shape, generator=gen, device=noise_device).to(tokens.device)
            score = self.importance_weight * ranks + (1.0 - self.importance_weight) * noise
            num_forced = 0
            if force_keep is not None:
                mask = _check_mask(force_keep, batch, num).to(tokens.device)
                if shared:
                    mask = mask.any(0, keepdim=True)
                score = score.masked_fill(mask, 2.0)  # above every unforced score (those are <= 1)
                num_forced = int(mask.sum(-1).max())
            kept = self.kept_count(num, selection_ratio, num_forced)
            idx = score.topk(kept, dim=-1).indices.sort(-1).values
            return idx.expand(batch, kept) if shared else idx

    @staticmethod
    def gather(tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """tokens (B, N, D), idx (B, K) -> (B, K, D)."""
        return tokens.gather(1, idx.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))

    @staticmethod
    def scatter(full: torch.Tensor, routed: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Out-of-place: `full` with rows idx replaced by `routed`; gradients reach both."""
        return full.scatter(1, idx.unsqueeze(-1).expand(-1, -1, full.shape[-1]), routed.to(full.dtype))


def _check_mask(mask: torch.Tensor, batch: int, num: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("force_keep: expected a bool tensor with one entry per image token")
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.dim() != 2 or mask.shape[-1] != num or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"force_keep: mask shape {tuple(mask.shape)} does not match the image tokens ({batch}, {num})"
        )
    return mask


def _get(args: tuple, kwargs: dict, name: str | None, pos: int | None) -> Any:
    if name is not None and name in kwargs:
        return kwargs[name]
    if pos is not None and pos < len(args):
        return args[pos]
    return None


def _put(args: tuple, kwargs: dict, name: str | None, pos: int | None, value: Any) -> tuple[tuple, dict]:
    if name is not None and name in kwargs:
        kwargs = dict(kwargs)
        kwargs[name] = value
    elif pos is not None and pos < len(args):
        args = args[:pos] + (value,) + args[pos + 1:]
    elif name is not None:
        kwargs = dict(kwargs)
        kwargs[name] = value
    return args, kwargs


@dataclass
class _Selection:
    idx: torch.Tensor  # (B, K) kept image tokens
    text_len: int  # text tokens before the image tokens (in a joint sequence; rotary/mask positions)


@dataclass
class _SegmentStart:
    """Stored on a segment's input tensor, so a checkpoint recompute re-enters with the same routing."""

    selection: _Selection
    rotary: Any  # sliced to text + kept image positions
    mask: Any


@dataclass
class _RouteContext:
    start: _SegmentStart
    full: torch.Tensor  # tokens as they entered the segment; routed-around tokens leave it unchanged
    joint: bool  # a joint (text + image) sequence rather than image tokens alone


_handle_ids = itertools.count()


@dataclass(eq=False)
class TreadHandle:
    """Returned by apply_tread. `enabled=False` turns routing off; `remove()` detaches every hook."""

    module: nn.Module = field(repr=False)
    routes: list[TreadRoute]
    layout: TreadLayout = field(repr=False)
    router: TREADRouter
    enabled: bool = True
    route_in_eval: bool = False
    hooks: dict[str, Any] = field(default_factory=dict)
    last_selection: dict[int, torch.Tensor] = field(default_factory=dict)
    _force_keep: torch.Tensor | None = None
    _token: int = field(default_factory=lambda: next(_handle_ids))
    # per forward: a route's selection while it crosses into the joint blocks; the image tokens ending the sequence
    _open: dict[int, _Selection] = field(default_factory=dict)
    _image_tokens: int | None = None

    @property
    def _sel_attr(self) -> str:
        return f"_tread_selection_{self._token}"

    @property
    def _ctx_attr(self) -> str:
        return f"_tread_context_{self._token}"

    def set_force_keep(self, mask: torch.Tensor | None) -> None:
        """Image tokens to keep in every route from the next forward on ((N,) or (B, N) bool); None clears."""
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            raise ValueError("force_keep: expected a bool tensor with one entry per image token")
        self._force_keep = mask

    @contextlib.contextmanager
    def force_keep(self, mask: torch.Tensor | None) -> Iterator[None]:
        previous = self._force_keep
        self.set_force_keep(mask)
        try:
            yield
        finally:
            self._force_keep = previous

    def remove(self) -> None:
        for hook in self.hooks.values():
            hook.remove()
        self.hooks.clear()
        if getattr(self.module, "_tread_handle", None) is self:
            del self.module._tread_handle

    def _routing(self, block: nn.Module) -> bool:
        return self.enabled and (self.route_in_eval or (block.training and torch.is_grad_enabled()))


def _segments(route: TreadRoute, layout: TreadLayout) -> list[tuple[int, int]]:
    """A route's blocks, split where the joint-sequence blocks begin (the two parts share one selection)."""
    start, end = route.start_layer_idx, route.end_layer_idx
    if layout.joint is not None and start < layout.joint.start <= end:
        return [(start, layout.joint.start - 1), (layout.joint.start, end)]
    return [(start, end)]


def apply_tread(
    module: nn.Module,
    routes: Sequence[Any],
    layout: TreadLayout,
    *,
    generator: torch.Generator | None = None,
    importance_weight: float = 0.5,
) -> TreadHandle:
    """Attach TREAD routing hooks to `layout.blocks` of `module` for `routes` (see resolve_routes). Everything is
    validated before any hook is attached. Returns a TreadHandle (remove() restores the unrouted model)."""
    if getattr(module, "_tread_handle", None) is not None:
        raise ValueError("tread_config: TREAD is already applied to this model; remove() the first handle")
    blocks = list(layout.blocks)
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise ValueError("TreadLayout.blocks: expected a non-empty list of nn.Module blocks")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("TreadLayout.blocks: a block is listed twice")
    owned = {id(m) for m in module.modules()}
    if not all(id(b) in owned for b in blocks):
        raise ValueError("TreadLayout.blocks: every block must be a submodule of the model")
    if layout.joint is not None and not 0 <= layout.joint.start <= len(blocks):
        raise ValueError(f"TreadLayout.joint.start: {layout.joint.start} is outside the {len(blocks)} blocks")
    resolved = resolve_routes(routes, len(blocks))
    handle = TreadHandle(module, resolved, layout, TREADRouter(importance_weight=importance_weight,
                                                              generator=generator))

    for r, route in enumerate(resolved):
        for seg, (start, end) in enumerate(_segments(route, layout)):
            for i in range(start, end + 1):
                args = layout.block_args(i)
                pre = _make_pre_hook(handle, r, seg, args, first=i == start)
                post = _make_post_hook(handle, args, last=i == end)
                handle.hooks[f"tread.route{r}.block{i}.pre"] = blocks[i].register_forward_pre_hook(pre,
                                                                                                  with_kwargs=True)
                handle.hooks[f"tread.route{r}.block{i}.post"] = blocks[i].register_forward_hook(post,
                                                                                               with_kwargs=True)
    if layout.joint is not None:
        count = layout.joint.image_tokens

        def record_image_tokens(model, args, kwargs):
            handle._image_tokens = int(count(model, args, kwargs))

        handle.hooks["tread.image_tokens"] = module.register_forward_pre_hook(record_image_tokens, with_kwargs=True)
    module._tread_handle = handle
    return handle


def _select(handle: TreadHandle, r: int, seg: int, block: nn.Module, tokens: torch.Tensor, args: tuple,
            kwargs: dict, spec) -> _Selection | None:
    """This forward's selection for route ``r`` at the start of its segment ``seg`` (None: not routing now)."""
    if seg > 0:  # the route crossed into the joint blocks: same tokens as its first part
        return handle._open.pop(r, None)
    if not handle._routing(block):
        handle._open.pop(r, None)
        return None
    if spec.joint:
        text_len = tokens.shape[1] - handle._image_tokens
        image = tokens[:, text_len:]
    else:
        text = _get(args, kwargs, spec.text_arg, spec.text_pos)
        text_len = text.shape[1] if text is not None else 0
        image = tokens
    idx = handle.router.select(image, handle.routes[r].selection_ratio, force_keep=handle._force_keep,
                               shared=handle.layout.shared_selection)
    handle.last_selection[r] = idx
    selection = _Selection(idx, text_len)
    if len(_segments(handle.routes[r], handle.layout)) > 1:
        handle._open[r] = selection
    return selection


def _make_pre_hook(handle: TreadHandle, r: int, seg: int, spec, *, first: bool):
    layout = handle.layout

    def pre_hook(block: nn.Module, args: tuple, kwargs: dict):
        tokens = _get(args, kwargs, spec.image_arg, spec.image_pos)
        if tokens is None:
            return None
        if first:
            # Drawn once per forward: a checkpoint recompute re-enters with this same tensor and finds the selection.
            # A tensor that went through a routed forward may come back in one that must not route (eval, no_grad,
            # routing disabled): its stored selection is then not used.
            start = getattr(tokens, handle._sel_attr, None)
            if start is None or not handle._routing(block):
                selection = _select(handle, r, seg, block, tokens, args, kwargs, spec)
                if selection is None:
                    return None
                rotary = _get(args, kwargs, spec.rotary_arg, spec.rotary_pos)
                if spec.rotary_arg is not None and rotary is not None:
                    rotary = layout.slice_rotary(rotary, selection.idx, selection.text_len)
                mask = _get(args, kwargs, spec.mask_arg, spec.mask_pos)
                if spec.mask_arg is not None and mask is not None:
                    mask = layout.slice_mask(mask, selection.idx, selection.text_len)
                start = _SegmentStart(selection, rotary, mask)
                setattr(tokens, handle._sel_attr, start)
            routed = _gather(tokens, start.selection, spec.joint)
            setattr(routed, handle._ctx_attr, _RouteContext(start, tokens, spec.joint))
        else:
            context = getattr(tokens, handle._ctx_attr, None)
            if context is None:
                return None
            start, routed = context.start, tokens
        args, kwargs = _put(args, kwargs, spec.image_arg, spec.image_pos, routed)
        if spec.rotary_arg is not None and start.rotary is not None:
            args, kwargs = _put(args, kwargs, spec.rotary_arg, spec.rotary_pos, start.rotary)
        if spec.mask_arg is not None and start.mask is not None:
            args, kwargs = _put(args, kwargs, spec.mask_arg, spec.mask_pos, start.mask)
        return args, kwargs

    return pre_hook


def _gather(tokens: torch.Tensor, selection: _Selection, joint: bool) -> torch.Tensor:
    if not joint:
        return TREADRouter.gather(tokens, selection.idx)
    t = selection.text_len
    return torch.cat([tokens[:, :t], TREADRouter.gather(tokens[:, t:], selection.idx)], dim=1)


def _make_post_hook(handle: TreadHandle, spec, *, last: bool):
    def post_hook(block: nn.Module, args: tuple, kwargs: dict, output: Any):
        tokens_in = _get(args, kwargs, spec.image_arg, spec.image_pos)
        context = getattr(tokens_in, handle._ctx_attr, None) if tokens_in is not None else None
        if context is None:
            return None
        tokens_out = output if spec.image_output is None else output[spec.image_output]
        if not last:
            setattr(tokens_out, handle._ctx_attr, context)
            return None
        idx = context.start.selection.idx
        if context.joint:  # text tokens come out of the blocks; image tokens merge as in a separate stream
            t = context.start.selection.text_len
            merged = torch.cat([tokens_out[:, :t], TREADRouter.scatter(context.full[:, t:], tokens_out[:, t:], idx)],
                               dim=1)
        else:
            merged = TREADRouter.scatter(context.full, tokens_out, idx)
        if spec.image_output is None:
            return merged
        out = list(output)
        out[spec.image_output] = merged
        return type(output)(out) if isinstance(output, tuple) else out

    return post_hook
