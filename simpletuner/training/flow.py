"""Rectified-flow noise schedule for training: sigma sampling, shift, and noising.

x_t = (1 - sigma) * x_0 + sigma * noise; the model predicts the velocity (noise - x_0).
"""

from __future__ import annotations

import math

import torch


def sample_sigmas(batch: int, *, generator: torch.Generator, uniform: bool, sigmoid_scale: float) -> torch.Tensor:
    """Draw sigma in (0, 1): uniform, or sigmoid of a scaled normal (logit-normal, more mass mid-range)."""
    if uniform:
        return torch.rand(batch, generator=generator)
    return torch.sigmoid(sigmoid_scale * torch.randn(batch, generator=generator))


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Flux static shift: larger shift spends more steps at high noise."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_shift_mu(image_seq_len: int, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """Flux's resolution-dependent shift exponent: linear in the number of image tokens."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def auto_shift_sigmas(sigmas: torch.Tensor, image_seq_len: int) -> torch.Tensor:
    mu = resolution_shift_mu(image_seq_len)
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def training_sigmas(config, batch: int, image_seq_len: int, generator: torch.Generator) -> torch.Tensor:
    sigmas = sample_sigmas(
        batch, generator=generator, uniform=config.flow_use_uniform_schedule, sigmoid_scale=config.flow_sigmoid_scale
    )
    if config.flow_schedule_auto_shift:
        return auto_shift_sigmas(sigmas, image_seq_len)
    return shift_sigmas(sigmas, float(config.flow_schedule_shift or 1.0))


def add_noise(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents)
    return (1 - s) * latents + s * noise
