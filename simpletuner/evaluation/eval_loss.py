"""Evaluation loss: the training objective on held-out images, measured so two evaluations can be compared.

Each eval image is noised at fixed noise levels sigma = 0.1, 0.2, ..., 0.9 (timestep 1000 * sigma, the same for
every run whatever its shift settings) with noise drawn from a generator seeded by the sample's identity (its
latent cache key), never from the global RNG. The loss is the same flow-matching MSE the trainer takes. The
result is the per-level loss averaged over the images, plus their mean: for fixed weights it is the same number
every time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

EVAL_SIGMAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class EvalItem:
    """One eval image, read back from the caches: its latent key (identity), latents and text embedding."""

    key: str
    latents: torch.Tensor  # (C, h, w)
    text: dict[str, torch.Tensor]  # one prompt's embeddings, no batch dimension


def fixed_noise(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Gaussian noise determined by ``key`` alone (the global RNG is neither read nor advanced)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def metric_name(sigma: float) -> str:
    return f"eval/loss_sigma_{sigma:g}"


@torch.no_grad()
def evaluation_loss(adapter, transformer, items: list[EvalItem], *, sigmas=EVAL_SIGMAS, batch_size: int = 4,
                    device=None) -> dict[str, float]:
    """``{"eval/loss_sigma_0.1": ..., ..., "eval/loss": mean}`` over ``items`` (the model must be in eval mode)."""
    if not items:
        raise ValueError("evaluation_loss: no eval items")
    device = device or next(transformer.parameters()).device
    levels = torch.tensor(sigmas, dtype=torch.float32)
    totals = torch.zeros(len(sigmas), dtype=torch.float64)
    for item in items:
        latents = item.latents.float()
        noise = fixed_noise(item.key, latents.shape)
        for start in range(0, len(sigmas), batch_size):
            s = levels[start:start + batch_size]
            n = len(s)
            x0 = latents.unsqueeze(0).expand(n, *latents.shape).to(device)
            eps = noise.unsqueeze(0).expand(n, *noise.shape).to(device)
            text = {k: v.unsqueeze(0).expand(n, *v.shape).to(device) for k, v in item.text.items()}
            sv = s.to(device).view(-1, *([1] * latents.ndim))
            noisy = (1 - sv) * x0 + sv * eps  # the trainer's rectified-flow noising (training/flow.py)
            target = adapter.training_target(x0, eps)
            pred = adapter.predict(transformer, noisy, s.to(device), text)
            per_level = (pred.float() - target.float()).pow(2).flatten(1).mean(1)
            totals[start:start + n] += per_level.double().cpu()
    per_sigma = (totals / len(items)).tolist()
    metrics = {metric_name(sigma): value for sigma, value in zip(sigmas, per_sigma)}
    metrics["eval/loss"] = sum(per_sigma) / len(per_sigma)
    return metrics
