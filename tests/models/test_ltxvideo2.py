"""LTX-2 specifics beyond the family contract: the text cache is Gemma's stacked hidden states through the connectors
(as the pipeline computes them), the pipelines take both cached connector outputs and Gemma's states, the audio stream
the video learns beside, and int8 quantization under group offload."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.ltx2 import LTX2TextConnectors

from simpletuner.models.base import TextEmbedding
from simpletuner.models.ltxvideo2 import ConnectorOutputs, LTX2Adapter
from tests.models.contract import family_config, group_offload_losses, loaded_adapter

PROMPTS = ["a red circle", "a blue square on the green background, moving left"]


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return loaded_adapter("ltxvideo2")


@pytest.fixture(scope="module")
def transformer(adapter):
    return adapter.load_transformer().eval().requires_grad_(False)


def test_cached_text_is_gemmas_stacked_states_through_the_connectors(adapter):
    """Each cached caption is what the connectors make of every Gemma hidden state (embeddings + each layer) of the
    left-padded prompt, computed alone; the registers fill the padding, so the mask keeps every position."""
    tokenizer, gemma, connectors = adapter.tokenizers[0], adapter.text_encoders[0], adapter.connectors
    cached = adapter.encode_prompts(PROMPTS)
    for prompt, entry in zip(PROMPTS, cached):
        tokenizer.padding_side = "left"
        ids = tokenizer([prompt], padding="max_length", max_length=adapter.text_length, truncation=True,
                        return_tensors="pt")
        assert not ids.attention_mask.all()  # the prompt is padded: the registers have work to do
        with torch.no_grad():
            states = gemma(input_ids=ids.input_ids, attention_mask=ids.attention_mask,
                           output_hidden_states=True).hidden_states
            assert len(states) == gemma.config.text_config.num_hidden_layers + 1
            video, audio, mask = connectors(torch.stack(states, dim=-1).flatten(2, 3), ids.attention_mask,
                                            padding_side="left")
        assert entry.tensors["prompt_embeds"].shape == (adapter.text_length, connectors.config.caption_channels)
        assert torch.allclose(entry.tensors["prompt_embeds"], video[0], atol=1e-5)
        assert torch.allclose(entry.tensors["audio_prompt_embeds"], audio[0], atol=1e-5)
        assert entry.tensors["prompt_attention_mask"].all() and mask.bool().all()
    assert not torch.allclose(cached[0].tensors["prompt_embeds"], cached[1].tensors["prompt_embeds"])


def test_connector_outputs_pass_cached_embeddings_and_run_gemma_states(adapter):
    connectors = adapter.connectors
    width = connectors.config.caption_channels
    wrapper = ConnectorOutputs(width, connectors)
    video, audio = torch.randn(2, 4, width), torch.randn(2, 4, width)
    mask = torch.ones(2, 4, dtype=torch.long)
    out = wrapper(torch.cat([video, audio], dim=-1), mask)
    assert torch.equal(out[0], video) and torch.equal(out[1], audio) and out[2] is mask

    states = torch.randn(1, adapter.text_length, width * connectors.config.text_proj_in_factor)
    gemma_mask = torch.ones(1, adapter.text_length, dtype=torch.long)
    with torch.no_grad():
        expected = connectors(states, gemma_mask)
        ran = wrapper(states, gemma_mask)
    assert all(torch.equal(a, b) for a, b in zip(ran, expected))
    with pytest.raises(ValueError, match="prompt_embeds: 96 features"):
        ConnectorOutputs(width)(states, gemma_mask)  # a validation pipeline holds no connectors
    with pytest.raises(ValueError, match="text_proj_in_factor 2"):
        ConnectorOutputs(width, LTX2TextConnectors(caption_channels=8, text_proj_in_factor=2,
                                                   video_connector_num_attention_heads=1,
                                                   video_connector_attention_head_dim=8,
                                                   audio_connector_num_attention_heads=1,
                                                   audio_connector_attention_head_dim=8,
                                                   video_connector_num_layers=1, audio_connector_num_layers=1))


def test_a_text_length_that_does_not_fill_the_registers_is_refused(tiny_dir):
    adapter = LTX2Adapter(family_config("ltxvideo2", tokenizer_max_length=36))
    with pytest.raises(ValueError, match="tokenizer_max_length: 36 is not a multiple of the text connectors' 8"):
        adapter.encode_prompts(PROMPTS[:1])


def test_the_audio_stream_is_timestep_seeded_noise_the_video_attends_to(adapter, transformer):
    """The audio stream is standard normal noise at sigma 1, one draw per timestep (the same t, the same noise: a
    prediction is a function of its inputs; another t, another draw), as long as the clip lasts; and the video
    prediction does attend to it (cutting the audio-video attention changes it)."""
    cfg = transformer.config
    a = LTX2Adapter.audio_noise(torch.tensor([0.25, 0.5]), 2, 7, cfg.audio_in_channels)
    b = LTX2Adapter.audio_noise(torch.tensor([0.25, 0.75]), 2, 7, cfg.audio_in_channels)
    assert a.shape == (2, 7, cfg.audio_in_channels)
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[1])
    # 9 frames at 24 fps are 0.375 s: 25 audio latents a second (16 kHz, hop 160, 4x) -> 9
    assert adapter.audio_latent_frames(cfg, 9) == 9

    text = TextEmbedding.collate(adapter.encode_prompts(PROMPTS))
    latents = torch.randn(2, 8, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        first = adapter.predict(transformer, latents, t, text)
        again = adapter.predict(transformer, latents, t, text)
        inputs = adapter.transformer_inputs(transformer, latents, t, text)
        isolated = transformer(**inputs, isolate_modalities=True)[0]
    assert torch.equal(first, again)
    assert inputs["audio_hidden_states"].shape == (2, 9, cfg.audio_in_channels)
    assert torch.equal(inputs["audio_timestep"], torch.full((2,), 1000.0))
    packed = adapter.scheduler_input(first, latents, t)
    assert (packed - isolated).abs().max().item() > 1e-6


@pytest.mark.parametrize("precision", ["int8-quanto"])
def test_group_offload_trains_the_transformer_like_the_plain_run(precision, tmp_path):
    """int8-quanto on the transformer (its embedders outside the blocks kept in full precision), without and with
    block-level group offload: finite losses, the same in both runs."""
    losses = group_offload_losses("ltxvideo2", tmp_path, precision)
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert torch.isfinite(torch.tensor(losses)).all()
