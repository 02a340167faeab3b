"""Sampling for distillation: the student's few-step rollout, the teacher's ODE, and the timesteps the critic draws.

Timesteps here are on the 0..1000 scale of distillation step lists (1000 is pure noise, 0 the clean end), as
float64 tensors; the run's objective turns them into its own units (sigma for flow matching, an integer timestep for
DDPM), and every network is asked for its x0 through the family's adapter, so the same code serves every family.

- The student samples as DMD2 / Self-Forcing do: predict x0 at each step, then noise it to the next step, with fresh
  noise (``consistency``) or with its own predicted noise (``ode``: deterministic; an Euler step for flow matching).
- The teacher's ODE is the same ``ode`` step on a many-step shifted schedule that contains the student's timesteps,
  so its trajectory passes exactly through them (what ``distill-pairs`` stores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from simpletuner.config.distill import NUM_TRAIN_TIMESTEPS, shifted_timestep
from simpletuner.training.distill_losses import guided

# the critic and the DMD loss never draw the ends of the schedule (DMD2's 0.02 / 0.98)
MIN_STEP, MAX_STEP = 20, 980


@dataclass
class Rollout:
    """A student sample, and the step it came from: it denoised ``t_from`` at step ``exit_index`` (with autograd)
    and would have gone on to ``t_to`` (0 at the last step)."""

    sample: torch.Tensor
    t_from: float
    t_to: float
    exit_index: int


class Denoiser:
    """One network's x0 predictions: ``denoiser(x_t, t, text)`` with ``t`` (B,) on the 0..1000 scale, through the
    family's adapter and the run's objective, in float32. ``guided`` adds classifier-free guidance."""

    def __init__(self, adapter, model, autocast: Callable = contextlib.nullcontext):
        self.adapter = adapter
        self.model = model
        self.objective = adapter.objective
        self.autocast = autocast

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        units = self.objective.from_train_timestep(t).to(x_t.device)
        with self.autocast():
            pred = self.adapter.predict(self.model, x_t, units, text)
        return self.objective.x0_from_prediction(pred, x_t, units)

    def guided(self, x_t, t, text, uncond: dict[str, torch.Tensor] | None, scale: float) -> torch.Tensor:
        cond = self(x_t, t, text)
        if uncond is None or scale == 1.0:
            return cond
        return guided(cond, self(x_t, t, uncond), scale)

    def rollout(self, noise: torch.Tensor, steps: Sequence[float], text: dict[str, torch.Tensor], *, sampler: str,
                generator: torch.Generator | None = None, exit_index: int | list[int] | None = None) -> Rollout:
        """This network sampling from ``noise`` in ``steps`` (see ``rollout``)."""
        return rollout(lambda x, t: self(x, t, text), noise, steps, self.objective, sampler=sampler,
                       generator=generator, exit_index=exit_index)


class CausalDenoiser(Denoiser):
    """The causal (Self-Forcing) Wan student: x0 of a whole video under the block-causal mask at per-frame
    timesteps (B, F) (or one per sample, (B,)), and its rollout block by block with the KV cache, stopping each
    block at its own exit step (``exit_index``: one for every block, or a list with one per block)."""

    def __init__(self, adapter, model, layout, *, context_noise: float = 0.0, autocast: Callable = contextlib.nullcontext):
        super().__init__(adapter, model, autocast)
        self.layout = layout
        self.context_noise = context_noise

    def __call__(self, x_t, t, text):
        from simpletuner.models.causal_wan import causal_forward

        t = t if t.ndim == 2 else t[:, None].expand(-1, x_t.shape[2])
        with self.autocast():
            velocity = causal_forward(self.model, x_t, t, text["prompt_embeds"], self.layout)
        return x_t.float() - (t.float() / NUM_TRAIN_TIMESTEPS).to(x_t.device)[:, None, :, None, None] * velocity.float()

    def rollout(self, noise, steps, text, *, sampler, generator=None, exit_index=None) -> Rollout:
        from simpletuner.models.causal_wan import generate_blocks

        count = len(self.layout.blocks(noise.shape[2]))
        exits = [len(steps) - 1] * count if exit_index is None else (
            list(exit_index) if isinstance(exit_index, (list, tuple)) else [exit_index] * count)
        with self.autocast():
            blocks = list(generate_blocks(self.model, noise, text["prompt_embeds"], list(steps), self.layout,
                                          sampler=sampler, generator=generator, exit_indices=exits,
                                          context_noise=self.context_noise))
        sample = torch.cat([b.x0 for b in blocks], dim=2)
        if len(set(exits)) > 1:  # blocks stopped at different steps: no one step to bound the critic's timesteps
            return Rollout(sample, float(NUM_TRAIN_TIMESTEPS), 0.0, exits[0])
        i = exits[0]
        return Rollout(sample, float(steps[i]), float(steps[i + 1]) if i + 1 < len(steps) else 0.0, i)


def timesteps(value: float, batch: int, device=None) -> torch.Tensor:
    return torch.full((batch,), float(value), dtype=torch.float64, device=device)


def renoise(objective, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x0`` noised to ``t`` (0..1000 scale) with ``noise``, as the objective noises training latents."""
    return objective.add_noise(x0, noise.to(x0), objective.from_train_timestep(t).to(x0.device))


