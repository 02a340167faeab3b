"""LTX-Video 0.9.x (``LTXPipeline``): a flow-matching video DiT over a 32x spatial / 8x temporal VAE, T5 text.

Family quirks kept here:
- latents are (B, 128, F, h, w) with ``F = (frames - 1) / 8 + 1`` and ``h, w = H / 32, W / 32``, normalised as
  ``(z - latents_mean) * scaling_factor / latents_std`` (the VAE's buffers); the transformer sees them packed into
  (B, F*h*w, C) tokens (``LTXPipeline._pack_latents``), and the pipeline hands its scheduler the packed layout;
- the transformer takes ``timestep = sigma * 1000``, the T5 attention mask, the latent grid size and
  ``rope_interpolation_scale = (8 / frame_rate, 32, 32)``: the frame rate is part of the positions, so training uses
  ``framerate`` (default 25, LTX's own) and validation generates at the same rate;
- validation guidance is classifier-free guidance;
- LTX-2 (``LTX2VideoTransformer3DModel``, in this diffusers) is an audio+video model with a Gemma text encoder and
  is not a flavour of this family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
from transformers import T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

DEFAULT_TEXT_LENGTH = 128  # LTXPipeline's max_sequence_length
TINY_TEXT_LENGTH = 64
_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_FF = ["ff.net.0.proj", "ff.net.2"]


def slice_batched_rotary(rotary: Any, idx: torch.Tensor, text_len: int) -> Any:
    """RoPE as a (cos, sin) pair of (B, S, D) tensors over the video tokens only: keep each sample's kept rows."""
    index = idx.to(rotary[0].device).unsqueeze(-1)
    return tuple(r.gather(1, index.expand(-1, -1, r.shape[-1])) for r in rotary)


class LTXVideoAdapter(ModelAdapter):
    family = "ltxvideo"
    pipeline_class = LTXPipeline
    denoiser_class = LTXVideoTransformer3DModel
    vae_class = AutoencoderKLLTXVideo
    text_encoder_specs = (("text_encoder", T5EncoderModel, "tokenizer", T5TokenizerFast),)
    resolution_multiple = 32  # VAE /32, 1x1 patches
    temporal_compression = 8
    default_fps = 25.0
    default_validation_frames = 161

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_ltx(folder)

    @classmethod
    def fsdp_block_classes(cls) -> list[str]:
        return ["LTXVideoTransformerBlock"]  # diffusers' LTX transformer lists no _no_split_modules

    @property
    def text_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or (TINY_TEXT_LENGTH if self.is_tiny else DEFAULT_TEXT_LENGTH))

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.text_length}"]

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = LTXPipeline(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())
        embeds, mask, _, _ = shell.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                 max_sequence_length=self.text_length, device=self.device)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": e.float().cpu(), "prompt_attention_mask": m.bool().cpu()})
                for e, m in zip(embeds, mask)]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, frames, H, W) in [-1, 1] -> normalised (B, 128, F, h, w) latents (the posterior mean)."""
        if self.vae is None:
            self.load_vae()
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mean.float()
        self.vae_forwards += 1
        return LTXPipeline._normalize_latents(z, self.vae.latents_mean, self.vae.latents_std,
                                              self.vae.config.scaling_factor).cpu()

    # ---- training ----------------------------------------------------------------------------------------
    def rope_interpolation_scale(self) -> tuple[float, float, float]:
        return (self.temporal_compression / self.validation_fps(), self.resolution_multiple, self.resolution_multiple)

    def transformer_inputs(self, transformer, noisy_latents, t, text) -> dict[str, Any]:
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        b, _, f, h, w = noisy_latents.shape
        cfg = model.config
        return {
            "hidden_states": LTXPipeline._pack_latents(noisy_latents, cfg.patch_size, cfg.patch_size_t).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "timestep": (t.to(device, torch.float32) * 1000).expand(b),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device),
            "num_frames": f // cfg.patch_size_t, "height": h // cfg.patch_size, "width": w // cfg.patch_size,
            "rope_interpolation_scale": self.rope_interpolation_scale(),
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text) -> torch.Tensor:
        cfg = getattr(transformer, "module", transformer).config
        _, _, f, h, w = noisy_latents.shape
        out = transformer(**self.transformer_inputs(transformer, noisy_latents, t, text))[0]
        return LTXPipeline._unpack_latents(out, f // cfg.patch_size_t, h // cfg.patch_size, w // cfg.patch_size,
                                           cfg.patch_size, cfg.patch_size_t)

    def image_seq_len(self, latent_shape) -> int:
        frames = latent_shape[-3] if len(latent_shape) == 5 else 1
        return frames * latent_shape[-2] * latent_shape[-1]

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        presets = {"all": _ATTN, "all+ffs": _ATTN + _FF}
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        cfg = LTXVideoTransformer3DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                     revision=self.config.revision)
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """``LTXVideoTransformerBlock(hidden_states, encoder_hidden_states, temb, image_rotary_emb, mask)``: video
        tokens only in self-attention (text through cross-attention), per-sample (B, S, D) RoPE sliced per sample."""
        return TreadLayout(blocks=list(transformer.transformer_blocks), image_arg="hidden_states", image_pos=0,
                           text_arg="encoder_hidden_states", text_pos=1, rotary_arg="image_rotary_emb", rotary_pos=3,
                           image_output=None, slice_rotary=slice_batched_rotary, shared_selection=False)

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1 or guidance_real > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        scale = max(guidance, guidance_real)
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "guidance_scale": scale, "max_sequence_length": self.text_length}
        if negative is not None and scale > 1:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return kwargs

    def pipeline_call_kwargs(self, *, height: int, width: int, num_frames: int | None = None) -> dict:
        return {**super().pipeline_call_kwargs(height=height, width=width, num_frames=num_frames),
                "frame_rate": self.validation_fps()}

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return LTXPipeline._pack_latents(latents, 1, 1)

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return poster_frame(LTXPipeline, self.vae, latents, height // self.resolution_multiple,
                            width // self.resolution_multiple)


def poster_frame(pipeline_cls, vae, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Packed latents mid-denoise, ``h`` x ``w`` tokens a frame -> the first latent frame (the poster frame) in the
    VAE's raw space, by the pipeline's own static unpack and denormalise (LTX-Video's and LTX-2's share them)."""
    frames = latents.shape[1] // (h * w)
    unpacked = pipeline_cls._unpack_latents(latents, frames, h, w, 1, 1)[:, :, :1].float()
    return pipeline_cls._denormalize_latents(unpacked, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def write_tiny_ltx(folder: Path, seed: int = 0) -> None:
    """A random-initialised LTX-Video in the diffusers layout, with LTX's compression (32x spatial, 8x temporal),
    seeded on a forked RNG."""
    with torch.random.fork_rng(devices=[]):
        from transformers import T5Config

        tokenizer = tiny.t5_tokenizer(512)
        torch.manual_seed(seed)
        transformer = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, num_layers=4, caption_channels=32)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLLTXVideo(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False), decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
            timestep_conditioning=False, patch_size=4, patch_size_t=1)
        torch.manual_seed(seed + 2)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        # LTX-Video's own scheduler settings (resolution-dependent shift, terminal sigma 0.1)
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1)
        LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                    transformer=transformer).save_pretrained(folder, safe_serialization=True)
