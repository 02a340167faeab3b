"""Kolors (1.0, tiny): Kuaishou's SDXL-architecture UNet conditioned on ChatGLM3-6B, trained with epsilon on a
1100-step DDPM schedule.

It is SDXL's adapter (``sdxl.py``: micro-conditioning, UNet LoRA presets, the scheduler told the run's objective)
with these differences kept here:
- one text encoder, ChatGLM3 (diffusers ships its model and sentencepiece tokenizer with the pipeline): the
  penultimate hidden states (256 tokens, left-padded) are the context, which the UNet projects (``encoder_hid_proj``),
  and the last layer's final token is the pooled ``text_embeds``;
- the UNet's added conditioning is (pooled 4096 + 6 time ids x 256).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from diffusers import KolorsPipeline
from diffusers.pipelines.kolors.text_encoder import ChatGLMConfig, ChatGLMModel
from diffusers.pipelines.kolors.tokenizer import ChatGLMTokenizer

from simpletuner.models import tiny
from simpletuner.models.base import TextEmbedding
from simpletuner.models.sdxl import SDXLAdapter, sdxl_scheduler, tiny_unet, tiny_vae

# KolorsPipeline's prompt length (its encode_prompt default)
MAX_SEQUENCE_LENGTH = 256


class KolorsAdapter(SDXLAdapter):
    family = "kolors"
    pipeline_class = KolorsPipeline
    text_encoder_specs = (("text_encoder", ChatGLMModel, "tokenizer", ChatGLMTokenizer),)

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_kolors(folder)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = KolorsPipeline(vae=None, unet=None, scheduler=None, **self.text_encoder_components())
        embeds, _, pooled, _ = shell.encode_prompt(prompt=list(prompts), device=self.device,
                                                   do_classifier_free_guidance=False,
                                                   max_sequence_length=MAX_SEQUENCE_LENGTH)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(), "pooled_prompt_embeds": pooled[i].float().cpu()})
                for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"max_len={MAX_SEQUENCE_LENGTH}"]

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """KolorsPipeline arguments: as SDXL's (classifier-free ``guidance`` against ``negative`` when given)."""
        return super().validation_pipeline_kwargs(text, negative, guidance=guidance, guidance_real=guidance_real)


def write_tiny_kolors(folder: Path, seed: int = 0) -> None:
    """Write a random-initialised Kolors in the diffusers layout, seeded on a forked RNG."""
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as source:
        (Path(source) / "tokenizer.model").write_bytes(tiny.sentencepiece_model())
        tokenizer = ChatGLMTokenizer(vocab_file=str(Path(source) / "tokenizer.model"))
        torch.manual_seed(seed)
        unet = tiny_unet(cross_attention_dim=32, pooled_dim=32, encoder_hid_dim=32, encoder_hid_dim_type="text_proj")
        torch.manual_seed(seed + 1)
        vae = tiny_vae(scaling_factor=0.13025)
        torch.manual_seed(seed + 2)
        text_encoder = ChatGLMModel(ChatGLMConfig(
            num_layers=2, padded_vocab_size=len(tokenizer.get_vocab()) + 8, hidden_size=32, ffn_hidden_size=64,
            kv_channels=8, num_attention_heads=4, seq_length=MAX_SEQUENCE_LENGTH, multi_query_attention=True,
            multi_query_group_num=2, original_rope=True, torch_dtype="float32",
        ), empty_init=False)
        for name, param in text_encoder.named_parameters():
            if name.endswith("layernorm.weight"):  # ChatGLM's RMSNorm allocates its scale without initialising it
                param.data.fill_(1.0)
        # Kolors 1.0's scheduler: SDXL's with 1100 training timesteps and a higher final beta
        scheduler = sdxl_scheduler(num_train_timesteps=1100, beta_end=0.014)
        KolorsPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                       ).save_pretrained(folder, safe_serialization=True)
