"""Training objectives: flow matching's sampling and shift, DDPM's epsilon / v targets against diffusers."""

from __future__ import annotations

import math

import pytest
import torch

from simpletuner.models.objectives import EVAL_FRACTIONS, DDPMObjective, FlowMatching, build_objective
from tests.helpers import flux_config

SD_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def test_sigmas_in_range_and_reproducible():
    flow = FlowMatching()
    a = flow.sample_timesteps(1000, generator=torch.Generator().manual_seed(0), image_seq_len=256)
    b = flow.sample_timesteps(1000, generator=torch.Generator().manual_seed(0), image_seq_len=256)
    assert torch.equal(a, b) and a.min() > 0 and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.03  # logit-normal is symmetric around 0.5
    u = FlowMatching(uniform=True).sample_timesteps(1000, generator=torch.Generator().manual_seed(0), image_seq_len=1)
    assert u.std() > a.std()  # uniform is wider than sigmoid(N(0,1))
    wide = FlowMatching(sigmoid_scale=3.0).sample_timesteps(1000, generator=torch.Generator().manual_seed(0),
                                                            image_seq_len=1)
    assert wide.std() > a.std()


def test_shift_moves_mass_to_high_noise_and_keeps_endpoints():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    shifted = FlowMatching(shift=3.0).shift_sigmas(s, 256)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert torch.all(shifted[1:3] > s[1:3])
    assert torch.allclose(FlowMatching(shift=3.0).shift_sigmas(torch.tensor([0.5]), 256), torch.tensor([0.75]))
    assert torch.equal(FlowMatching(shift=1.0).shift_sigmas(s, 256), s)


def test_auto_shift_reads_the_models_scheduler_constants():
    flux = FlowMatching.from_config(flux_config(flow_schedule_auto_shift=True),
                                    {"base_image_seq_len": 256, "max_image_seq_len": 4096,
                                     "base_shift": 0.5, "max_shift": 1.15})
    # 256 tokens -> mu 0.5, 4096 tokens -> mu 1.15 (FluxPipeline's defaults)
    assert math.isclose(flux.resolution_mu(256), 0.5) and math.isclose(flux.resolution_mu(4096), 1.15)
    s = torch.tensor([0.5])
    assert torch.allclose(flux.shift_sigmas(s, 4096), torch.tensor([math.exp(1.15) / (math.exp(1.15) + 1)]))
    # another family's constants give another shift at the same size
    other = FlowMatching.from_config(flux_config(flow_schedule_auto_shift=True),
                                     {"base_image_seq_len": 256, "max_image_seq_len": 8192,
                                      "base_shift": 0.5, "max_shift": 0.9})
    assert other.resolution_mu(4096) < flux.resolution_mu(4096)


def test_flow_noise_and_target():
    flow = FlowMatching()
    x, n = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    out = flow.add_noise(x, n, torch.tensor([0.0, 0.3]))
    assert torch.allclose(out[0], x[0]) and torch.allclose(out[1], torch.full((1, 2, 2), 0.3))
    assert torch.equal(flow.target(x, n, torch.tensor([0.5, 0.5])), n - x)
    assert flow.eval_timesteps().tolist() == pytest.approx(EVAL_FRACTIONS)
    assert flow.level_name(0.1) == "sigma_0.1"


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddpm_objectives_match_diffusers_scheduler(prediction_type):
    from diffusers import DDPMScheduler

    objective = DDPMObjective(prediction_type, SD_SCHEDULE)
    reference = DDPMScheduler(**SD_SCHEDULE, prediction_type=prediction_type)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = objective.sample_timesteps(3, generator=g, image_seq_len=64)
    assert t.dtype == torch.long and 0 <= t.min() and t.max() < 1000
    noisy = objective.add_noise(x0, noise, t)
    assert torch.equal(noisy, reference.add_noise(x0, noise, t))
    expected = noise if prediction_type == "epsilon" else reference.get_velocity(x0, noise, t)
    assert torch.equal(objective.target(x0, noise, t), expected)
    # the v target really is alpha * noise - sigma * x0
    if prediction_type == "v_prediction":
        alpha_bar = reference.alphas_cumprod[t].view(-1, 1, 1, 1)
        assert torch.allclose(expected, alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * x0, atol=1e-6)
    assert objective.eval_timesteps().tolist() == [round(f * 999) for f in EVAL_FRACTIONS]
    assert objective.level_name(99) == "t_99"


def test_zero_terminal_snr_rescale_matches_diffusers():
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    objective = DDPMObjective("v_prediction", SD_SCHEDULE, rescale_zero_terminal_snr=True)
    plain = DDPMObjective("v_prediction", SD_SCHEDULE)
    expected = rescale_zero_terminal_snr(plain.scheduler.betas)
    assert torch.allclose(objective.scheduler.betas, expected)
    assert objective.scheduler.alphas_cumprod[-1] < 1e-6 < plain.scheduler.alphas_cumprod[-1]  # zero SNR at T


def test_build_objective_follows_prediction_type():
    assert isinstance(build_objective(flux_config(), {}), FlowMatching)
    assert build_objective(flux_config(flow_schedule_shift=2.0), {}).shift == 2.0


