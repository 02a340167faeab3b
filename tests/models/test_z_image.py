"""Z-Image specifics the family contract does not cover: captions of different lengths batched (cached unpadded,
handed to the transformer one tensor per sample), and its guidance convention."""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.z_image import ZImageAdapter
from tests.models.contract import family_config


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return ZImageAdapter(family_config("z_image"))


def test_a_padded_batch_predicts_what_each_caption_predicts_alone(adapter):
    transformer = adapter.load_transformer().eval()
    items = adapter.encode_prompts(["a red circle", "a blue square on a green background with a red circle"])
    batch = TextEmbedding.collate(items)
    assert batch["prompt_embeds_mask"][0].sum() < batch["prompt_embeds_mask"].shape[1]  # the short one is padded
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        together = adapter.predict(transformer, latents, t, batch)
        alone = [adapter.predict(transformer, latents[i:i + 1], t[i:i + 1], TextEmbedding.collate([item]))
                 for i, item in enumerate(items)]
    assert (together - torch.cat(alone)).abs().max().item() < 1e-5


def test_real_guidance_is_the_standard_weight(adapter):
    """ZImagePipeline adds guidance_scale * (cond - uncond) to cond: a standard weight w is guidance_scale w - 1."""
    text = TextEmbedding.collate(adapter.encode_prompts(["a red circle"]))
    negative = TextEmbedding.collate(adapter.encode_prompts([""]))
    assert adapter.validation_pipeline_kwargs(text, negative, guidance=3.0, guidance_real=4.0)["guidance_scale"] == 3.0
    off = adapter.validation_pipeline_kwargs(text, negative, guidance=3.0, guidance_real=1.0)
    assert off["guidance_scale"] == 0.0 and "negative_prompt_embeds" not in off
