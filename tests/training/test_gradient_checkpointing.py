from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel

from simpletuner.training.gradient_checkpointing import apply_gradient_checkpointing_interval


def tiny_transformer():
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def grads(model, calls=None):
    torch.manual_seed(1)
    x = torch.randn(1, 16, 16)
    out = model(hidden_states=x, encoder_hidden_states=torch.randn(1, 8, 32), pooled_projections=torch.randn(1, 32),
                timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                return_dict=False)[0]
    out.pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_interval_checkpoints_every_nth_block_with_identical_gradients():
    plain = grads(tiny_transformer())
    model = tiny_transformer()
    model.enable_gradient_checkpointing()
    calls = []
    inner = model._gradient_checkpointing_func
    model._gradient_checkpointing_func = lambda block, *a: (calls.append(block), inner(block, *a))[1]
    apply_gradient_checkpointing_interval(model, 2)
    assert model._simpletuner_checkpointed_blocks == 3  # blocks 0, 2, 4 of 6
    checked = grads(model)
    assert len(calls) == 3
    assert plain.keys() == checked.keys()
    assert all(torch.allclose(plain[k], checked[k], atol=1e-6) for k in plain)


def test_interval_needs_checkpointing_on():
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        apply_gradient_checkpointing_interval(tiny_transformer(), 2)
