"""HunyuanVideo specifics beyond the family contract: the Llama layer and template crop the pipeline takes, the
unpadded text cache, the guidance embedding at a non-default scale, the VAE's compression and scaling, the TREAD
mask slice, and group offload + int8 quantization training the transformer exactly as the plain run does."""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.hunyuanvideo import HunyuanVideoAdapter, slice_video_rotary, slice_video_text_mask
from tests.models.contract import family_config, group_offload_losses, loaded_adapter

PROMPTS = ["a red circle", "a blue square on the green background, moving left"]


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return loaded_adapter("hunyuanvideo")


@pytest.fixture(scope="module")
def transformer(adapter):
    return adapter.load_transformer().eval().requires_grad_(False)


def test_llama_embeddings_are_the_third_last_layer_after_the_template(adapter):
    """The tiny tokenizer cuts the template where the real one does (crop_start = 95 tokens), and the cached
    embedding is the Llama's third-to-last hidden state of the prompt's own tokens (and the template's closing
    <|eot_id|>), nothing of the template before it."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    tokenizer, llama = adapter.tokenizers[0], adapter.text_encoders[0]
    template, crop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    assert len(tokenizer(template.split("{}")[0]).input_ids) == crop == 95
    cached = adapter.encode_prompts(PROMPTS)
    for prompt, entry in zip(PROMPTS, cached):
        ids = tokenizer(template.format(prompt), return_tensors="pt").input_ids
        assert tokenizer.convert_ids_to_tokens(ids[0, crop:])[-1] == "<|eot_id|>"
        with torch.no_grad():
            hidden = llama(input_ids=ids, output_hidden_states=True).hidden_states[-3][0, crop:]
        assert entry.tensors["prompt_embeds"].shape == hidden.shape
        assert torch.allclose(entry.tensors["prompt_embeds"], hidden, atol=1e-5)
        assert entry.tensors["prompt_attention_mask"].all()
        assert entry.tensors["pooled_prompt_embeds"].shape == (adapter.text_encoders[1].config.hidden_size,)


def test_a_padded_batch_predicts_what_each_prompt_predicts_alone(adapter, transformer):
    """Captions are cached unpadded; a batch of two lengths is right-padded with a zero mask, and each sample's
    prediction is the same as alone (the transformer keeps padding out of attention and its refiner's mean)."""
    cached = adapter.encode_prompts(PROMPTS)
    assert cached[0].tensors["prompt_embeds"].shape[0] < cached[1].tensors["prompt_embeds"].shape[0]
    batch = TextEmbedding.collate(cached)
    assert not batch["prompt_attention_mask"][0].all() and batch["prompt_attention_mask"][1].all()
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        together = adapter.predict(transformer, latents, t, batch)
        for i in range(2):
            alone = adapter.predict(transformer, latents[i:i + 1], t[i:i + 1], TextEmbedding.collate([cached[i]]))
            assert (together[i] - alone[0]).abs().max().item() < 1e-5


def test_guidance_value_feeds_the_guidance_embedding_as_the_pipeline_does(adapter, transformer):
    """At a guidance of 6 (the pipeline's default) the adapter's prediction is the pipeline's first step, and it
    differs from the prediction at 1: the distilled-guidance embedding is fed, scaled by 1000."""
    text = TextEmbedding.collate(adapter.encode_prompts(PROMPTS[:1]))
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    six = HunyuanVideoAdapter(family_config("hunyuanvideo", guidance_value=6.0))
    pipe = adapter.build_pipeline(transformer)
    pipe.set_progress_bar_config(disable=True)
    captured = []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda out, *a, **k: captured.append(out.clone()) or step(out, *a, **k)
    with torch.no_grad():
        pipe(height=64, width=64, num_frames=5, num_inference_steps=2, latents=latents, output_type="latent",
             **adapter.validation_pipeline_kwargs(text, None, guidance=6.0, guidance_real=1.0))
        t = adapter.objective.pipeline_timestep(pipe.scheduler, 0)
        ours = six.predict(transformer, latents, t, text)
        at_one = adapter.predict(transformer, latents, t, text)
    assert (ours - captured[0]).abs().max().item() < 1e-5
    assert (ours - at_one).abs().max().item() > 1e-4


def test_vae_compresses_4x_in_time_8x_in_space_and_scales(adapter):
    """Clips of 4k+1 frames become k+1 latent frames (an image one), scaled by the VAE's scaling factor (the real
    0.476986, no shift), and decode back to the clip's frame count."""
    vae = adapter.vae
    assert vae.config.scaling_factor == pytest.approx(0.476986) and adapter.temporal_compression == 4
    clip = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = adapter.encode_images(clip)
    assert latents.shape == (1, 16, 3, 4, 6)
    with torch.no_grad():
        raw = vae.encode(clip).latent_dist.mean
    assert torch.allclose(latents, raw * vae.config.scaling_factor, atol=1e-6)
    assert adapter.encode_images(clip[:, :, 0]).shape == (1, 16, 1, 4, 6)
    assert adapter.decode_latents(latents).shape == clip.shape


def test_tread_slices_video_rotary_and_key_mask_to_the_kept_tokens():
    cos, sin = torch.randn(6, 4), torch.randn(6, 4)
    idx = torch.tensor([[0, 2, 5]]).expand(2, -1)  # one selection shared by the batch
    sliced = slice_video_rotary((cos, sin), idx, 3)
    assert torch.equal(sliced[0], cos[[0, 2, 5]]) and torch.equal(sliced[1], sin[[0, 2, 5]])
    with pytest.raises(ValueError, match="shared_selection"):
        slice_video_rotary((cos, sin), torch.tensor([[0, 2, 5], [1, 2, 5]]), 3)
    # 6 video keys, then 3 text keys of which the first sample's last is padding
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., 8] = False
    out = slice_video_text_mask(mask, idx, 3)
    assert out.shape == (2, 1, 1, 6)
    assert out[0, 0, 0].tolist() == [True] * 5 + [False] and out[1].all()


@pytest.mark.parametrize("precision", ["int8-quanto"])
def test_group_offload_trains_the_transformer_like_the_plain_run(precision, tmp_path):
    losses = group_offload_losses("hunyuanvideo", tmp_path, precision)
    assert len(losses[0]) == 2 and losses[0] == losses[1]
