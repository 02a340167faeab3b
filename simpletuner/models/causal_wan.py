"""A causal Wan for Self-Forcing: diffusers' ``WanTransformer3DModel`` weights run autoregressively over frame blocks.

The video's latent frames are cut into blocks of ``num_frame_per_block`` (with ``independent_first_frame`` the first
block is one frame). A block's tokens attend to their own block and the blocks before it (block-causal attention),
or only to the last ``local_attn_size`` frames (itself included) when that is set. Every token gets its frame's
timestep (blocks may sit at different noise levels), and the 3-D RoPE of its absolute frame, so a block generated
on its own at frame offset ``s`` sees exactly the positions it has inside the whole video.

Two ways to run it, equal on the same inputs (tested to < 1e-5 in fp32):
- ``causal_forward(model, latents, t)``: the whole sequence at once under the block-causal mask (training: ODE
  regression on per-block timesteps);
- ``causal_forward(model, block, t, frame_offset=s, cache=cache)``: one block, attending to the keys and values of
  the frames committed to ``cache`` (``commit=True`` stores this block's), with the text's cross-attention keys and
  values computed once per cache (streaming generation and Self-Forcing's rollout).

The block is written out here (modulation, self-attention, cross-attention, feed-forward, as in diffusers'
``WanTransformerBlock``) because diffusers' block takes neither a mask nor a cache; a test holds it equal to diffusers'
own forward. T2V models only (no image cross-attention).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class CausalLayout:
    """How a video's latent frames split into blocks, and how far back a block sees."""

    num_frame_per_block: int
    local_attn_size: int = -1  # frames a block sees, itself included; -1 = every earlier frame
    independent_first_frame: bool = False

    def blocks(self, num_frames: int) -> list[tuple[int, int]]:
        """[start, end) frame ranges of the blocks of a ``num_frames``-frame latent."""
        first = 1 if self.independent_first_frame else 0
        rest = num_frames - first
        if rest < 0 or rest % self.num_frame_per_block:
            extra = " after the first frame" if first else ""
            raise ValueError(f"{num_frames} latent frames{extra} do not split into blocks of "
                             f"{self.num_frame_per_block}")
        edges = ([0] if first else []) + list(range(first, num_frames + 1, self.num_frame_per_block))
        return list(zip(edges[:-1], edges[1:]))

    def visible_from(self, end: int) -> int:
        """The first frame a block ending at frame ``end`` sees."""
        return 0 if self.local_attn_size < 0 else max(0, end - self.local_attn_size)

    def frame_mask(self, num_frames: int) -> torch.Tensor:
        """(F, F) bool: query frame i may attend to key frame j."""
        block_end = torch.zeros(num_frames, dtype=torch.long)
        for start, end in self.blocks(num_frames):
            block_end[start:end] = end
        key = torch.arange(num_frames)
        visible = torch.tensor([self.visible_from(int(e)) for e in block_end])
        return (key[None, :] < block_end[:, None]) & (key[None, :] >= visible[:, None])


