"""Sana (1.5 4.8B / 1.6B, 1.0 1.6B at 1024 and 2048, 1.0 600M at 1024 and 512, tiny): a linear-attention DiT on a
32x deep-compression autoencoder, trained with flow matching.

Family quirks kept here:
- one text encoder, Gemma 2 (its last hidden state and attention mask). Prompts get the pipeline's default
  "complex human instruction" prepended and keep the first token plus the last ``max_sequence_length - 1``, as
  ``SanaPipeline`` encodes them; negative prompts go in without it, as the pipeline encodes its negatives;
- the VAE is a DC-AE (``AutoencoderDC``): 32x downsampling to 32 channels, no posterior (``encode(x).latent``),
  ``z * scaling_factor``; there is no Tiny AutoEncoder for it, so ``validation_preview`` is refused;
- the scheduler is DPM-Solver with flow sigmas (shift 3 at 1024px); its pipeline hands the transformer whole
  timesteps (``int(sigma * 1000) * timestep_scale``) while stepping with the unrounded sigma, and training passes
  ``sigma * 1000 * timestep_scale``;
- validation runs classifier-free guidance at ``validation_guidance`` > 1 and renders the requested size
  (``use_resolution_binning=False``);
- no TREAD: each block's Mix-FFN unflattens the tokens into the (h, w) latent grid for a 3x3 depthwise convolution,
  so a subset of the image tokens cannot pass through a block. Sana Sprint is not included: it needs its own
  pipeline and the sCM/TrigFlow consistency objective, not a flavour of this one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
from transformers import Gemma2Model, GemmaTokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding

# Gemma tokens per prompt after the instruction: the pipeline's default (SimpleTuner uses the same 300)
DEFAULT_TEXT_LENGTH = {"tiny": 32}
TEXT_LENGTH = 300
# the instruction SanaPipeline prepends to every prompt by default
COMPLEX_HUMAN_INSTRUCTION = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_PRESETS = {
    "attention": _ATTN,  # linear self-attention and cross-attention: SimpleTuner's default for Sana
    "self-attention": [f"attn1.{m}" for m in _ATTN],
    "all+ffs": _ATTN + ["ff.conv_inverted", "ff.conv_point"],  # the Mix-FFN's 1x1 convolutions
}


class SanaAdapter(ModelAdapter):
    family = "sana"
    pipeline_class = SanaPipeline
    denoiser_class = SanaTransformer2DModel
    lora_presets = LORA_PRESETS
    vae_class = AutoencoderDC
    text_encoder_specs = (("text_encoder", Gemma2Model, "tokenizer", GemmaTokenizerFast),)
    resolution_multiple = 32  # DC-AE /32, 1x1 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_sana(folder)

    @property
    def max_sequence_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_TEXT_LENGTH.get(self.config.model_flavour or "", TEXT_LENGTH))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode(self, prompts: list[str], instruction) -> list[TextEmbedding]:
        shell = SanaPipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())
        embeds, mask, _, _ = shell.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device, clean_caption=False,
            max_sequence_length=self.max_sequence_length, complex_human_instruction=instruction,
        )
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "prompt_attention_mask": mask[i].float().cpu()}) for i in range(len(prompts))]

    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        return self._encode(prompts, COMPLEX_HUMAN_INSTRUCTION)

    def encode_negative_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        return self._encode(prompts, None)  # the pipeline encodes its negative prompt without the instruction

    def text_identity_extras(self) -> list[str]:
        instruction = hashlib.sha256(json.dumps(COMPLEX_HUMAN_INSTRUCTION).encode()).hexdigest()[:16]
        return [f"text_len={self.max_sequence_length}", f"instruction={instruction}"]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """DC-AE has no posterior: ``encode(x).latent * scaling_factor``."""
        if self.vae is None:
            self.load_vae()
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent
        self.vae_forwards += 1
        return (latents * self.vae.config.scaling_factor).float().cpu()

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call: ``timestep = sigma * 1000 * timestep_scale``, the prediction in float32."""
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        out = transformer(
            noisy_latents.to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
            encoder_attention_mask=text["prompt_attention_mask"].to(device),
            timestep=(t.to(device) * 1000 * model.config.timestep_scale).to(dtype).expand(noisy_latents.shape[0]),
            return_dict=False,
        )[0].float()
        if model.config.out_channels // 2 == noisy_latents.shape[1]:  # a learned-sigma head, as the pipeline checks
            out = out.chunk(2, dim=1)[0]
        return out

    def image_seq_len(self, latent_shape) -> int:
        return latent_shape[-2] * latent_shape[-1]

    def tread_layout(self, transformer) -> None:
        return None  # the Mix-FFN convolves over the whole latent grid (see the module docstring)

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "guidance_scale": guidance, "max_sequence_length": self.max_sequence_length,
                  "complex_human_instruction": COMPLEX_HUMAN_INSTRUCTION, "clean_caption": False,
                  "use_resolution_binning": False}
        if negative is not None and guidance > 1:
            # negative_prompt defaults to "" in this pipeline, and may not come with negative embeddings
            kwargs.update(negative_prompt=None, negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return kwargs


def _write_tiny_sana(folder: Path, seed: int = 0) -> None:
    """A random Sana: 2 blocks, a 6-level (32x) DC-AE with 32 latent channels, Gemma 2, DPM-Solver flow sigmas."""
    tokenizer = tiny.gemma_tokenizer(4096)
    torch.manual_seed(seed)
    transformer = SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
        sample_size=32, patch_size=1,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=32, attention_head_dim=8, encoder_block_types="ResBlock",
        decoder_block_types="ResBlock", encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        decoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 6,
        decoder_qkv_multiscales=((),) * 6, downsample_block_type="Conv", upsample_block_type="interpolate",
        scaling_factor=0.41407,  # Sana's DC-AE f32c32 value
    )
    torch.manual_seed(seed + 2)
    text_encoder = tiny.gemma2_encoder(tokenizer, hidden_size=32)
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
                                            num_train_timesteps=1000)
    SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                 scheduler=scheduler).save_pretrained(folder, safe_serialization=True)
