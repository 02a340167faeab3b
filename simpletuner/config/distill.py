"""``distillation``: the settings of the distillation recipe (``simpletuner/training/distill.py``).

A config with a ``distillation`` block turns a many-step teacher (the config's model: ``model_family``,
``model_flavour``, ``pretrained_model_name_or_path``) into a few-step student. The objectives follow the
Self-Forcing / CausVid / DMD2 papers:

- ``ode_regression``: the student regresses the teacher's ODE endpoint x0 from points of the teacher's own sampling
  trajectories (stored by ``simpletuner distill-pairs``);
- ``dmd``: distribution matching: the real score is the frozen teacher (with classifier-free guidance), the fake
  score (the critic) learns the student's samples with the denoising loss, and the student follows the difference of
  their x0 predictions;
- ``sid``: score identity distillation, the same two scores in SiD's loss;
- ``gan``: a classification branch on the critic tells the teacher's samples from the student's over noisy latents
  (relativistic or not, with R1/R2); combinable as ``dmd+gan`` and ``sid+gan``.

Timesteps in this block are in the scheduler's 0..1000 units, as in the papers' configs.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .coerce import Int, StrictModel
from .errors import ConfigError, FieldError

OBJECTIVES = ("ode_regression", "dmd", "sid", "gan")
# combinations a run may train: one objective, or a score-distillation objective with the GAN term beside it
COMBINATIONS = ("ode_regression", "dmd", "sid", "gan", "dmd+gan", "sid+gan")
NUM_TRAIN_TIMESTEPS = 1000
# settings read by some objectives only: changed for a run without them, they are refused (never silently ignored)
_CRITIC = ("dmd", "sid", "gan")
APPLIES_TO = {
    "fake_guidance_scale": ("dmd", "sid"), "generator_update_ratio": _CRITIC, "critic_learning_rate": _CRITIC,
    "ts_schedule": _CRITIC, "ts_schedule_max": _CRITIC, "sid_alpha": ("sid",), "gan_generator_weight": ("gan",),
    "gan_critic_weight": ("gan",), "relativistic_discriminator": ("gan",), "r1_weight": ("gan",),
    "r2_weight": ("gan",), "r1_sigma": ("gan",), "r2_sigma": ("gan",),
    "teacher_num_inference_steps": ("ode_regression", "gan"), "ode_pairs_per_prompt": ("ode_regression", "gan"),
}
CAUSAL_ONLY = ("num_frame_per_block", "local_attn_size", "same_step_across_blocks", "last_step_only",
               "independent_first_frame", "context_noise")


class DistillationConfig(StrictModel):
    """The ``distillation`` block of config.json."""

    objective: Literal[COMBINATIONS] = Field(
        "dmd", description="ode_regression, dmd, sid, gan, or dmd+gan / sid+gan (the GAN term beside the score "
                           "distillation loss)")
    prompts: Optional[list[str]] = Field(
        None, description="prompts the student learns to draw (no images needed); with or instead of prompt_file")
    prompt_file: Optional[str] = Field(
        None, description="a text file of prompts, one per line (blank lines skipped)", json_schema_extra={"path": "file"})
    negative_prompt: str = Field(
        "", description="the unconditional prompt of classifier-free guidance (teacher and critic)")
    real_guidance_scale: float = Field(
        1.0, ge=0, description="classifier-free guidance of the teacher: the real score of dmd/sid and the teacher's "
                               "ODE in distill-pairs (uncond + scale * (cond - uncond); 1 = off)")
    fake_guidance_scale: float = Field(
        1.0, ge=0, description="classifier-free guidance of the critic's fake score (1 = off)")
    denoising_step_list: list[Int] = Field(
        default_factory=lambda: [1000, 750, 500, 250],
        description="the student's timesteps, most noisy first, in 0..1000; a trailing 0 (the clean end) is allowed")
    timestep_shift: float = Field(
        1.0, gt=0, description="shift of the noise schedule (as Wan's and SD3's shift): warps the step list with "
                               "warp_denoising_step, and the timesteps the critic and the DMD loss draw")
    warp_denoising_step: bool = Field(
        False, description="map denoising_step_list through the shifted schedule (1000, 750, 500, 250 at shift 5 "
                           "become 1000, 937, 833, 625)")
    student_sampler: Optional[Literal["consistency", "ode"]] = Field(
        None, description="how the student steps between its timesteps: 'consistency' re-noises its x0 with fresh "
                          "noise (DMD2, Self-Forcing), 'ode' with its own predicted noise (deterministic: an Euler step "
                          "for flow matching); empty = 'ode' for ode_regression, else 'consistency'")
    student_init: Optional[str] = Field(
        None, description="start the student from this transformer folder (e.g. an ode_regression run's "
                          "output/transformer) instead of the teacher's weights", json_schema_extra={"path": "model"})
    generator_update_ratio: Int = Field(
        5, ge=1, le=1000, description="the critic trains every step, the student every n-th step "
                                      "(Self-Forcing's dfake_gen_update_ratio); ode_regression trains the student only")
    generator_learning_rate: Optional[float] = Field(
        None, gt=0, description="the student's learning rate; empty = learning_rate")
    critic_learning_rate: Optional[float] = Field(
        None, gt=0, description="the critic's learning rate; empty = learning_rate")
    ts_schedule: bool = Field(
        False, description="draw the critic's and the DMD loss's timesteps no lower than the student's next step "
                           "(the noise level the rollout stopped at)")
    ts_schedule_max: bool = Field(
        False, description="and no higher than the step the rollout's last student call denoised from")
    sid_alpha: float = Field(1.0, ge=0, description="SiD's alpha (1.0 or 1.2 in the paper)")
    gan_generator_weight: float = Field(
        1e-2, ge=0, description="weight of the GAN term in the student's loss (gan_g_weight)")
    gan_critic_weight: float = Field(
        1e-2, ge=0, description="weight of the GAN classification loss in the critic's loss (gan_d_weight)")
    relativistic_discriminator: bool = Field(
        False, description="relativistic GAN loss: the teacher's sample scored against the student's")
    r1_weight: float = Field(0.0, ge=0, description="R1 penalty on the classifier around the teacher's samples")
    r2_weight: float = Field(0.0, ge=0, description="R2 penalty on the classifier around the student's samples")
    r1_sigma: float = Field(0.01, gt=0, description="perturbation of the finite-difference R1 penalty")
    r2_sigma: float = Field(0.01, gt=0, description="perturbation of the finite-difference R2 penalty")
    teacher_num_inference_steps: Int = Field(
        50, ge=2, le=10_000, description="steps of the teacher's ODE that distill-pairs samples (Euler, on the "
                                         "shifted schedule with the student's timesteps in it)")
    ode_pairs_per_prompt: Int = Field(
        1, ge=1, le=100_000, description="teacher trajectories per prompt (each from its own noise)")
    pairs_cache_dir: str = Field(
        "cache/distill_pairs", description="where distill-pairs stores the teacher's trajectories",
        json_schema_extra={"path": "dir"})
    num_frames: Optional[Int] = Field(
        None, ge=1, description="video families: frames of the student's clips (4k + 1 for Wan); empty = the "
                                "family's validation length")
    causal: bool = Field(
        False, description="Self-Forcing: the student is a causal Wan that makes the video block by block, each block "
                           "attending to the blocks before it through a KV cache (model_family wan)")
    num_frame_per_block: Int = Field(3, ge=1, le=1000, description="latent frames per block of the causal student")
    local_attn_size: Int = Field(
        -1, ge=-1, le=100_000, description="latent frames a block attends to, itself included; -1 = every earlier frame")
    same_step_across_blocks: bool = Field(
        True, description="the rollout stops every block at the same random step (else a random step per block)")
    last_step_only: bool = Field(False, description="the rollout always stops at the student's last step")
    independent_first_frame: bool = Field(
        False, description="the first block is one latent frame, then blocks of num_frame_per_block")
    context_noise: Int = Field(
        0, ge=0, le=1000, description="timestep a finished block is noised to before its keys and values become the "
                                      "context of the next blocks (0 = clean)")
    validation_num_samples: Int = Field(
        2, ge=0, le=64, description="fixed noises the student's samples are compared on with the teacher's at each "
                                    "validation (scores distill/teacher_mse_<n>step); 0 = none")

    @field_validator("objective", mode="before")
    @classmethod
    def _spelling(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            value = "+".join(str(v) for v in value)
        if isinstance(value, str):
            parts = [p for p in re.split(r"\s*\+\s*", value.strip().lower()) if p]
            if any(p not in OBJECTIVES for p in parts):
                bad = next(p for p in parts if p not in OBJECTIVES)
                raise ValueError(f"{bad!r} is not one of {', '.join(OBJECTIVES)} (combine as dmd+gan or sid+gan)")
            order = sorted(parts, key=OBJECTIVES.index)
            joined = "+".join(dict.fromkeys(order))
            if joined not in COMBINATIONS:
                raise ValueError(f"{value!r} cannot be combined; one of {', '.join(COMBINATIONS)}")
            return joined
        return value

    @model_validator(mode="after")
    def _check(self) -> DistillationConfig:
        errors: list[FieldError] = []
        steps = self.denoising_step_list
        if not steps:
            errors.append(FieldError("denoising_step_list", "needs at least one timestep, e.g. [1000, 750, 500, 250]"))
        for i, value in enumerate(steps):
            if not 0 <= value <= NUM_TRAIN_TIMESTEPS:
                errors.append(FieldError(f"denoising_step_list[{i}]", f"{value} is outside 0..{NUM_TRAIN_TIMESTEPS}"))
            elif i and value >= steps[i - 1]:
                errors.append(FieldError(f"denoising_step_list[{i}]", f"{value} is not below the step before it "
                                                                      f"({steps[i - 1]}); list the most noisy first"))
            elif value == 0 and i != len(steps) - 1:
                errors.append(FieldError(f"denoising_step_list[{i}]", "0 (the clean end) may only come last"))
        if steps and steps[0] == 0:
            errors.append(FieldError("denoising_step_list[0]", "the first step must be a noise level above 0"))
        if self.prompts is not None:
            for i, prompt in enumerate(self.prompts):
                if not prompt.strip():
                    errors.append(FieldError(f"prompts[{i}]", "is empty"))
        if self.prompts is not None and not self.prompts and not self.prompt_file:
            errors.append(FieldError("prompts", "is an empty list; give prompts or a prompt_file"))
        for name, wanted in APPLIES_TO.items():
            # a non-default value, so a dumped config (every field written out) reads back as it was
            changed = getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)
            if changed and not set(wanted) & set(self.objectives):
                errors.append(FieldError(name, f"applies to {' and '.join(wanted)}; objective is {self.objective!r}"))
        for name in CAUSAL_ONLY:
            changed = getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)
            if changed and not self.causal:
                errors.append(FieldError(name, "applies to a causal student; set causal: true"))
        if self.local_attn_size != -1 and self.local_attn_size < self.num_frame_per_block:
            errors.append(FieldError("local_attn_size", f"{self.local_attn_size} frames is less than a block "
                                                        f"(num_frame_per_block {self.num_frame_per_block}); -1 or at "
                                                        "least a block"))
        if errors:
            raise ConfigError(errors)
        if self.student_sampler is None:
            self.student_sampler = "ode" if self.objective == "ode_regression" else "consistency"
        return self

    # ---- derived values ----
    @property
    def objectives(self) -> tuple[str, ...]:
        """The objectives trained, e.g. ("dmd", "gan")."""
        return tuple(self.objective.split("+"))

    @property
    def has_critic(self) -> bool:
        """A fake-score network is trained (every objective but ode_regression)."""
        return self.objective != "ode_regression"

    @property
    def uses_pairs(self) -> bool:
        """The run reads the teacher's stored trajectories: ode_regression regresses them, gan's classifier takes
        their endpoints as the real samples."""
        return "ode_regression" in self.objectives or "gan" in self.objectives

    @property
    def student_timesteps(self) -> list[int]:
        """The student's sampling steps: the step list without a trailing 0 (the clean end)."""
        return [t for t in self.denoising_step_list if t > 0]


def shifted_timestep(t: float, shift: float) -> float:
    """A 0..1000 timestep through the shifted schedule: ``shift * s / (1 + (shift - 1) * s)`` of ``s = t / 1000``."""
    s = t / NUM_TRAIN_TIMESTEPS
    return NUM_TRAIN_TIMESTEPS * shift * s / (1 + (shift - 1) * s)


def warped_step_list(config: DistillationConfig) -> list[float]:
    """``denoising_step_list`` as the student samples it: through the shifted schedule with ``warp_denoising_step``
    (float timesteps in 0..1000), else as given."""
    if not config.warp_denoising_step:
        return [float(t) for t in config.denoising_step_list]
    return [shifted_timestep(float(t), config.timestep_shift) for t in config.denoising_step_list]
