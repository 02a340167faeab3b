"""Cosmos specifics the family contract does not cover: its EDM loss is the weighted flow-matching loss trained
here, and T5 prompts are cached unpadded and zero-padded back. (Validation without NVIDIA's guardrail package runs
in the end-to-end test of the quickstart, with classifier-free guidance.)"""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.cosmos2image import Cosmos2ImageAdapter, CosmosFlowMatching
from tests.models.contract import family_config


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return Cosmos2ImageAdapter(family_config("cosmos2image", flow_schedule_shift=1.0))


def test_the_weighted_velocity_loss_is_cosmos_edm_loss(adapter):
    """SimpleTuner trains Cosmos as EDM: x_edm = x0 + sigma * noise, the model's x0 estimate is
    x_edm / (1 + sigma) - sigma / (1 + sigma) * out, loss (sigma^2 + 1) / sigma^2 * |x0_hat - x0|^2. With
    t = sigma / (1 + sigma) the model sees the flow-matching x_t, and the loss is the weighted velocity loss."""
    objective = adapter.objective
    assert isinstance(objective, CosmosFlowMatching) and objective.name == "flow_matching"
    g = torch.Generator().manual_seed(0)
    x0, noise, out = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    sigma = torch.tensor([0.05, 1.0, 30.0])
    s = sigma.view(-1, 1, 1, 1)
    x0_hat = (x0 + s * noise) / (1 + s) - s / (1 + s) * out
    edm = ((s ** 2 + 1) / s ** 2 * (x0_hat - x0) ** 2).flatten(1).mean(1)
    t = sigma / (1 + sigma)
    assert torch.allclose(objective.add_noise(x0, noise, t), (x0 + s * noise) / (1 + s), atol=1e-6)
    ours = objective.per_sample_loss(out, objective.target(x0, noise, t), t)
    assert torch.allclose(ours, edm, rtol=1e-4)
    # EDM's log-normal sigma (mean 0, std 1) is the default logit-normal t at shift 1
    draws = objective.sample_timesteps(20000, generator=torch.Generator().manual_seed(1), image_seq_len=256)
    assert abs(torch.logit(draws).mean().item()) < 0.05 and abs(torch.logit(draws).std().item() - 1) < 0.05


def test_prompts_are_cached_unpadded_and_padded_back_as_the_pipeline_pads_them(adapter):
    (item,) = adapter.encode_prompts(["a red circle"])
    shell = adapter.pipeline_class(transformer=None, vae=None, scheduler=None, **adapter.text_encoder_components())
    full, _ = shell.encode_prompt("a red circle", do_classifier_free_guidance=False, max_sequence_length=512)
    n = item.tensors["prompt_embeds"].shape[0]
    assert n < 512 and full[0, n:].abs().max() == 0
    assert torch.equal(adapter.padded_embeds(TextEmbedding.collate([item])["prompt_embeds"]), full)

