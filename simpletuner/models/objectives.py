"""Training objectives: how a step draws timesteps, noises the latents, and what the model must predict.

One object per run, chosen by ``prediction_type`` (the family's default unless the config names another), shared by
the training loss and the eval loss, so neither keeps its own copy of the noising step:

- ``flow_matching``: rectified flow, ``x_t = (1 - sigma) x_0 + sigma * noise``, target the velocity
  ``noise - x_0``; ``t`` is sigma in (0, 1), drawn logit-normal or uniform, then shifted (a fixed
  ``flow_schedule_shift`` or, with ``flow_schedule_auto_shift``, the resolution-dependent shift whose constants come
  from the model's own scheduler config, not Flux's for everyone).
- ``epsilon`` / ``v_prediction``: DDPM, ``t`` an integer timestep; the schedule (betas, optional zero-terminal-SNR
  rescale) is diffusers' ``DDPMScheduler`` built from the model's scheduler config, which owns ``add_noise`` and
  ``get_velocity``; ``snr_gamma`` weights each sample's loss by min-SNR-gamma.

Timesteps ``t`` are in the objective's own units; a family's adapter turns them into what its transformer takes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

# fixed noise levels for the eval loss, as fractions of the schedule (the same for every run whatever its shift)
EVAL_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *([1] * (like.ndim - 1))).to(like)


class Objective(ABC):
    """What a training step needs from the noise schedule. Subclasses are small; see the module docstring."""

    name: str = ""

    @abstractmethod
    def sample_timesteps(self, batch: int, *, generator: torch.Generator, image_seq_len: int) -> torch.Tensor:
        """Training timesteps for a batch, drawn from ``generator`` only."""

    @abstractmethod
    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The noisy latents the model sees at ``t``."""

    @abstractmethod
    def target(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the model is trained to predict."""

    @abstractmethod
    def eval_timesteps(self) -> torch.Tensor:
        """The fixed levels the eval loss is measured at (one per ``EVAL_FRACTIONS``)."""

    @abstractmethod
    def level_name(self, t: float) -> str:
        """A metric-name suffix for one eval level, e.g. ``sigma_0.1`` or ``t_99``."""

    @abstractmethod
    def pipeline_timestep(self, scheduler, index: int) -> torch.Tensor:
        """``t`` of a diffusers pipeline's denoising step ``index`` (after ``set_timesteps``), in this objective's
        units: what the trainer would pass for the same noise level."""

    @abstractmethod
    def x0_from_prediction(self, pred: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean latents a prediction implies for ``noisy`` at ``t`` (float32)."""

    @abstractmethod
    def noise_from_x0(self, x0: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The noise that takes ``x0`` to ``noisy`` at ``t`` (``t`` above the clean end; float32)."""

    @abstractmethod
    def from_train_timestep(self, t: torch.Tensor) -> torch.Tensor:
        """Timesteps on the 0..1000 scale of distillation step lists (1000 pure noise, 0 clean) in this objective's
        own units."""

    def covers(self, t: torch.Tensor) -> bool:
        """Whether this run trains at level ``t`` (a two-expert model's expert covers part of the schedule)."""
        return True

    def loss(self, pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor,
             weight: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss of a batch in float32: the squared error, times ``weight`` where given (a loss mask at
        latent resolution, (B, 1, h, w), broadcast over channels), averaged per sample, times the objective's
        per-timestep weight (min-SNR), averaged over the batch."""
        timestep_weight = self.loss_weights(t)
        if weight is None and timestep_weight is None:  # one reduction over everything, as before masks existed
            return F.mse_loss(pred.float(), target.float())
        err = (pred.float() - target.float()).pow(2)
        if weight is not None:
            err = err * weight.to(err)
        per_sample = err.flatten(1).mean(1)
        if timestep_weight is not None:
            per_sample = per_sample * timestep_weight.to(per_sample)
        return per_sample.mean()

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor | None:
        """(batch,) loss weight per timestep, or None for equal weights."""
        return None

    def per_sample_loss(self, pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor,
                        weight: torch.Tensor | None = None) -> torch.Tensor:
        """(batch,) mean squared error per sample, weighted by a loss mask where given, without the per-timestep
        weight (the eval loss reports one level per sample)."""
        err = (pred.float() - target.float()).pow(2)
        if weight is not None:
            err = err * weight.to(err)
        return err.flatten(1).mean(1)


# a timestep-distilled model's few-step schedule (SimpleTuner's flux_fast_schedule): sigma 1.0 seven times in ten
FAST_SCHEDULE_SIGMAS = (1.0,) * 7 + (0.75, 0.5, 0.25)


class FlowMatching(Objective):
    """Rectified flow with SD3/Flux timestep sampling and shift (or the fast schedule of a distilled model)."""

    name = "flow_matching"

    def __init__(self, *, shift: float = 1.0, auto_shift: bool = False, uniform: bool = False,
                 sigmoid_scale: float = 1.0, base_seq_len: int = 256, max_seq_len: int = 4096,
                 base_shift: float = 0.5, max_shift: float = 1.15, fast: bool = False):
        self.fast = fast
        self.shift = float(shift or 1.0)
        self.auto_shift = auto_shift
        self.uniform = uniform
        self.sigmoid_scale = sigmoid_scale
        self.base_seq_len, self.max_seq_len = base_seq_len, max_seq_len
        self.base_shift, self.max_shift = base_shift, max_shift

    @classmethod
    def from_config(cls, config, scheduler_config: Mapping[str, Any]) -> FlowMatching:
        """The run's settings (``flow_*``) over the family's scheduler constants (for the auto shift)."""
        sc = scheduler_config or {}
        return cls(
            shift=float(config.flow_schedule_shift or 1.0), auto_shift=bool(config.flow_schedule_auto_shift),
            uniform=bool(config.flow_use_uniform_schedule), sigmoid_scale=float(config.flow_sigmoid_scale),
            base_seq_len=int(sc.get("base_image_seq_len") or 256), max_seq_len=int(sc.get("max_image_seq_len") or 4096),
            base_shift=float(sc.get("base_shift") or 0.5), max_shift=float(sc.get("max_shift") or 1.15),
            fast=bool(getattr(config, "flow_fast_schedule", False)),
        )

    def resolution_mu(self, image_seq_len: int) -> float:
        """The resolution-dependent shift exponent: linear in the number of image tokens."""
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return image_seq_len * slope + self.base_shift - slope * self.base_seq_len

    def shift_sigmas(self, sigmas: torch.Tensor, image_seq_len: int) -> torch.Tensor:
        if self.auto_shift:
            mu = self.resolution_mu(image_seq_len)
            return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
        if self.shift == 1.0:
            return sigmas
        return self.shift * sigmas / (1 + (self.shift - 1) * sigmas)

    def sample_timesteps(self, batch: int, *, generator: torch.Generator, image_seq_len: int) -> torch.Tensor:
        if self.fast:  # drawn as they are: the distilled model's own steps, no shift
            choice = torch.randint(0, len(FAST_SCHEDULE_SIGMAS), (batch,), generator=generator)
            return torch.tensor(FAST_SCHEDULE_SIGMAS)[choice]
        if self.uniform:
            sigmas = torch.rand(batch, generator=generator)
        else:  # logit-normal: more mass mid-range
            sigmas = torch.sigmoid(self.sigmoid_scale * torch.randn(batch, generator=generator))
        return self.shift_sigmas(sigmas, image_seq_len)

    def add_noise(self, latents, noise, t):
        s = _per_sample(t, latents)
        return (1 - s) * latents + s * noise

    def target(self, latents, noise, t):
        return noise - latents

    def eval_timesteps(self) -> torch.Tensor:
        return torch.tensor(EVAL_FRACTIONS, dtype=torch.float32)

    def level_name(self, t: float) -> str:
        return f"sigma_{t:g}"

    def x0_from_prediction(self, pred, noisy, t):
        return noisy.float() - _per_sample(t, noisy).float() * pred.float()

    def noise_from_x0(self, x0, noisy, t):
        s = _per_sample(t, noisy).float()
        return (noisy.float() - (1 - s) * x0.float()) / s

    def from_train_timestep(self, t):
        return t.double() / 1000  # sigma; float64 so 1000 steps of a schedule stay exact

    def pipeline_timestep(self, scheduler, index: int) -> torch.Tensor:
        # what the pipeline tells its transformer: the step's timestep over num_train_timesteps, in float64 so an
        # adapter scaling it back by 1000 gets the pipeline's value exactly (DPM-Solver's flow schedule, used by
        # Sana, hands the transformer an integer timestep while stepping with the unrounded sigma)
        return (scheduler.timesteps[index].double() / scheduler.config.num_train_timesteps).reshape(1)


class DDPMObjective(Objective):
    """Epsilon or v-prediction on a DDPM schedule (diffusers' ``DDPMScheduler`` does the maths)."""

    def __init__(self, prediction_type: str, scheduler_config: Mapping[str, Any] | None = None, *,
                 rescale_zero_terminal_snr: bool = False, snr_gamma: float | None = None):
        from diffusers import DDPMScheduler

        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type: {prediction_type!r} is not a DDPM objective")
        self.name = prediction_type
        # the DDPM schedule's own keys only (a model may ship an Euler or DPM scheduler config)
        keys = set(DDPMScheduler.from_config({}).config)
        config = {k: v for k, v in dict(scheduler_config or {}).items() if k in keys and not k.startswith("_")}
        config.update(prediction_type=prediction_type, rescale_betas_zero_snr=rescale_zero_terminal_snr)
        self.scheduler = DDPMScheduler.from_config(config)
        self.num_train_timesteps = int(self.scheduler.config.num_train_timesteps)
        self.snr_gamma = float(snr_gamma) if snr_gamma else None

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at integer timesteps ``t`` (0 at a zero-SNR end)."""
        alpha_bar = self.scheduler.alphas_cumprod.to(torch.float64)[t.long().cpu()]
        return (alpha_bar / (1 - alpha_bar)).float()

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor | None:
        """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v-prediction (the
        v loss is already (SNR + 1) times the epsilon loss); 1 where SNR is 0 (the last step of a zero-SNR
        schedule, where the epsilon weight is undefined)."""
        if self.snr_gamma is None:
            return None
        snr = self.snr(t)
        divisor = snr + 1 if self.name == "v_prediction" else snr
        weights = snr.clamp(max=self.snr_gamma) / divisor
        return torch.where(divisor > 0, weights, torch.ones_like(weights)).to(t.device)

    def sample_timesteps(self, batch: int, *, generator: torch.Generator, image_seq_len: int) -> torch.Tensor:
        return torch.randint(0, self.num_train_timesteps, (batch,), generator=generator)

    def add_noise(self, latents, noise, t):
        return self.scheduler.add_noise(latents, noise, t.to(latents.device).long())

    def target(self, latents, noise, t):
        if self.name == "epsilon":
            return noise
        return self.scheduler.get_velocity(latents, noise, t.to(latents.device).long())

    def _alpha_bar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return _per_sample(self.scheduler.alphas_cumprod.to(torch.float64)[t.long().cpu()], like).float()

    def x0_from_prediction(self, pred, noisy, t):
        ab = self._alpha_bar(t, noisy)
        if self.name == "epsilon":
            return (noisy.float() - (1 - ab).sqrt() * pred.float()) / ab.sqrt()
        return ab.sqrt() * noisy.float() - (1 - ab).sqrt() * pred.float()

    def noise_from_x0(self, x0, noisy, t):
        ab = self._alpha_bar(t, noisy)
        return (noisy.float() - ab.sqrt() * x0.float()) / (1 - ab).sqrt()

    def from_train_timestep(self, t):
        # 1000 is the last training timestep (999 of a 1000-step schedule), 0 the first
        return (t.double() / 1000 * (self.num_train_timesteps - 1)).round().long()

    def eval_timesteps(self) -> torch.Tensor:
        last = self.num_train_timesteps - 1
        return torch.tensor([round(f * last) for f in EVAL_FRACTIONS], dtype=torch.long)

    def level_name(self, t: float) -> str:
        return f"t_{int(t)}"

    def pipeline_timestep(self, scheduler, index: int) -> torch.Tensor:
        return scheduler.timesteps[index].reshape(1).long()


def build_objective(config, scheduler_config: Mapping[str, Any] | None) -> Objective:
    """The objective ``config.prediction_type`` names, with the family's scheduler constants."""
    name = config.prediction_type or "flow_matching"
    if name == "flow_matching":
        return FlowMatching.from_config(config, scheduler_config or {})
    return DDPMObjective(name, scheduler_config, rescale_zero_terminal_snr=bool(config.rescale_betas_zero_snr),
                         snr_gamma=getattr(config, "snr_gamma", None))
