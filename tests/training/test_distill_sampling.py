"""The student's rollout and the teacher's ODE against the textbook samplers (Euler for flow matching, DDIM for
DDPM) on toy networks, autograd only at the exit step, and the timesteps the critic draws."""

from __future__ import annotations

import types

import pytest
import torch

from simpletuner.config.distill import shifted_timestep
from simpletuner.models.objectives import DDPMObjective, FlowMatching
from simpletuner.training.distill_sampling import (MAX_STEP, MIN_STEP, Denoiser, critic_timesteps, ode_solve,
                                                   rollout, step_subset, teacher_schedule, unshifted_timestep)


class Toy(torch.nn.Module):
    """A network whose prediction is a smooth function of (x, t), with one trainable scale."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.7))
        self.grad_calls = 0

    def forward(self, x, t):
        if torch.is_grad_enabled():
            self.grad_calls += 1
        return self.scale * torch.tanh(x) + 0.1 * t.float().view(-1, *([1] * (x.ndim - 1)))


def toy_denoiser(objective, model):
    adapter = types.SimpleNamespace(objective=objective, predict=lambda m, x, t, text: m(x, t))
    return Denoiser(adapter, model)


STEPS = [1000.0, 750.0, 500.0, 250.0]


def test_ode_rollout_is_euler_for_flow_matching():
    objective, model = FlowMatching(), Toy()
    denoise = toy_denoiser(objective, model)
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="ode").sample
        x = noise.clone()
        sigmas = [s / 1000 for s in STEPS] + [0.0]
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = model(x, torch.full((2,), s))
            x = x + (s_next - s) * v  # Euler on the velocity field
    torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)


def test_ode_rollout_is_ddim_for_epsilon():
    objective, model = DDPMObjective("epsilon", {}), Toy()
    denoise = toy_denoiser(objective, model)
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    ab = objective.scheduler.alphas_cumprod.double()
    with torch.no_grad():
        got = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="ode").sample
        x = noise.double()
        ts = [int(round(s / 1000 * 999)) for s in STEPS]
        for i, t in enumerate(ts):
            eps = model(x.float(), torch.full((2,), t)).double()
            x0 = (x - (1 - ab[t]).sqrt() * eps) / ab[t].sqrt()
            if i + 1 == len(ts):
                x = x0
            else:  # DDIM, eta = 0
                x = ab[ts[i + 1]].sqrt() * x0 + (1 - ab[ts[i + 1]]).sqrt() * eps
    torch.testing.assert_close(got, x.float(), rtol=1e-4, atol=1e-4)


def test_consistency_rollout_renoises_with_the_generators_noise():
    objective, model = FlowMatching(), Toy()
    denoise = toy_denoiser(objective, model)
    noise = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="consistency",
                    generator=torch.Generator().manual_seed(5)).sample
        b = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="consistency",
                    generator=torch.Generator().manual_seed(5)).sample
        c = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="consistency",
                    generator=torch.Generator().manual_seed(6)).sample
        # by hand: predict x0, noise it to the next step with the generator's next draw
        g = torch.Generator().manual_seed(5)
        x = noise
        for s, s_next in zip(STEPS, STEPS[1:]):
            x0 = denoise(x, torch.full((1,), s, dtype=torch.float64), {})
            x = (1 - s_next / 1000) * x0 + s_next / 1000 * torch.randn(x.shape, generator=g)
        last = denoise(x, torch.full((1,), STEPS[-1], dtype=torch.float64), {})
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(a, last)


@pytest.mark.parametrize("exit_index", [0, 2, 3])
def test_rollout_keeps_autograd_only_at_its_exit_step(exit_index):
    objective, model = FlowMatching(), Toy()
    denoise = toy_denoiser(objective, model)
    out = rollout(lambda x, t: denoise(x, t, {}), torch.randn(1, 4), STEPS, objective, sampler="consistency",
                  generator=torch.Generator().manual_seed(0), exit_index=exit_index)
    assert model.grad_calls == 1 and out.sample.requires_grad
    assert out.t_from == STEPS[exit_index]
    assert out.t_to == (STEPS[exit_index + 1] if exit_index + 1 < len(STEPS) else 0.0)
    out.sample.sum().backward()
    assert model.scale.grad is not None


def test_teacher_schedule_passes_through_the_student_steps():
    student = [shifted_timestep(t, 5.0) for t in STEPS]
    schedule = teacher_schedule(10, 5.0, student)
    assert schedule[0] == 1000.0 and schedule[-1] == 0.0
    assert schedule == sorted(schedule, reverse=True) and len(set(schedule)) == len(schedule)
    assert all(round(t, 9) in schedule for t in student)
    assert len(schedule) == 10 + 1 + len({round(t, 9) for t in student} - {round(shifted_timestep(1000 * (1 - i / 10), 5.0), 9) for i in range(10)})


def test_ode_solve_records_the_trajectory_and_matches_the_ode_rollout():
    objective, model = FlowMatching(), Toy()
    denoise = toy_denoiser(objective, model)
    noise = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(3))
    sample, points = ode_solve(lambda x, t: denoise(x, t, {}), noise, [*STEPS, 0.0], objective, record=STEPS)
    torch.testing.assert_close(points[0], noise)  # t = 1000 is the noise itself
    with torch.no_grad():
        same = rollout(lambda x, t: denoise(x, t, {}), noise, STEPS, objective, sampler="ode").sample
        from_second = rollout(lambda x, t: denoise(x, t, {}), points[1], STEPS[1:], objective, sampler="ode").sample
    torch.testing.assert_close(sample, same)
    torch.testing.assert_close(from_second, same)  # each stored point lies on the trajectory
    with pytest.raises(ValueError, match="does not pass through"):
        ode_solve(lambda x, t: denoise(x, t, {}), noise, [1000.0, 0.0], objective, record=[500.0])


def test_critic_timesteps_stay_inside_the_schedule_and_the_window():
    g = torch.Generator().manual_seed(0)
    t = critic_timesteps(4096, g, 1.0)
    assert t.min() >= MIN_STEP and t.max() <= MAX_STEP
    window = critic_timesteps(4096, g, 1.0, low=250, high=500)
    assert window.min() >= 250 and window.max() < 500
    shifted = critic_timesteps(4096, g, 5.0, low=250, high=500)
    assert shifted.min() >= shifted_timestep(250, 5.0) - 1e-9 and shifted.max() < shifted_timestep(500, 5.0)
    for t in (0.0, 125.0, 833.0, 1000.0):
        assert unshifted_timestep(shifted_timestep(t, 5.0), 5.0) == pytest.approx(t)


def test_step_subsets():
    assert step_subset(STEPS, 1) == [1000.0]
    assert step_subset(STEPS, 2) == [1000.0, 500.0]
    assert step_subset(STEPS, 4) == STEPS
    with pytest.raises(ValueError):
        step_subset(STEPS, 5)


@pytest.mark.parametrize("objective", [FlowMatching(), DDPMObjective("epsilon", {}), DDPMObjective("v_prediction", {})],
                         ids=["flow", "epsilon", "v"])
@pytest.mark.parametrize("steps", [STEPS, [shifted_timestep(t, 3.0) for t in STEPS]], ids=["plain", "shifted"])
def test_ode_regression_learns_where_the_ode_student_samples(objective, steps):
    """ODE regression with the ode sampler trains at the points the student's own deterministic steps visit: a
    student whose x0 is the trajectory's end X at those points is fed exactly them, in every step subset, and its
    sample is X. The teacher's curved trajectory points are not where it samples."""
    from simpletuner.training.distill import sampler_points
    from simpletuner.training.distill_sampling import renoise, timesteps

    generator = torch.Generator().manual_seed(3)
    end = torch.randn(2, 3, 4, 4, generator=generator)
    start = renoise(objective, end, torch.randn(2, 3, 4, 4, generator=generator), timesteps(steps[0], 2))
    bend = 0.3 * torch.randn(2, 3, 4, 4, generator=generator)  # a curved trajectory: off the straight line
    trajectory = torch.stack([start, *[renoise(objective, end, start, timesteps(t, 2)) + bend for t in steps[1:]], end],
                             dim=1)
    for n in (1, 2, 4):
        subset = step_subset(steps, n)
        fed = []

        def student(x, t):
            fed.append(x.clone())
            return end.clone()

        sample = rollout(student, trajectory[:, 0], subset, objective, sampler="ode").sample
        torch.testing.assert_close(sample, end)
        for x, t in zip(fed, subset):
            torch.testing.assert_close(x, sampler_points(objective, trajectory, steps[0], timesteps(t, 2)),
                                       rtol=1e-4, atol=1e-4)
    # the first point is the trajectory's start; the later ones are not the stored (curved) points
    torch.testing.assert_close(sampler_points(objective, trajectory, steps[0], timesteps(steps[0], 2)), start,
                               rtol=1e-4, atol=1e-4)
    later = sampler_points(objective, trajectory, steps[0], timesteps(steps[2], 2))
    assert (later - trajectory[:, 2]).abs().max() > 0.1
