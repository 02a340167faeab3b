"""The causal Wan: one block is diffusers' own Wan forward; streaming one block at a time with the KV and
cross-attention caches equals the whole sequence under the block-causal mask (fp32, < 1e-5), for generation too;
RoPE frame offsets, local attention and an independent first frame included."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from simpletuner.models.causal_wan import CausalLayout, KVCache, causal_forward, generate_blocks

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                                out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=3,
                                cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    return wan.eval()


def inputs(frames: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, frames, 4, 6, generator=g), torch.randn(1, 7, 32, generator=g)


def test_one_block_over_the_whole_video_is_diffusers_wan(model):
    latents, text = inputs(4)
    with torch.no_grad():
        ours = causal_forward(model, latents, torch.full((1, 4), 640.0), text, CausalLayout(num_frame_per_block=4))
        theirs = model(latents, torch.tensor([640.0]), text, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, **TOL)


def test_the_block_causal_mask():
    mask = CausalLayout(num_frame_per_block=2).frame_mask(6).int().tolist()
    assert mask == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    local = CausalLayout(num_frame_per_block=2, local_attn_size=4).frame_mask(6).int().tolist()
    assert local[4] == [0, 0, 1, 1, 1, 1]  # the third block sees its own 2 frames and the 2 before
    first = CausalLayout(num_frame_per_block=2, independent_first_frame=True)
    assert first.blocks(5) == [(0, 1), (1, 3), (3, 5)]
    with pytest.raises(ValueError, match="do not split into blocks of 2"):
        CausalLayout(num_frame_per_block=2).blocks(5)


@pytest.mark.parametrize("layout, frames", [
    (CausalLayout(num_frame_per_block=2), 6),
    (CausalLayout(num_frame_per_block=2, local_attn_size=4), 8),
    (CausalLayout(num_frame_per_block=2, independent_first_frame=True), 5),
], ids=["blocks", "local-attention", "independent-first-frame"])
def test_streaming_with_the_caches_equals_the_whole_sequence(model, layout, frames):
    latents, text = inputs(frames)
    g = torch.Generator().manual_seed(2)
    blocks = layout.blocks(frames)
    t = torch.cat([torch.full((1, e - s), float(torch.randint(0, 1000, (1,), generator=g))) for s, e in blocks], 1)
    with torch.no_grad():
        whole = causal_forward(model, latents, t, text, layout)
        cache = KVCache(layout)
        streamed = [causal_forward(model, latents[:, :, s:e], t[:, s:e], text, layout, frame_offset=s, cache=cache,
                                   commit=True) for s, e in blocks]
    torch.testing.assert_close(torch.cat(streamed, dim=2), whole, **TOL)
    assert set(cache.cross) == {0, 1, 2}  # the text's keys and values were computed once per layer
    if layout.local_attn_size > 0:  # frames no later block can see are gone from the cache
        assert cache.first_frame == frames + layout.num_frame_per_block - layout.local_attn_size


@pytest.mark.parametrize("sampler", ["consistency", "ode"])
def test_streaming_generation_equals_recomputing_the_prefix(model, sampler):
    layout = CausalLayout(num_frame_per_block=2, local_attn_size=4)
    noise, text = inputs(6, seed=3)
    steps = [1000.0, 750.0, 500.0]

    def run(use_cache):
        with torch.no_grad():
            return torch.cat([b.x0 for b in generate_blocks(
                model, noise, text, steps, layout, sampler=sampler, generator=torch.Generator().manual_seed(4),
                context_noise=100.0, use_cache=use_cache)], dim=2)

    torch.testing.assert_close(run(True), run(False), **TOL)


def test_the_exit_step_keeps_autograd_and_checkpointing_gives_the_same_gradients(model):
    layout = CausalLayout(num_frame_per_block=2)
    noise, text = inputs(4, seed=5)
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        blocks = list(generate_blocks(model, noise, text, [1000.0, 500.0], layout, sampler="ode",
                                      exit_indices=[0, 1]))
        assert [b.exit_index for b in blocks] == [0, 1] and all(b.x0.requires_grad for b in blocks)
        torch.cat([b.x0 for b in blocks], dim=2).pow(2).mean().backward()
        grads.append(model.blocks[0].attn1.to_q.weight.grad.clone())
    model.gradient_checkpointing = False
    torch.testing.assert_close(grads[0], grads[1], **TOL)
