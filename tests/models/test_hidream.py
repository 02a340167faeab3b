"""HiDream specifics the family contract does not cover: where the Llama encoder comes from, the train-mode output
layout (patches, padded for non-square images), and live previews through its Tiny AutoEncoder."""

from __future__ import annotations

import json

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.hidream import LLAMA_PATH, HiDreamAdapter
from tests.models.contract import family_config


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return HiDreamAdapter(family_config("hidream"))


def test_the_llama_encoder_comes_from_its_own_repository_unless_the_model_has_it(adapter):
    real = HiDreamAdapter(family_config("hidream", model_flavour="full"))
    assert real.component_source("text_encoder_4") == (LLAMA_PATH, None)
    assert real.component_source("tokenizer_4") == (LLAMA_PATH, None)
    assert real.component_source("text_encoder_3") == ("HiDream-ai/HiDream-I1-Full", None)
    assert json.loads(real.component_identity("text_encoder_4"))[1] == LLAMA_PATH
    local = adapter.ensure_tiny_checkpoint()
    assert adapter.component_source("text_encoder_4") == (str(local), None)


@pytest.mark.parametrize("shape", [(8, 8), (8, 12)], ids=["square", "non-square"])
def test_training_mode_predicts_what_inference_mode_predicts(adapter, shape):
    """In train mode the transformer returns (B, C, tokens, p*p) patches (padded to max_seq for a non-square
    image) and routes its mixture of experts another way; the prediction is the same image either way."""
    transformer = adapter.load_transformer()
    text = TextEmbedding.collate(adapter.encode_prompts(["a red circle", "a blue square"]))
    latents = torch.randn(2, 4, *shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        inference = adapter.predict(transformer.eval(), latents, t, text)
        training = adapter.predict(transformer.train(), latents, t, text)
    assert training.shape == inference.shape == latents.shape
    assert (training - inference).abs().max().item() < 1e-5


def test_previews_decode_with_the_tiny_autoencoder(adapter):
    adapter.load_vae()
    decoder = adapter.load_preview_decoder()
    latents = adapter.encode_images(torch.zeros(1, 3, 64, 64))
    with torch.no_grad():
        pixels = decoder.decode(adapter.preview_latents(latents, 64, 64)).sample
    assert pixels.shape == (1, 3, 64, 64) and torch.isfinite(pixels).all()
