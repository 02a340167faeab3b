"""The teacher's ODE trajectories that ODE regression (and the GAN branch) learn from, sampled from prompts alone
and stored with the cache machinery (``simpletuner distill-pairs``, or the distillation run itself, makes them).

Each prompt gets ``ode_pairs_per_prompt`` trajectories, each from its own noise. A trajectory is the teacher's
deterministic sampling (``distill_sampling.ode_solve``, with ``real_guidance_scale`` classifier-free guidance against
``negative_prompt``) over ``teacher_num_inference_steps`` shifted steps that include the student's timesteps; it is
stored as ``{"trajectory": (S + 1, *latent_shape), "timesteps": (S + 1,)}``: x_t at each of the student's S timesteps,
then the sample (timestep 0).

The cache is keyed by identity, never by position: a pair's key hashes (prompt, its index, the seed, the teacher's
weights and objective, the text encoders, the schedule, guidance, negative prompt, latent shape), and its noise is
drawn from a generator seeded by the same (seed, prompt, index), so a pair is the same whichever process makes it,
whenever, and in whichever batch (``train_batch_size`` trajectories are sampled at once). A stopped run resumes
where it was (stored pairs are skipped; a damaged one is reported by name and made again); ranks split the pairs
between them by position (``--num_processes N``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from simpletuner.data.cache import TensorCache
from simpletuner.training.distill_sampling import Denoiser, ode_solve, teacher_schedule

log = logging.getLogger("simpletuner.distill")


@dataclass(frozen=True)
class PairSpec:
    """One trajectory: which prompt, which of its pairs, and its cache key."""

    prompt: str
    index: int
    key: str


def pair_identity(config, adapter, latent_shape: tuple[int, ...], student_steps: list[float]) -> str:
    """Everything a trajectory depends on besides its prompt and index (a cache-key ingredient)."""
    d = config.distillation
    path, subfolder = adapter.denoiser_source()
    return json.dumps({
        "teacher": adapter.component_identity(subfolder if subfolder not in ("", "none", None) else "transformer"),
        "teacher_path": str(path), "objective": adapter.objective.name, "text": adapter.text_cache_identity(),
        "schedule": teacher_schedule(d.teacher_num_inference_steps, d.timestep_shift, student_steps),
        "record": [round(float(t), 9) for t in student_steps], "guidance": d.real_guidance_scale,
        "negative": d.negative_prompt if d.real_guidance_scale != 1.0 else None,
        "guidance_value": getattr(config, "guidance_value", None), "shape": list(latent_shape), "seed": config.seed or 0,
    }, sort_keys=True)


def pair_specs(prompts: list[str], per_prompt: int, identity: str) -> list[PairSpec]:
    """Every trajectory of the run, in prompt order (deduplicated prompts)."""
    specs = []
    for prompt in dict.fromkeys(prompts):
        for index in range(per_prompt):
            key = hashlib.sha256(json.dumps([prompt, index, identity]).encode()).hexdigest()
            specs.append(PairSpec(prompt, index, key))
    return specs


def pair_noise(seed: int, prompt: str, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The starting noise of one trajectory, drawn from a generator seeded by (seed, prompt, index) only."""
    digest = hashlib.sha256(json.dumps([seed, prompt, index]).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn((1, *shape), generator=generator)


def fill_pairs(config, adapter, teacher, specs: list[PairSpec], cache: TensorCache, text, *,
               latent_shape: tuple[int, ...], student_steps: list[float], rank: int = 0, world_size: int = 1,
               autocast=None, show_progress: bool = True) -> int:
    """Make the missing trajectories of this rank's share (``specs[rank::world_size]``: shares never depend on what
    another rank has stored already), ``train_batch_size`` at a time; returns how many it made. ``text(prompts)``
    gives the prompts' batched embeddings and ``text(None)`` the negative prompt's (batch of one)."""
    d = config.distillation
    schedule = teacher_schedule(d.teacher_num_inference_steps, d.timestep_shift, student_steps)
    todo = [s for s in specs[rank::world_size] if not cache.has(s.key)]
    if not todo:
        return 0
    denoiser = Denoiser(adapter, teacher, **({"autocast": autocast} if autocast else {}))
    negative = text(None) if d.real_guidance_scale != 1.0 else None
    device = adapter.device
    record = [float(t) for t in student_steps]
    stamps = torch.tensor([*record, 0.0], dtype=torch.float64)
    batch = max(1, int(config.train_batch_size))
    bar = tqdm(total=len(todo), desc="Teacher trajectories", disable=not show_progress)
    for start in range(0, len(todo), batch):
        chunk = todo[start:start + batch]
        # each pair's own noise: a batch is the same pairs as one at a time
        noise = torch.cat([pair_noise(config.seed or 0, s.prompt, s.index, latent_shape) for s in chunk]).to(device)
        cond = text([s.prompt for s in chunk])
        uncond = {k: v.expand(len(chunk), *v.shape[1:]) for k, v in negative.items()} if negative else None
        sample, points = ode_solve(lambda x, t: denoiser.guided(x, t, cond, uncond, d.real_guidance_scale), noise,
                                   schedule, adapter.objective, record)
        trajectories = torch.stack([*points, sample], dim=1).float().cpu()
        for spec, trajectory in zip(chunk, trajectories):
            cache.save(spec.key, {"trajectory": trajectory.contiguous(), "timesteps": stamps})
        bar.update(len(chunk))
    bar.close()
    return len(todo)
