"""The teacher's trajectories for ODE regression: keyed by identity, split between ranks, resumable, a damaged one
made again, and each one really the teacher's ODE through the student's timesteps."""

from __future__ import annotations

import pytest
import torch

from simpletuner.config import load_train_config
from simpletuner.data.cache import TensorCache
from simpletuner.training.distill_pairs import fill_pairs, pair_identity, pair_noise, pair_specs
from simpletuner.training.distill_sampling import Denoiser, ode_solve, teacher_schedule

STEPS = [1000.0, 750.0, 500.0, 250.0]
SHAPE = (4, 4, 4)  # the tiny Flux's latents at 32x32


def config_with(train_batch_size: int = 1, **distillation):
    values = {"objective": "ode_regression", "prompts": ["a red circle", "a blue square"],
              "teacher_num_inference_steps": 3, "ode_pairs_per_prompt": 2, **distillation}
    return load_train_config({"model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0,
                              "max_train_steps": 1, "data_backend_config": "x", "train_batch_size": train_batch_size,
                              "distillation": values}).config


@pytest.fixture(scope="module")
def teacher():
    from simpletuner.models.flux import FluxAdapter

    adapter = FluxAdapter(config_with())
    model = adapter.load_transformer().eval()
    embeddings = {p: adapter.encode_prompts([p])[0].tensors for p in ["a red circle", "a blue square"]}
    def text(prompts):
        return {k: torch.stack([embeddings[p][k] for p in prompts]) for k in embeddings[prompts[0]]}

    return adapter, model, text


def test_keys_follow_identity_not_position(teacher):
    adapter = teacher[0]
    config = config_with()
    identity = pair_identity(config, adapter, SHAPE, STEPS)
    specs = pair_specs(config.distillation.prompts, 2, identity)
    assert len(specs) == 4 and len({s.key for s in specs}) == 4
    reordered = pair_specs(list(reversed(config.distillation.prompts)) * 2, 2, identity)  # dupes dropped
    assert {s.key for s in reordered} == {s.key for s in specs}
    for change in ({"real_guidance_scale": 3.0}, {"teacher_num_inference_steps": 5}, {"timestep_shift": 3.0}):
        other = pair_identity(config_with(**change), adapter, SHAPE, STEPS)
        assert other != identity, change
    assert pair_identity(config, adapter, SHAPE, STEPS[:2]) != identity
    assert pair_identity(config, adapter, (4, 8, 8), STEPS) != identity
    assert torch.equal(pair_noise(0, "a", 1, SHAPE), pair_noise(0, "a", 1, SHAPE))
    assert not torch.equal(pair_noise(0, "a", 1, SHAPE), pair_noise(0, "a", 0, SHAPE))


def test_ranks_split_the_work_resume_and_remake_a_damaged_pair(teacher, tmp_path):
    adapter, model, text = teacher
    config = config_with()
    cache = TensorCache(tmp_path / "pairs")
    specs = pair_specs(config.distillation.prompts, 2, pair_identity(config, adapter, SHAPE, STEPS))
    kwargs = dict(latent_shape=SHAPE, student_steps=STEPS, show_progress=False)
    assert fill_pairs(config, adapter, model, specs, cache, text, rank=1, world_size=2, **kwargs) == 2
    stored = {s.key for s in specs if cache.has(s.key)}
    assert stored == {specs[1].key, specs[3].key}  # rank 1 of 2: every other pair
    assert fill_pairs(config, adapter, model, specs, cache, text, rank=1, world_size=2, **kwargs) == 0
    assert fill_pairs(config, adapter, model, specs, cache, text, rank=0, world_size=2, **kwargs) == 2
    assert all(cache.has(s.key) for s in specs)
    assert fill_pairs(config, adapter, model, specs, cache, text, **kwargs) == 0  # resumed: nothing left
    cache.path(specs[2].key).write_bytes(b"cut short")
    assert fill_pairs(config, adapter, model, specs, cache, text, **kwargs) == 1  # damaged: made again

    entry = cache.load(specs[2].key)
    trajectory = entry["trajectory"]
    assert trajectory.shape == (len(STEPS) + 1, *SHAPE)
    assert entry["timesteps"].tolist() == [*STEPS, 0.0]
    noise = pair_noise(0, specs[2].prompt, specs[2].index, SHAPE)
    torch.testing.assert_close(trajectory[0], noise[0])  # x at t = 1000 is the pair's own noise
    schedule = teacher_schedule(3, 1.0, STEPS)
    sample, points = ode_solve(lambda x, t: Denoiser(adapter, model)(x, t, text([specs[2].prompt])), noise,
                               schedule, adapter.objective, STEPS)
    torch.testing.assert_close(trajectory[-1], sample[0])
    torch.testing.assert_close(trajectory[2], points[2][0])  # the ODE's point at t = 500

    # four at once (train_batch_size 4) are the same trajectories as one at a time
    batched = TensorCache(tmp_path / "batched")
    assert fill_pairs(config_with(train_batch_size=4), adapter, model, specs, batched, text, **kwargs) == 4
    for spec in specs:
        torch.testing.assert_close(batched.load(spec.key)["trajectory"], cache.load(spec.key)["trajectory"],
                                   rtol=1e-5, atol=1e-5)
