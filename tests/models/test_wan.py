"""Wan specifics beyond the family contract: the 2.2 expert's part of the schedule, the per-sample 3-D RoPE slice, and
group offload + int8 quantization training a video transformer exactly as the plain run does."""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.wan import WanAdapter, slice_wan_rotary
from tests.models.contract import family_config, group_offload_losses


def test_an_expert_trains_only_its_part_of_the_schedule(tiny_dir):
    low = WanAdapter(family_config("wan", model_flavour="tiny-2.2-low"))
    high = WanAdapter(family_config("wan", model_flavour="tiny-2.2-high"))
    assert low.boundary_ratio() == high.boundary_ratio() == 0.875
    assert low.denoiser_subfolder == "transformer_2" and high.denoiser_subfolder == "transformer"
    g = torch.Generator().manual_seed(0)
    t_low = low.objective.sample_timesteps(4096, generator=g, image_seq_len=64)
    t_high = high.objective.sample_timesteps(4096, generator=g, image_seq_len=64)
    assert 0 <= t_low.min() and t_low.max() < 0.875 and 0.875 <= t_high.min() and t_high.max() <= 1
    assert low.objective.covers(torch.tensor([0.5])) and not low.objective.covers(torch.tensor([0.9]))
    assert WanAdapter(family_config("wan")).objective.covers(torch.tensor([0.9]))


def test_rope_is_sliced_per_sample():
    cos, sin = torch.randn(1, 10, 1, 6), torch.randn(1, 10, 1, 6)
    idx = torch.tensor([[0, 3, 7], [1, 2, 9]])
    sliced_cos, sliced_sin = slice_wan_rotary((cos, sin), idx, 0)
    assert sliced_cos.shape == (2, 3, 1, 6)
    assert torch.equal(sliced_cos[1], cos[0, [1, 2, 9]]) and torch.equal(sliced_sin[0], sin[0, [0, 3, 7]])


@pytest.mark.parametrize("precision", ["int8-quanto"])
def test_group_offload_trains_a_video_transformer_like_the_plain_run(precision, tmp_path):
    losses = group_offload_losses("wan", tmp_path, precision)
    assert len(losses[0]) == 2 and losses[0] == losses[1]
