"""Validation of a distillation run: how close the student's few-step samples come to the teacher's, and what they
look like.

At the start the teacher samples ``distillation.validation_num_samples`` fixed noises (seeded by
``validation_seed``) with ``validation_num_inference_steps`` deterministic steps and ``real_guidance_scale``; at
each validation the student samples the same noises with 1, 2, 4, ... and all of its steps, and the mean squared
distance to the teacher's samples is a score (``distill/teacher_mse_<n>step``), logged to the trackers and sent in
one ``scores`` event. The student's samples of the validation prompts (``validation_prompt``, the
``user_prompt_library``, else the first distillation prompt) are decoded, written to
``<output_dir>/validation/step_<N>/<nickname>_<W>x<H>.png`` (and ``.mp4`` for video) and sent as ``image`` events,
like fine-tuning's validation images. Nothing here draws from the run's random generators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from simpletuner.evaluation.prompts import ValidationPrompt, validation_prompts
from simpletuner.evaluation.validation import preserve_rng_state, step_folder, to_pil, write_frames
from simpletuner.training.distill_sampling import ode_solve, step_subset, teacher_schedule

log = logging.getLogger("simpletuner.distill")


def step_counts(total: int) -> list[int]:
    """The step counts validation and the benchmark compare: 1, 2, 4, ... up to the student's ``total``, and it."""
    counts, n = [], 1
    while n < total:
        counts.append(n)
        n *= 2
    return counts + [total]


class StudentValidation:
    def __init__(self, config, adapter, text: Callable[[str | None], dict], latent_shape: tuple[int, ...],
                 student_steps: list[float], *, reporter, trackers=None, is_main: bool = True):
        """``text(prompt)`` gives a prompt's batched embedding on the device (``text(None)`` the negative)."""
        self.config = config
        self.d = config.distillation
        self.adapter = adapter
        self.text = text
        self.shape = latent_shape
        self.steps = student_steps
        self.reporter = reporter
        self.trackers = trackers
        self.is_main = is_main
        self.seed = config.validation_seed if config.validation_seed is not None else (config.seed or 0)
        self.prompts = self.prompts_of(config)
        self.every = config.validation_steps
        self.references: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (prompt, noise, teacher sample)
        self.last_step: int | None = None

    @staticmethod
    def prompts_of(config) -> list[ValidationPrompt]:
        """``validation_prompt`` and the ``user_prompt_library``, else the first of ``distillation.prompts``."""
        prompts = validation_prompts(config)
        first = (config.distillation.prompts or [None])[0]
        return prompts or ([ValidationPrompt("distill", first)] if first else [])

    @property
    def enabled(self) -> bool:
        return bool(self.every) and self.is_main and bool(self.prompts or self.references)

    def noise(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + index)
        return torch.randn((1, *self.shape), generator=generator).to(self.adapter.device)

    @torch.no_grad()
    def sample_teacher(self, teacher) -> None:
        """The teacher's reference samples (once per run, before training)."""
        if not (self.every and self.is_main and self.d.validation_num_samples and self.prompts):
            return
        schedule = teacher_schedule(self.config.validation_num_inference_steps, self.d.timestep_shift, [])
        uncond = self.text(None) if self.d.real_guidance_scale != 1.0 else None
        with preserve_rng_state():
            for i in range(self.d.validation_num_samples):
                prompt = self.prompts[i % len(self.prompts)].prompt
                cond = self.text(prompt)
                noise = self.noise(i)
                sample, _ = ode_solve(lambda x, t: teacher.guided(x, t, cond, uncond, self.d.real_guidance_scale),
                                      noise, schedule, self.adapter.objective)
                self.references.append((prompt, noise, sample))
        log.info("validation: %d teacher reference sample(s) in %d steps", len(self.references),
                 self.config.validation_num_inference_steps)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0 and step != self.last_step

    @torch.no_grad()
    def run(self, step: int, student) -> dict[str, float]:
        """Score and draw the student (a ``Denoiser``) at ``step``; returns the metrics (sent and logged here)."""
        self.last_step = step
        metrics: dict[str, float] = {}
        model = student.model
        was_training = model.training
        model.eval()
        try:
            with preserve_rng_state():
                metrics.update(self._scores(student))
                self._images(step, student)
        finally:
            model.train(was_training)
        if metrics:
            log.info("validation at step %d: %s", step, ", ".join(f"{k}={v:.5f}" for k, v in metrics.items()))
            if self.trackers is not None:
                self.trackers.log(metrics, step)
                self.trackers.flush()
            self.reporter.scores(step, metrics)
        return metrics

    def student_sample(self, student, prompt: str, noise: torch.Tensor, n: int, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + 10_000 + index)  # the consistency sampler's noise
        return student.rollout(noise, step_subset(self.steps, n), self.text(prompt), sampler=self.d.student_sampler,
                               generator=generator).sample

    def _scores(self, student) -> dict[str, float]:
        out = {}
        for n in step_counts(len(self.steps)) if self.references else []:
            errors = [(self.student_sample(student, prompt, noise, n, i) - reference).pow(2).mean().item()
                      for i, (prompt, noise, reference) in enumerate(self.references)]
            out[f"distill/teacher_mse_{n}step"] = sum(errors) / len(errors)
        return out

    def _images(self, step: int, student) -> None:
        if not self.prompts:
            return
        folder = step_folder(self.config.output_dir, step)
        folder.mkdir(parents=True, exist_ok=True)
        images = {}
        for i, item in enumerate(self.prompts):
            latents = self.student_sample(student, item.prompt, self.noise(i), len(self.steps), i)
            pixels = self.adapter.decode_latents(latents.to(self.adapter.device)).float().cpu()[0]
            frames = [to_pil(f) for f in pixels.unbind(1)] if pixels.ndim == 4 else [to_pil(pixels)]
            height, width = frames[0].height, frames[0].width
            path, video_path = write_frames(folder, f"{item.nickname}_{width}x{height}", frames, self.adapter)
            images[f"validation/{item.nickname}_{width}x{height}"] = frames[0]
            self.reporter.image("validation", step, path, prompt=item.prompt, nickname=item.nickname,
                                resolution=(width, height), video_path=video_path)
        if self.trackers is not None:
            self.trackers.log_images(images, step)
        log.info("validation: %d student sample(s) in %s", len(self.prompts), folder)