def step_subset(steps: Sequence[float], n: int) -> list[float]:
    """``n`` of the student's timesteps, evenly spaced from the first (1 step: [1000]; 2 of 4: the 1st and 3rd)."""
    if not 1 <= n <= len(steps):
        raise ValueError(f"{n} steps: the student has {len(steps)}")
    return [steps[round(i * len(steps) / n)] for i in range(n)]


def rollout(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
            steps: Sequence[float], objective, *, sampler: str, generator: torch.Generator | None = None,
            exit_index: int | None = None) -> Rollout:
    """The student's sampling from ``noise`` over ``steps`` (0..1000, most noisy first), stopping at
    ``exit_index`` (default: the last step). Steps before it run without autograd; the exit step's x0 prediction
    is returned as the caller's grad mode has it (Self-Forcing's backward simulation). ``sampler`` 'consistency'
    draws the re-noising noise from ``generator``; 'ode' uses the student's own predicted noise."""
    last = len(steps) - 1 if exit_index is None else exit_index
    x = noise
    batch = noise.shape[0]
    for i in range(last):
        t = timesteps(steps[i], batch, noise.device)
        with torch.no_grad():
            x0 = denoise(x, t)
            if sampler == "consistency":
                eps = torch.randn(x.shape, generator=generator).to(x)
            else:
                eps = objective.noise_from_x0(x0, x, objective.from_train_timestep(t).to(x.device))
            x = renoise(objective, x0, eps, timesteps(steps[i + 1], batch, noise.device)).to(noise.dtype)
    sample = denoise(x, timesteps(steps[last], batch, noise.device))
    t_to = float(steps[last + 1]) if last + 1 < len(steps) else 0.0
    return Rollout(sample, float(steps[last]), t_to, last)


def teacher_schedule(num_steps: int, shift: float, student_steps: Sequence[float]) -> list[float]:
    """The teacher's ODE timesteps: ``num_steps`` uniform steps through the shifted schedule, with the student's
    timesteps added so the trajectory passes through each, most noisy first, ending at 0."""
    base = [shifted_timestep(NUM_TRAIN_TIMESTEPS * (1 - i / num_steps), shift) for i in range(num_steps)]
    merged = sorted({round(float(t), 9) for t in [*base, *student_steps] if t > 0}, reverse=True)
    return merged + [0.0]


@torch.no_grad()
def ode_solve(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
              schedule: Sequence[float], objective, record: Sequence[float] = ()) -> tuple[torch.Tensor, list]:
    """Deterministic sampling (x0 prediction, then its own noise to the next step: Euler for flow matching, DDIM
    for DDPM) over ``schedule`` (ending at 0). Returns (the sample, [x_t at each ``record`` timestep])."""
    wanted = {round(float(t), 9): i for i, t in enumerate(record)}
    kept: list[torch.Tensor | None] = [None] * len(record)
    x = noise
    batch = noise.shape[0]
    for t_now, t_next in zip(schedule[:-1], schedule[1:]):
        key = round(float(t_now), 9)
        if key in wanted:
            kept[wanted[key]] = x.clone()
        t = timesteps(t_now, batch, noise.device)
        x0 = denoise(x, t)
        if t_next <= 0:
            x = x0
            break
        eps = objective.noise_from_x0(x0, x, objective.from_train_timestep(t).to(x.device))
        x = renoise(objective, x0, eps, timesteps(t_next, batch, noise.device)).to(noise.dtype)
    missing = [t for t, i in wanted.items() if kept[i] is None]
    if missing:
        raise ValueError(f"the teacher's schedule does not pass through timesteps {missing}")
    return x, kept


def unshifted_timestep(t: float, shift: float) -> float:
    """The inverse of ``shifted_timestep``: where a shifted 0..1000 timestep sits on the unshifted schedule."""
    s = t / NUM_TRAIN_TIMESTEPS
    return NUM_TRAIN_TIMESTEPS * s / (shift - (shift - 1) * s)


def critic_timesteps(batch: int, generator: torch.Generator, shift: float, low: float = 0.0,
                     high: float = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """Timesteps (B,) for the critic's denoising loss, the DMD/SiD loss and the GAN branch, as Self-Forcing draws
    them: uniform integers in [low, high) on the unshifted schedule, through the shift, kept inside
    [MIN_STEP, MAX_STEP]."""
    low, high = int(low), max(int(high), int(low) + 1)
    t = torch.randint(low, high, (batch,), generator=generator).double()
    if shift != 1.0:
        s = t / NUM_TRAIN_TIMESTEPS
        t = NUM_TRAIN_TIMESTEPS * shift * s / (1 + (shift - 1) * s)
    return t.clamp(MIN_STEP, MAX_STEP)
