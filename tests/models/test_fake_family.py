"""Proof that a family is one file plus one table row: a Stable-Diffusion-style UNet family (another kind of
denoiser, an epsilon objective, a single CLIP encoder) written only here passes the whole family contract."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from simpletuner.config.families import ModelFamily, registered
from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from tests.models.contract import FamilyContract


# ---- the family: this class and the table row below are all of it ----------------------------------------------
class FakeUNetAdapter(ModelAdapter):
    family = "fake_unet"
    pipeline_class = StableDiffusionPipeline
    denoiser_class, denoiser_subfolder = UNet2DConditionModel, "unet"
    text_encoder_specs = (("text_encoder", CLIPTextModel, "tokenizer", CLIPTokenizer),)
    lora_layers_argument = "unet_lora_layers"
    lora_presets = {"attention": ["to_q", "to_k", "to_v", "to_out.0"]}
    resolution_multiple = 8

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            tokenizer = tiny.clip_tokenizer(77)
            StableDiffusionPipeline(
                unet=UNet2DConditionModel(
                    sample_size=8, layers_per_block=1, block_out_channels=(16, 32), norm_num_groups=8,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=4,
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32),
                vae=AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, norm_num_groups=8,
                                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
                text_encoder=CLIPTextModel(CLIPTextConfig(
                    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)),
                tokenizer=tokenizer, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
                scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
            ).save_pretrained(folder, safe_serialization=True)

    @torch.no_grad()
    def encode_prompts(self, prompts):
        shell = StableDiffusionPipeline(vae=None, unet=None, scheduler=None, safety_checker=None, feature_extractor=None,
                                        requires_safety_checker=False, **self.text_encoder_components())
        embeds, _ = shell.encode_prompt(list(prompts), self.device, 1, do_classifier_free_guidance=False)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": e.float().cpu()}) for e in embeds]

    def predict(self, unet, noisy_latents, t, text):
        return unet(noisy_latents, t.to(noisy_latents.device), encoder_hidden_states=text["prompt_embeds"]).sample

    def image_seq_len(self, latent_shape):
        return latent_shape[-2] * latent_shape[-1]

    def tread_layout(self, unet):
        return None  # a UNet changes resolution between blocks: no token sequence to route

    def validation_pipeline_kwargs(self, text, negative, *, guidance, guidance_real):
        return {"prompt_embeds": text["prompt_embeds"], "guidance_scale": guidance}


FAKE_UNET = ModelFamily(
    name="fake_unet", description="a tiny Stable-Diffusion-style UNet (tests only)",
    adapter="tests.models.test_fake_family:FakeUNetAdapter",
    flavours=MappingProxyType({"v1": "example/fake-unet", "tiny": None}),
    default_flavour="tiny", lora_targets=("attention",), default_lora_target="attention",
    objectives=("epsilon", "v_prediction"), resolution_multiple=8,
)


# ---- the contract, unchanged ------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def family():
    with registered(FAKE_UNET):
        yield FAKE_UNET.name


class TestFakeFamily(FamilyContract):
    pass


def test_a_half_written_family_fails_at_import():
    with pytest.raises(TypeError, match=r"HalfWritten \(model family 'half'\) does not implement the adapter contract: "
                                        r"encode_prompts, .*predict.*denoiser_class, lora_presets"):
        class HalfWritten(ModelAdapter):  # noqa: F841 (defining it is the test)
            family = "half"
            pipeline_class = StableDiffusionPipeline
            write_tiny_checkpoint = FakeUNetAdapter.write_tiny_checkpoint
