"""Each distillation objective's gradient on toy networks where the answer is known.

The toy "scores" are exact posterior means of Gaussian data under rectified flow (``x_t = (1 - s) x0 + s n``):
for data N(mu, 1), E[x0 | x_t] = mu + (1 - s) (x_t - (1 - s) mu) / ((1 - s)^2 + s^2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simpletuner.training.distill_losses import (BlockFeatures, GanHead, dmd_gradient, dmd_loss,
                                                 finite_difference_penalty, gan_critic_loss, gan_generator_loss,
                                                 guided, ode_regression_loss, sid_loss)


def gaussian_x0(mu: torch.Tensor | float, x_t: torch.Tensor, s: float) -> torch.Tensor:
    """E[x0 | x_t] for x0 ~ N(mu, 1) at noise level s."""
    a = 1 - s
    return mu + a * (x_t - a * mu) / (a * a + s * s)


def test_dmd_gradient_is_the_normalised_fake_minus_real_difference():
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 4, 5, generator=g).requires_grad_(True)
    A, B = torch.randn(5, 5, generator=g), torch.randn(5, 5, generator=g)
    x_t = 0.6 * sample.detach() + 0.4 * torch.randn(3, 4, 5, generator=g)
    real, fake = x_t @ A, x_t @ B  # toy linear scores (no gradient, as the recipe computes them)
    dmd_loss(sample, dmd_gradient(sample, real, fake)).backward()
    normaliser = (sample.detach() - real).abs().flatten(1).mean(1).view(-1, 1, 1)
    expected = (fake - real) / normaliser / sample.numel()
    torch.testing.assert_close(sample.grad, expected.float(), rtol=1e-6, atol=1e-9)
    # unnormalised: exactly the difference
    sample.grad = None
    dmd_loss(sample, dmd_gradient(sample, real, fake, normalize=False)).backward()
    torch.testing.assert_close(sample.grad, ((fake - real) / sample.numel()).float())


def test_dmd_gradient_is_zero_when_fake_equals_real():
    sample = torch.randn(2, 8).requires_grad_(True)
    real = torch.randn(2, 8)
    loss = dmd_loss(sample, dmd_gradient(sample, real, real.clone()))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(sample.grad) == 0


def test_dmd_moves_a_gaussian_generator_onto_the_data():
    """Generator x = mu_g + z; the real score is the data N(2, 1), the fake score the generator's own N(mu_g, 1):
    fake - real = (mu_g - 2) s^2 / ((1 - s)^2 + s^2), so descent brings mu_g to 2."""
    g = torch.Generator().manual_seed(1)
    mu_g = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([mu_g], lr=0.5)
    for _ in range(200):
        z = torch.randn(256, 1, generator=g)
        x = mu_g + z
        s = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        with torch.no_grad():
            x_t = (1 - s) * x + s * torch.randn(x.shape, generator=g)
            real, fake = gaussian_x0(2.0, x_t, s), gaussian_x0(mu_g.detach(), x_t, s)
        opt.zero_grad()
        dmd_loss(x, dmd_gradient(x, real, fake, normalize=False)).backward()  # d/dmu = mean(fake - real)
        opt.step()
    assert abs(mu_g.item() - 2.0) < 0.05


def test_sid_gradient_vanishes_when_fake_equals_real_and_matches_its_closed_form():
    s, alpha = 0.4, 1.2
    x = torch.full((1, 1), 0.7, dtype=torch.float64, requires_grad=True)
    n = torch.tensor([[0.3]], dtype=torch.float64)
    # real and fake both the data's score: SiD's loss and gradient are zero
    x_t = (1 - s) * x + s * n
    sid_loss(x, gaussian_x0(1.0, x_t, s), gaussian_x0(1.0, x_t, s), alpha).backward()
    assert x.grad.abs().item() == 0.0
    # different scores: autograd through both predictions matches d/dx of the closed form
    x.grad = None
    mu_r, mu_f = 1.0, -0.5
    x_t = (1 - s) * x + s * n
    real, fake = gaussian_x0(mu_r, x_t, s), gaussian_x0(mu_f, x_t, s)
    sid_loss(x, real, fake, alpha).backward()
    a, c = 1 - s, (1 - s) / ((1 - s) ** 2 + s ** 2)
    r, f, xv = real.item(), fake.item(), x.item()
    norm = abs(xv - r)
    dr_dx = c * a  # d real / dx (fake has the same slope)
    diff = r - f  # constant in x: both scores have slope c * a
    d_loss = diff * (dr_dx - 1) / norm
    assert x.grad.item() == pytest.approx(d_loss, rel=1e-9)


def test_gan_losses_push_logits_the_right_way():
    fake = torch.tensor([0.5, -1.0], requires_grad=True)
    real = torch.tensor([2.0, 0.0], requires_grad=True)
    gan_generator_loss(fake).backward()
    torch.testing.assert_close(fake.grad, -torch.sigmoid(-fake.detach()) / 2)  # raise the fake logits
    fake.grad = None
    gan_critic_loss(fake, real).backward()
    torch.testing.assert_close(fake.grad, torch.sigmoid(fake.detach()) / 2)  # lower fake
    torch.testing.assert_close(real.grad, -torch.sigmoid(-real.detach()) / 2)  # raise real
    fake.grad = real.grad = None
    gan_critic_loss(fake, real, relativistic=True).backward()
    torch.testing.assert_close(real.grad, -fake.grad)  # only the difference counts
    assert (real.grad < 0).all()
    fake.grad = real.grad = None
    gan_generator_loss(fake, real, relativistic=True).backward()
    torch.testing.assert_close(fake.grad, -real.grad)
    assert (fake.grad < 0).all()


def test_finite_difference_penalty_of_a_linear_classifier_is_its_slope_squared():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, generator=g)
    x = torch.randn(4, 6, generator=g)
    e = torch.randn(4, 6, generator=g)
    sigma = 0.01
    penalty = finite_difference_penalty((x + sigma * e) @ w, x @ w, sigma)
    assert penalty.item() == pytest.approx(((e @ w) ** 2).mean().item(), rel=1e-4)


def test_ode_regression_gradient_pulls_the_prediction_onto_the_endpoint():
    pred = torch.tensor([[1.0, 2.0]], requires_grad=True)
    target = torch.tensor([[0.0, 2.0]])
    ode_regression_loss(pred, target).backward()
    torch.testing.assert_close(pred.grad, torch.tensor([[1.0, 0.0]]))  # 2 (pred - target) / 2
    assert ode_regression_loss(target, target).item() == 0.0


def test_guidance_is_linear_and_off_at_one():
    cond, uncond = torch.tensor([1.0]), torch.tensor([0.0])
    assert guided(cond, uncond, 1.0) is cond and guided(cond, None, 5.0) is cond
    assert guided(cond, uncond, 3.0).item() == 3.0


def test_gan_head_reads_a_blocks_tokens_through_a_hook():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    net, head = Net(), GanHead(4)
    features = BlockFeatures(net.blocks[0], None)
    x = torch.randn(3, 5, 4)
    net(x)
    assert features.tokens is None  # off unless asked
    features.active = True
    net(x)
    logits = head(features.take())
    assert logits.shape == (3,)
    logits.sum().backward()  # the head trains, and the gradient reaches the block
    assert net.blocks[0].weight.grad is not None and net.blocks[1].weight.grad is None
    features.remove()