def test_pipeline_timestep_units():
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    flow_sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
    flow_sched.set_timesteps(4)
    assert FlowMatching().pipeline_timestep(flow_sched, 1).item() == pytest.approx(flow_sched.sigmas[1].item())
    # DPM-Solver's flow schedule (Sana) feeds the transformer a whole timestep: t is that, not the unrounded sigma
    from diffusers import DPMSolverMultistepScheduler

    dpm = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    dpm.set_timesteps(2)
    t = FlowMatching().pipeline_timestep(dpm, 0)
    assert t.item() * 1000 == int(dpm.timesteps[0]) != dpm.sigmas[0].item() * 1000
    ddpm = DDPMScheduler(**SD_SCHEDULE)
    ddpm.set_timesteps(4)
    assert DDPMObjective("epsilon", SD_SCHEDULE).pipeline_timestep(ddpm, 1).item() == int(ddpm.timesteps[1])


def test_fast_schedule_draws_the_distilled_models_steps():
    """flow_fast_schedule (schnell's default): sigma 1.0 seven times in ten, else 0.75 / 0.5 / 0.25, unshifted."""
    from simpletuner.models.objectives import FlowMatching
    from tests.helpers import flux_config

    config = flux_config(model_flavour="tiny", flow_fast_schedule=True, flow_schedule_shift=3.0)
    fast = FlowMatching.from_config(config, {})
    t = fast.sample_timesteps(4000, generator=torch.Generator().manual_seed(0), image_seq_len=256)
    assert set(t.tolist()) == {1.0, 0.75, 0.5, 0.25}
    assert 0.66 < (t == 1.0).float().mean().item() < 0.74
    slow = FlowMatching.from_config(flux_config(model_flavour="tiny"), {})
    assert len(set(slow.sample_timesteps(100, generator=torch.Generator().manual_seed(0), image_seq_len=256).tolist())) > 50


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_gamma_weights_each_sample_by_its_timestep(prediction_type):
    objective = DDPMObjective(prediction_type, SD_SCHEDULE, snr_gamma=5.0)
    alpha_bar = objective.scheduler.alphas_cumprod.double()
    t = torch.tensor([10, 300, 999])
    snr = alpha_bar[t] / (1 - alpha_bar[t])
    expected = torch.minimum(snr, torch.full_like(snr, 5.0)) / (snr + 1 if prediction_type == "v_prediction" else snr)
    weights = objective.loss_weights(t)
    assert torch.allclose(weights.double(), expected, rtol=1e-5)
    assert weights[0] < 1 and weights[-1] == pytest.approx(1.0 if prediction_type == "epsilon" else
                                                           float(snr[-1] / (snr[-1] + 1)), rel=1e-4)
    # the loss is the per-sample mean squared error times those weights, averaged over the batch
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    per_sample = (pred - target).pow(2).flatten(1).mean(1)
    assert torch.allclose(objective.loss(pred, target, t), (per_sample * weights).mean())
    assert torch.allclose(DDPMObjective(prediction_type, SD_SCHEDULE).loss(pred, target, t), per_sample.mean())


def test_min_snr_gamma_on_a_zero_terminal_snr_schedule_stays_finite():
    for prediction_type in ("epsilon", "v_prediction"):
        objective = DDPMObjective(prediction_type, SD_SCHEDULE, rescale_zero_terminal_snr=True, snr_gamma=5.0)
        weights = objective.loss_weights(torch.tensor([0, 500, 999]))
        assert torch.isfinite(weights).all() and weights[-1] == (1.0 if prediction_type == "epsilon" else 0.0)


def test_snr_gamma_reaches_the_objective_and_is_refused_for_flow_matching():
    from simpletuner.config import ConfigError, load_train_config

    config = load_train_config({"model_family": "sdxl", "snr_gamma": 5, "model_flavour": "tiny"}).config
    assert build_objective(config, SD_SCHEDULE).snr_gamma == 5.0
    assert build_objective(load_train_config({"model_family": "sdxl"}).config, SD_SCHEDULE).snr_gamma is None
    with pytest.raises(ConfigError, match="snr_gamma: min-SNR weighting applies to the DDPM objectives"):
        flux_config(snr_gamma=5)


def test_loss_mask_weights_latents_and_leaves_the_rest_without_gradient():
    objective = DDPMObjective("epsilon", SD_SCHEDULE)
    pred = torch.randn(2, 4, 8, 8, requires_grad=True)
    target = torch.randn(2, 4, 8, 8)
    mask = torch.zeros(2, 1, 8, 8)
    mask[0, :, 2:5, 3:7] = 1.0
    mask[1, :, 0:2, :] = 0.5
    loss = objective.loss(pred, target, torch.tensor([10, 20]), weight=mask)
    assert torch.allclose(loss, ((pred - target).pow(2) * mask).flatten(1).mean(1).mean())
    loss.backward()
    outside = (mask == 0).expand_as(pred)
    assert torch.all(pred.grad[outside] == 0) and torch.all(pred.grad[~outside] != 0)