@dataclass
class KVCache:
    """Per layer, the self-attention keys and values (after RoPE) of the committed frames, from ``first_frame`` on,
    and the cross-attention keys and values of the text (computed once)."""

    layout: CausalLayout
    tokens_per_frame: int = 0
    first_frame: int = 0
    frames: int = 0  # committed frames (absolute end)
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    cross: dict = field(default_factory=dict)

    def visible(self, layer: int, end: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Keys and values of the committed frames a block ending at frame ``end`` sees."""
        if not self.keys:
            return None, None
        start = max(self.layout.visible_from(end), self.first_frame)
        if start >= self.frames:
            return None, None
        skip = (start - self.first_frame) * self.tokens_per_frame
        return self.keys[layer][:, skip:], self.values[layer][:, skip:]

    def commit(self, new_keys: list[torch.Tensor], new_values: list[torch.Tensor], frames: int) -> None:
        """Append a block's keys and values (``frames`` frames) and forget frames no later block can see."""
        if not self.keys:
            self.keys, self.values = [k.detach() for k in new_keys], [v.detach() for v in new_values]
        else:
            self.keys = [torch.cat([a, b.detach()], dim=1) for a, b in zip(self.keys, new_keys)]
            self.values = [torch.cat([a, b.detach()], dim=1) for a, b in zip(self.values, new_values)]
        self.frames += frames
        if self.layout.local_attn_size > 0:  # the next block ends at most num_frame_per_block frames later
            keep_from = max(self.first_frame,
                            self.layout.visible_from(self.frames + self.layout.num_frame_per_block))
            drop = (keep_from - self.first_frame) * self.tokens_per_frame
            if drop:
                self.keys = [k[:, drop:] for k in self.keys]
                self.values = [v[:, drop:] for v in self.values]
                self.first_frame = keep_from


def frame_rotary(model, frames: int, height: int, width: int, offset: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3-D RoPE (cos, sin), (1, tokens, 1, head_dim), for latent frames [offset, offset + frames)."""
    rope = model.rope
    p_t, p_h, p_w = model.config.patch_size
    ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
    if offset + ppf > rope.max_seq_len:
        raise ValueError(f"frame {offset + ppf} is past the model's RoPE table ({rope.max_seq_len} frames)")
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t, h, w = table.split(sizes, dim=1)
        parts = [t[offset:offset + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                 h[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                 w[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1)]
        out.append(torch.cat(parts, dim=-1).reshape(1, ppf * pph * ppw, 1, -1).to(device))
    return out[0], out[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (as diffusers' WanAttnProcessor applies it)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _attend(attn, query, key, value, mask=None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask)
    out = out.transpose(1, 2).flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


def _self_attention(attn, x, cos, sin, past_k, past_v, mask):
    if getattr(attn, "fused_projections", False):
        raise ValueError("the causal Wan needs unfused attention projections")
    q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys = k if past_k is None else torch.cat([past_k, k], dim=1)
    values = v if past_v is None else torch.cat([past_v, v], dim=1)
    return _attend(attn, q, keys, values, mask), k, v


def _text_kv(attn, text):
    k, v = attn.to_k(text), attn.to_v(text)
    return attn.norm_k(k).unflatten(2, (attn.heads, -1)), v.unflatten(2, (attn.heads, -1))


def _block(block, x, temb, cos, sin, text_k, text_v, past_k, past_v, mask):
    """diffusers' WanTransformerBlock.forward with per-token modulation, a mask and past keys/values; returns the
    new hidden states and this input's self-attention keys and values."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
    shift, scale, gate, c_shift, c_scale, c_gate = (t.squeeze(2) for t in (shift, scale, gate, c_shift, c_scale,
                                                                            c_gate))
    normed = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    attn_out, k, v = _self_attention(block.attn1, normed, cos, sin, past_k, past_v, mask)
    x = (x.float() + attn_out * gate).type_as(x)
    normed = block.norm2(x.float()).type_as(x)
    q = block.attn2.norm_q(block.attn2.to_q(normed)).unflatten(2, (block.attn2.heads, -1))
    x = x + _attend(block.attn2, q, text_k, text_v)
    normed = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
    x = (x.float() + block.ffn(normed).float() * c_gate).type_as(x)
    return x, k, v


def causal_forward(model, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                   layout: CausalLayout, *, frame_offset: int = 0, cache: KVCache | None = None,
                   commit: bool = False) -> torch.Tensor:
    """The causal Wan's prediction (flow velocity) for latents (B, C, F, H, W) at per-frame timesteps (B, F) in the
    model's units (sigma * 1000). Without ``cache``: the whole sequence under the block-causal mask. With it: the
    frames [frame_offset, frame_offset + F) of one block, attending to the committed frames; ``commit`` adds this
    block's keys and values to the cache."""
    model = getattr(model, "module", model)
    batch, _, frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    per_frame = (height // p_h) * (width // p_w)
    device = hidden_states.device
    cos, sin = frame_rotary(model, frames, height, width, frame_offset, device)
    x = model.patch_embedding(hidden_states.to(model.dtype)).flatten(2).transpose(1, 2).contiguous()
    if p_t != 1:
        raise ValueError(f"the causal Wan needs a temporal patch size of 1, not {p_t}")
    per_token = timestep.to(device).float().repeat_interleave(per_frame, dim=1)
    temb, proj, text, _ = model.condition_embedder(per_token.flatten(), encoder_hidden_states.to(model.dtype), None,
                                                   timestep_seq_len=per_token.shape[1])
    proj = proj.unflatten(2, (6, -1))
    mask = None
    if cache is None:
        frame_mask = layout.frame_mask(frames).to(device)
        mask = frame_mask.repeat_interleave(per_frame, 0).repeat_interleave(per_frame, 1)
    elif not cache.tokens_per_frame:
        cache.tokens_per_frame = per_frame
    new_k, new_v = [], []
    end = frame_offset + frames
    use_checkpoint = torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False)
    interval = getattr(model, "_gradient_checkpointing_interval", 1)  # gradient_checkpointing_interval
    for i, block in enumerate(model.blocks):
        if cache is not None:
            if i not in cache.cross:
                cache.cross[i] = tuple(t.detach() for t in _text_kv(block.attn2, text))
            text_k, text_v = cache.cross[i]
            past_k, past_v = cache.visible(i, end)
        else:
            text_k, text_v = _text_kv(block.attn2, text)
            past_k = past_v = None
        args = (block, x, proj, cos, sin, text_k, text_v, past_k, past_v, mask)
        if use_checkpoint and i % interval == 0:  # the cache's tensors are arguments: a recompute sees the same
            x, k, v = checkpoint(_block, *args, use_reentrant=False)
        else:
            x, k, v = _block(*args)
        new_k.append(k)
        new_v.append(v)
    if cache is not None and commit:
        cache.commit(new_k, new_v, frames)
    shift, scale = (model.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
    x = (model.norm_out(x.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(x)
    x = model.proj_out(x)
    x = x.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


# ---- sampling block by block ---------------------------------------------------------------------------------
def _x0(model, x, t, text, layout, offset, cache, commit=False):
    """x0 of a flow-matching prediction at per-frame ``t`` (B, F) on the 0..1000 scale."""
    velocity = causal_forward(model, x, t, text, layout, frame_offset=offset, cache=cache, commit=commit)
    sigma = (t.float() / 1000).to(x.device)[:, None, :, None, None]
    return x.float() - sigma * velocity.float()


@dataclass
class BlockSample:
    start: int
    end: int
    x0: torch.Tensor  # (B, C, frames, h, w)
    exit_index: int


def generate_blocks(model, noise: torch.Tensor, text: torch.Tensor, steps: list[float], layout: CausalLayout, *,
                    sampler: str = "consistency", generator: torch.Generator | None = None,
                    exit_indices: list[int] | None = None, context_noise: float = 0.0,
                    use_cache: bool = True) -> Iterator[BlockSample]:
    """The causal student's generation, block by block (Self-Forcing's rollout and its streaming inference).

    Each block starts from its slice of ``noise``, is denoised through ``steps`` (0..1000, most noisy first; x0,
    then fresh noise (``consistency``) or its own noise (``ode``) to the next step), stopping at
    ``exit_indices[b]`` (default: the last step) whose forward keeps autograd when the caller's grad mode does; the
    earlier steps run without it. Then the block's x0, noised to ``context_noise``, runs once more at that timestep
    and its keys and values become the context of the blocks after it. ``use_cache=False`` recomputes the whole
    prefix under the block-causal mask at every call instead (the reference the cache must equal)."""
    batch = noise.shape[0]
    cache = KVCache(layout) if use_cache else None
    context: list[torch.Tensor] = []  # committed clean frames (use_cache=False)
    for b, (start, end) in enumerate(layout.blocks(noise.shape[2])):
        frames = end - start
        exit_index = len(steps) - 1 if exit_indices is None else exit_indices[b]

        def denoise(x, value, commit=False):
            t = torch.full((batch, frames), float(value), dtype=torch.float64, device=noise.device)
            if use_cache:
                return _x0(model, x, t, text, layout, start, cache, commit)
            prefix = torch.cat([*context, x], dim=2) if context else x
            t_all = torch.cat([torch.full((batch, start), float(context_noise), dtype=torch.float64,
                                          device=noise.device), t], dim=1)
            return _x0(model, prefix, t_all, text, layout, 0, None)[:, :, start:]

        x = noise[:, :, start:end]
        for i in range(exit_index):
            with torch.no_grad():
                x0 = denoise(x, steps[i])
                nxt = steps[i + 1] / 1000
                if sampler == "consistency":
                    eps = torch.randn(x.shape, generator=generator).to(x)
                else:
                    s = steps[i] / 1000
                    eps = (x.float() - (1 - s) * x0) / s
                x = ((1 - nxt) * x0 + nxt * eps).to(noise.dtype)
        x0 = denoise(x, steps[exit_index])
        yield BlockSample(start, end, x0, exit_index)
        with torch.no_grad():  # the block's clean (or lightly noised) frames become the context
            clean = x0.detach()
            if context_noise > 0:
                s = context_noise / 1000
                clean = (1 - s) * clean + s * torch.randn(clean.shape, generator=generator).to(clean)
            clean = clean.to(noise.dtype)
            if use_cache:
                denoise(clean, context_noise, commit=True)
            else:
                context.append(clean)


# ---- streaming inference -------------------------------------------------------------------------------------
class StreamingDecoder:
    """Decodes a Wan latent video block by block with the VAE's causal feature cache: the frames come out as each
    block arrives and equal one decode of the whole latent (diffusers' ``AutoencoderKLWan._decode`` runs one latent
    frame at a time over the same cache)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.vae = adapter.vae if adapter.vae is not None else adapter.load_vae()
        self.vae.clear_cache()
        self.first = True

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents (B, 16, k, h, w) of the next block -> pixels (B, 3, frames, H, W) in [-1, 1]."""
        vae = self.vae
        mean, std = self.adapter._latent_stats(latents.float())
        x = vae.post_quant_conv((latents.float() * std + mean).to(self.adapter.device, vae.dtype))
        out = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            out.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                   first_chunk=self.first))
            self.first = False
        return torch.cat(out, dim=2).clamp(-1, 1)

    def close(self) -> None:
        self.vae.clear_cache()


def stream_video(adapter, model, prompt_embeds: torch.Tensor, noise: torch.Tensor, steps: list[float],
                 layout: CausalLayout, *, sampler: str = "consistency", seed: int = 0,
                 context_noise: float = 0.0) -> Iterator[tuple[BlockSample, torch.Tensor]]:
    """The causal student's video, block by block: each block denoised in ``steps`` with the KV cache of the blocks
    before it, then decoded at once; yields (the block's latents, its pixels (B, 3, frames, H, W))."""
    decoder = StreamingDecoder(adapter)
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for block in generate_blocks(model, noise, prompt_embeds, steps, layout, sampler=sampler,
                                         generator=generator, context_noise=context_noise):
                yield block, decoder(block.x0)
    finally:
        decoder.close()
