from __future__ import annotations

import torch

from simpletuner.training.optimizers import AdamWBF16, _stochastic_round_to_bf16


def test_matches_adamw_on_fp32_weights():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 5))
    b = torch.nn.Parameter(a.detach().clone())
    oa = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.01)
    ob = AdamWBF16([b], lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        for p, o in ((a, oa), (b, ob)):
            o.zero_grad()
            (p ** 2).sum().backward()
            o.step()
    assert torch.allclose(a, b, atol=1e-6)


def test_stochastic_rounding_is_unbiased():
    value = torch.full((20000,), 1.0 + 2 ** -10)  # between two bf16 neighbours (1.0 and 1.0078125)
    rounded = _stochastic_round_to_bf16(value, None).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    assert abs(rounded.mean().item() - value[0].item()) < 2e-4


def test_small_updates_survive_on_bf16_weights():
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = AdamWBF16([p], lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        opt.zero_grad()
        p.sum().backward()
        opt.step()
    # plain bf16 rounding would keep every weight at exactly 1.0; in expectation it moved by 20 * 1e-4
    assert abs((1.0 - p.float().mean().item()) - 20e-4) < 5e-4
