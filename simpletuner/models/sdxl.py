"""Stable Diffusion XL (base-1.0, base-0.9, v-prediction fine-tunes such as NoobAI-XL V-Pred and Terminus XL, tiny):
a UNet trained with epsilon or v-prediction on a DDPM schedule.

Family quirks kept here:
- two CLIP text encoders: the penultimate hidden states of both, concatenated, are the cross-attention context; the
  second encoder's projected pooled output is the ``text_embeds`` added to the timestep embedding;
- micro-conditioning: ``time_ids`` = (original height, original width, crop top, crop left, target height, target
  width), from the image file's size, the crop taken from the resized image and the bucket it trains at
  (``sample_conditioning``); a pipeline call without them uses (H, W, 0, 0, H, W) of the output;
- the UNet takes the integer timestep itself; latents are ``z * scaling_factor`` (no shift);
- the pipeline's scheduler (Euler) is told the run's objective (``prediction_type`` and the zero-terminal-SNR
  rescale, then "trailing" timesteps as the rescale's paper asks), so validation samples what training trains;
- a UNet changes resolution between blocks, so there is no token sequence for TREAD to route.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding

_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
# every linear and conv layer of the UNet's resnets and transformer blocks (not the VAE, not the embeddings)
_ALL = _ATTENTION + ["proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut",
                     "time_emb_proj"]


class SDXLAdapter(ModelAdapter):
    family = "sdxl"
    pipeline_class = StableDiffusionXLPipeline
    denoiser_class, denoiser_subfolder = UNet2DConditionModel, "unet"
    text_encoder_specs = (
        ("text_encoder", CLIPTextModel, "tokenizer", CLIPTokenizer),
        ("text_encoder_2", CLIPTextModelWithProjection, "tokenizer_2", CLIPTokenizer),
    )
    lora_layers_argument = "unet_lora_layers"
    resolution_multiple = 32  # VAE /8, then the UNet halves the latents twice

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_sdxl(folder)

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        # a pipeline shell holding only the text encoders, so prompts are encoded by diffusers' own code
        shell = StableDiffusionXLPipeline(vae=None, unet=None, scheduler=None, add_watermarker=False,
                                          **self.text_encoder_components())
        embeds, _, pooled, _ = shell.encode_prompt(prompt=list(prompts), device=self.device,
                                                   do_classifier_free_guidance=False)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(), "pooled_prompt_embeds": pooled[i].float().cpu()})
                for i in range(len(prompts))]

    # ---- training ----------------------------------------------------------------------------------------
    def sample_conditioning(self, samples) -> dict[str, torch.Tensor]:
        """SDXL's micro-conditioning per sample: (original h, w, crop top, left, target h, w) in pixels, the
        original being the image file's size and the crop the corner taken from the resized image."""
        rows = []
        for s in samples:
            (tw, th), (left, top) = s.target_size, s.crop_box[:2]
            ow, oh = s.original_size or s.target_size
            rows.append([oh, ow, top, left, th, tw])
        return {"time_ids": torch.tensor(rows, dtype=torch.float32)}

    def default_time_ids(self, noisy_latents: torch.Tensor) -> torch.Tensor:
        """What the pipeline uses without micro-conditioning arguments: the output size, uncropped."""
        b, _, h, w = noisy_latents.shape
        height, width = h * self.vae_scale_factor, w * self.vae_scale_factor
        return torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).expand(b, 6)

    def added_cond_kwargs(self, noisy_latents, text: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
        time_ids = text.get("time_ids")
        if time_ids is None:
            time_ids = self.default_time_ids(noisy_latents)
        device = noisy_latents.device
        return {"text_embeds": text["pooled_prompt_embeds"].to(device, dtype), "time_ids": time_ids.to(device, dtype)}

    def predict(self, unet, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = getattr(unet, "module", unet).dtype  # unwrap DDP
        return unet(
            noisy_latents.to(dtype), t.to(noisy_latents.device),
            encoder_hidden_states=text["prompt_embeds"].to(noisy_latents.device, dtype),
            added_cond_kwargs=self.added_cond_kwargs(noisy_latents, text, dtype), return_dict=False,
        )[0]

    def image_seq_len(self, latent_shape) -> int:
        return latent_shape[-2] * latent_shape[-1]

    def lora_target_modules(self, unet, preset: str) -> list[str]:
        """``attention``: the query/key/value/output projections of every attention layer (SimpleTuner's default
        for UNets); ``all``: also the transformer blocks' feed-forward and in/out projections and the resnets'
        convolutions and timestep projections."""
        presets = {"attention": _ATTENTION, "all": _ALL}
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    def tread_layout(self, unet) -> None:
        return None  # a UNet changes resolution between blocks: no token sequence to route

    # ---- validation ----------------------------------------------------------------------------------------
    def _pipeline(self, transformer, text_components: dict[str, Any]):
        pipe = super()._pipeline(transformer, text_components)
        pipe.scheduler = self.sampling_scheduler(pipe.scheduler)
        return pipe

    def sampling_scheduler(self, scheduler):
        """The pipeline's scheduler, told what the run trains: ``prediction_type``, and with
        ``rescale_betas_zero_snr`` the rescaled betas and "trailing" timesteps (Lin et al. 2023, section 3.3)."""
        overrides: dict[str, Any] = {"prediction_type": self.objective.name}
        if self.config.rescale_betas_zero_snr:
            overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        if all(scheduler.config.get(k) == v for k, v in overrides.items()):
            return scheduler
        return type(scheduler).from_config(scheduler.config, **overrides)

    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1  # SDXL's guidance scale is classifier-free guidance

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """StableDiffusionXLPipeline arguments: SDXL has no distilled guidance, so ``guidance`` is classifier-free
        guidance, against the ``negative`` embedding when given (else the pipeline's zeroed empty prompt)."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "pooled_prompt_embeds": text["pooled_prompt_embeds"],
                  "guidance_scale": guidance}
        if negative is not None:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"])
        return kwargs


def sdxl_scheduler(**overrides) -> EulerDiscreteScheduler:
    """SDXL base-1.0's own scheduler configuration (scaled-linear betas, leading timesteps)."""
    config = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  timestep_spacing="leading", steps_offset=1, interpolation_type="linear", prediction_type="epsilon")
    return EulerDiscreteScheduler(**{**config, **overrides})


def tiny_unet(*, cross_attention_dim: int, pooled_dim: int, **extra) -> UNet2DConditionModel:
    """A two-level SDXL-style UNet: text-time added conditioning (6 time ids), linear attention projections."""
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), norm_num_groups=8, use_linear_projection=True, transformer_layers_per_block=(1, 1),
        cross_attention_dim=cross_attention_dim, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + pooled_dim, **extra,
    )


def tiny_vae(scaling_factor: float) -> AutoencoderKL:
    """A four-level VAE (8x downscale like the real ones) with four latent channels."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=128, scaling_factor=scaling_factor,
    )


def write_tiny_sdxl(folder: Path, seed: int = 0) -> None:
    """Write a random-initialised SDXL in the diffusers layout, seeded on a forked RNG."""
    from transformers import CLIPTextConfig

    with torch.random.fork_rng(devices=[]):
        tokenizer = tiny.clip_tokenizer(77)
        torch.manual_seed(seed)
        unet = tiny_unet(cross_attention_dim=64, pooled_dim=32)
        torch.manual_seed(seed + 1)
        vae = tiny_vae(scaling_factor=0.13025)

        def clip(projection: bool, seed_: int):
            torch.manual_seed(seed_)
            config = CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)

        StableDiffusionXLPipeline(
            vae=vae, unet=unet, scheduler=sdxl_scheduler(), tokenizer=tokenizer, tokenizer_2=tokenizer,
            text_encoder=clip(False, seed + 2), text_encoder_2=clip(True, seed + 3), add_watermarker=False,
        ).save_pretrained(folder, safe_serialization=True)
