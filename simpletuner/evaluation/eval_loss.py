"""Evaluation loss: the training objective on held-out images, measured so two evaluations can be compared.

Each eval image is noised at the objective's fixed levels (flow matching: sigma = 0.1, 0.2, ..., 0.9; DDPM: the
timesteps at the same fractions of the schedule; the same for every run whatever its shift settings) with noise
drawn from a generator seeded by the sample's identity (its latent cache key), never from the global RNG. Noising,
target and loss are the run's own ``Objective`` (``simpletuner.models.objectives``), the very code the training step
uses. The result is the per-level loss averaged over the images, plus their mean: for fixed weights it is the same
number every time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from simpletuner.models.objectives import EVAL_FRACTIONS

# flow matching's levels are sigma itself
EVAL_SIGMAS = EVAL_FRACTIONS


@dataclass(frozen=True)
class EvalItem:
    """One eval image, read back from the caches: its latent key (identity), latents and text embedding."""

    key: str
    latents: torch.Tensor  # (C, h, w)
    text: dict[str, torch.Tensor]  # one prompt's embeddings (and the sample's other conditioning), no batch dimension
    mask: torch.Tensor | None = None  # (1, h, w) loss weights, for a dataset paired with masks


def fixed_noise(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Gaussian noise determined by ``key`` alone (the global RNG is neither read nor advanced)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def metric_name(level: float, objective=None) -> str:
    """``eval/loss_sigma_0.1`` (flow matching) or ``eval/loss_t_99`` (DDPM) for one eval level."""
    return f"eval/loss_{objective.level_name(level) if objective is not None else f'sigma_{level:g}'}"


@torch.no_grad()
def evaluation_loss(adapter, transformer, items: list[EvalItem], *, levels=None, batch_size: int = 4,
                    device=None) -> dict[str, float]:
    """``{"eval/loss_<level>": ..., "eval/loss": mean}`` over ``items`` (the model must be in eval mode).

    ``levels`` overrides the objective's fixed eval timesteps (in its own units).
    """
    if not items:
        raise ValueError("evaluation_loss: no eval items")
    objective = adapter.objective
    device = device or next(transformer.parameters()).device
    levels = objective.eval_timesteps() if levels is None else torch.as_tensor(levels)
    totals = torch.zeros(len(levels), dtype=torch.float64)
    for item in items:
        latents = item.latents.float()
        noise = fixed_noise(item.key, latents.shape)
        for start in range(0, len(levels), batch_size):
            t = levels[start:start + batch_size].to(device)
            n = len(t)
            x0 = latents.unsqueeze(0).expand(n, *latents.shape).to(device)
            eps = noise.unsqueeze(0).expand(n, *noise.shape).to(device)
            text = {k: v.unsqueeze(0).expand(n, *v.shape).to(device) for k, v in item.text.items()}
            noisy = objective.add_noise(x0, eps, t)
            pred = adapter.predict(transformer, noisy, t, text)
            mask = None if item.mask is None else item.mask.unsqueeze(0).expand(n, *item.mask.shape).to(device)
            totals[start:start + n] += objective.per_sample_loss(pred, objective.target(x0, eps, t), t,
                                                                 weight=mask).double().cpu()
    per_level = (totals / len(items)).tolist()
    metrics = {metric_name(float(level), objective): value for level, value in zip(levels.tolist(), per_level)}
    metrics["eval/loss"] = sum(per_level) / len(per_level)
    return metrics
