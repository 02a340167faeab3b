"""The distillation objectives as small functions of tensors (x0 predictions, samples, logits) -> loss, and the
GAN classification branch that sits on the critic. The recipe (``distill.py``) calls them; the unit tests prove each
gradient on toy networks where the answer is known.

- DMD (Yin et al. 2023, eq. 7-8): the generator's sample ``x`` moves along ``fake_x0 - real_x0`` (the difference of
  the critic's and the teacher's x0 predictions on a noised ``x``), normalised by ``mean |x - real_x0|`` per sample,
  written as a stop-gradient MSE: ``0.5 * ||x - sg(x - grad)||^2`` has the gradient ``grad`` (per element, / N).
- SiD (Zhou et al. 2024): ``(real - fake) * ((real - x) - alpha (real - fake))``, normalised like DMD; its gradient
  reaches the generator through both scores' inputs.
- GAN (DMD2, Self-Forcing): non-saturating logistic losses on the classifier's logits of noised teacher ("real")
  and student ("fake") samples, or the relativistic pair; R1/R2 as finite differences of the logits.
- ODE regression (CausVid): the student's x0 against the teacher's ODE endpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance of two x0 predictions: ``uncond + scale * (cond - uncond)`` (1 = ``cond``)."""
    if uncond is None or scale == 1.0:
        return cond
    return uncond + scale * (cond - uncond)


def _per_sample_mean_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs().flatten(1).mean(1).view(-1, *([1] * (x.ndim - 1)))


def dmd_gradient(sample: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor,
                 normalize: bool = True) -> torch.Tensor:
    """The distribution-matching gradient on ``sample``: ``fake_x0 - real_x0``, divided by ``mean |sample -
    real_x0|`` per sample (DMD eq. 8) with ``normalize``; NaNs (a zero normaliser) become 0."""
    grad = fake_x0.double() - real_x0.double()
    if normalize:
        grad = grad / _per_sample_mean_abs(sample.detach().double() - real_x0.double())
    return torch.nan_to_num(grad)


def dmd_loss(sample: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``0.5 * mean((sample - sg(sample - grad))^2)``: backward puts ``grad / N`` on ``sample`` (N elements, or
    the masked ones with ``mask``)."""
    target = (sample.double() - grad.double()).detach()
    if mask is not None:
        return 0.5 * F.mse_loss(sample.double()[mask], target[mask])
    return 0.5 * F.mse_loss(sample.double(), target)


def sid_loss(sample: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor, alpha: float) -> torch.Tensor:
    """SiD's generator loss ``mean((real - fake) * ((real - sample) - alpha (real - fake)) / n)``, n = the detached
    ``mean |sample - real|`` per sample. Gradients flow through ``sample`` and both predictions (and so through the
    scores' inputs back to the generator)."""
    real, fake, x = real_x0.double(), fake_x0.double(), sample.double()
    with torch.no_grad():
        normalizer = _per_sample_mean_abs(x - real)
    loss = (real - fake) * ((real - x) - alpha * (real - fake)) / normalizer
    return torch.nan_to_num(loss).mean()


def ode_regression_loss(pred_x0: torch.Tensor, target_x0: torch.Tensor) -> torch.Tensor:
    """The student's x0 from a point of the teacher's trajectory against the trajectory's end."""
    return F.mse_loss(pred_x0.float(), target_x0.float())


def gan_generator_loss(fake_logits: torch.Tensor, real_logits: torch.Tensor | None = None,
                       relativistic: bool = False) -> torch.Tensor:
    """Non-saturating generator loss ``softplus(-fake)``; relativistic: ``softplus(-(fake - real))``."""
    logits = fake_logits.float() - real_logits.float() if relativistic else fake_logits.float()
    return F.softplus(-logits).mean()


def gan_critic_loss(fake_logits: torch.Tensor, real_logits: torch.Tensor, relativistic: bool = False) -> torch.Tensor:
    """Classifier loss ``softplus(-real) + softplus(fake)``; relativistic: ``softplus(-(real - fake))``."""
    if relativistic:
        return F.softplus(-(real_logits.float() - fake_logits.float())).mean()
    return F.softplus(-real_logits.float()).mean() + F.softplus(fake_logits.float()).mean()


def finite_difference_penalty(perturbed_logits: torch.Tensor, logits: torch.Tensor, sigma: float) -> torch.Tensor:
    """R1 (around real samples) / R2 (around fake ones) as Self-Forcing writes them: the squared finite difference
    ``((D(x + sigma * e) - D(x)) / sigma)^2`` averaged, which estimates ``|grad_x D|^2`` along ``e`` without a
    double backward."""
    return ((perturbed_logits.float() - logits.float()) / sigma).pow(2).mean()


class GanHead(nn.Module):
    """The GAN classification branch: reads one transformer block's output tokens (B, N, D) through a forward hook
    on the critic, mean-pools them and maps them to one logit per sample. The critic's backbone is shared with the
    fake score, as in DMD2."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens.float().mean(dim=1)).squeeze(-1)


class BlockFeatures:
    """A forward hook that keeps the image tokens a block outputs (the tuple element ``index``, or the output
    itself), for ``GanHead``. ``capture()`` turns it on for one forward; it is off otherwise."""

    def __init__(self, block: nn.Module, index: int | None):
        self.index = index
        self.tokens: torch.Tensor | None = None
        self.active = False
        self.handle = block.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.active:
            out = output[self.index] if self.index is not None else output
            self.tokens = out.flatten(2).transpose(1, 2) if out.ndim > 3 else out  # (B, D, ...) -> (B, N, D)

    def take(self) -> torch.Tensor:
        tokens, self.tokens = self.tokens, None
        if tokens is None:
            raise RuntimeError("the critic's forward did not reach the GAN feature block")
        return tokens

    def remove(self) -> None:
        self.handle.remove()
