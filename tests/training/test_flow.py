from __future__ import annotations

import math

import torch

from simpletuner.training.flow import add_noise, auto_shift_sigmas, resolution_shift_mu, sample_sigmas, shift_sigmas


def test_sigmas_in_range_and_reproducible():
    a = sample_sigmas(1000, generator=torch.Generator().manual_seed(0), uniform=False, sigmoid_scale=1.0)
    b = sample_sigmas(1000, generator=torch.Generator().manual_seed(0), uniform=False, sigmoid_scale=1.0)
    assert torch.equal(a, b) and a.min() > 0 and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.03  # logit-normal is symmetric around 0.5
    u = sample_sigmas(1000, generator=torch.Generator().manual_seed(0), uniform=True, sigmoid_scale=1.0)
    assert u.std() > a.std()  # uniform is wider than sigmoid(N(0,1))


def test_shift_moves_mass_to_high_noise_and_keeps_endpoints():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    shifted = shift_sigmas(s, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert torch.all(shifted[1:3] > s[1:3])
    assert torch.allclose(shift_sigmas(torch.tensor([0.5]), 3.0), torch.tensor([0.75]))


def test_auto_shift_matches_flux_resolution_rule():
    # 256 tokens -> mu 0.5, 4096 tokens -> mu 1.15 (FluxPipeline's defaults)
    assert math.isclose(resolution_shift_mu(256), 0.5) and math.isclose(resolution_shift_mu(4096), 1.15)
    s = torch.tensor([0.5])
    assert torch.allclose(auto_shift_sigmas(s, 4096), torch.tensor([math.exp(1.15) / (math.exp(1.15) + 1)]))


def test_add_noise_interpolates():
    x, n = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    out = add_noise(x, n, torch.tensor([0.0, 0.3]))
    assert torch.allclose(out[0], x[0]) and torch.allclose(out[1], torch.full((1, 2, 2), 0.3))
