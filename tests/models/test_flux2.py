"""FLUX.2 dev (the contract runs the Klein-shaped tiny flavour): Flux2Pipeline with a Mistral-3 encoder (hidden
layers 10, 20, 30 behind Mistral's system prompt) and a distilled-guidance embedding, matched by the adapter."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from simpletuner.models import tiny
from simpletuner.models.base import TextEmbedding
from simpletuner.models.flux2 import Flux2Adapter, tiny_flux2_transformer, tiny_flux2_vae
from tests.models.contract import _capture_scheduler_input, family_config

# Mistral-Small-3.1's chat template, for what Flux2Pipeline renders: a system turn and a user turn of text parts
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', "
    "'equalto', 'text') | map(attribute='text') | join('') %}{%- endif %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}"
    "{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}"
)


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    """A dev-shaped tiny FLUX.2 in the diffusers layout; its tokenizer folder holds the tokenizer alone (the real
    one is a PixtralProcessor, which needs torchvision)."""
    folder = tmp_path_factory.mktemp("flux2-dev")
    tokenizer = tiny.fast_byte_level_tokenizer(
        bos="<s>", eos="</s>", add_bos=False, chat_template=MISTRAL_TEMPLATE,
        specials=["<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"])
    tokenizer.pad_token = "<pad>"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=1024),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        ))
        Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                      max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
            vae=tiny_flux2_vae(1), text_encoder=text_encoder, tokenizer=tokenizer,
            transformer=tiny_flux2_transformer(0, joint_attention_dim=3 * 32, guidance_embeds=True),
        ).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("mode", ["embeddings", "prompt"])
def test_dev_prediction_matches_flux2_pipeline(dev_folder, mode):
    adapter = Flux2Adapter(family_config("flux2", model_flavour="dev", pretrained_model_name_or_path=str(dev_folder),
                                         guidance_value=2.5))
    assert adapter.pipeline_class is Flux2Pipeline and not adapter.is_klein
    transformer = adapter.load_transformer().eval()
    assert transformer.config.guidance_embeds
    prompt = "a red circle on a blue background"
    text = TextEmbedding.collate(adapter.encode_prompts([prompt]))
    assert text["prompt_embeds"].shape == (1, 512, 3 * 32)  # three Mistral layers per token, all 512 positions
    pipe = adapter.build_pipeline(transformer)
    pipe.set_progress_bar_config(disable=True)
    captured = _capture_scheduler_input(pipe)
    kwargs = adapter.validation_pipeline_kwargs(text, None, guidance=2.5, guidance_real=1.0)
    if mode == "prompt":
        kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        kwargs["prompt"] = prompt
    latents = adapter.encode_images(torch.zeros(1, 3, 64, 64))
    latents = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pipe(height=64, width=64, num_inference_steps=2, latents=adapter.pipeline_latents(latents),
             output_type="latent", generator=torch.Generator().manual_seed(0), **kwargs)
        t = adapter.objective.pipeline_timestep(pipe.scheduler, 0)
        ours = adapter.scheduler_input(adapter.predict(transformer, latents, t, text), latents, t)
    assert (ours - captured[0]).abs().max().item() < 1e-5
