"""Flux.1 (dev, krea, schnell, kontext, fluxbooru, libreflux, tiny): a rectified-flow MMDiT.

Family quirks kept here:
- latents are 2x2-packed into tokens, with (0, row, col) position ids per token and zero ids for text tokens;
- the transformer gets ``timestep = sigma`` (the pipeline divides its 0..1000 timesteps by 1000);
- guidance-distilled flavours (dev, krea, kontext, fluxbooru, tiny) take a guidance vector, schnell does not;
- the VAE normalises latents as ``(z - shift_factor) * scaling_factor``;
- Kontext (``kontext``, and ``tiny`` when the data pairs reference images) edits a reference image: its latents are
  packed into tokens like the target's and appended after them, with position ids whose first coordinate is 1, and
  only the target tokens of the output are the prediction (FluxKontextPipeline does exactly this).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# T5 sequence length per flavour (SimpleTuner's defaults; schnell was distilled with 256)
DEFAULT_T5_LENGTH = {"schnell": 256, "tiny": 64}
# Tiny AutoEncoder for Flux.1 latents (live previews); the tiny flavour ships its own in vae_preview/
PREVIEW_DECODER = "madebyollin/taef1"

_ATTN = ["to_k", "to_q", "to_v"]
_CONTEXT_ATTN = ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"]
_FF = ["ff.net.0.proj", "ff.net.2"]
_CONTEXT_FF = ["ff_context.net.0.proj", "ff_context.net.2"]
_SINGLE_MLP = ["proj_mlp", "proj_out"]


class FluxAdapter(ModelAdapter):
    family = "flux"
    pipeline_class = FluxPipeline
    edit_pipeline_class = FluxKontextPipeline
    denoiser_class = FluxTransformer2DModel
    text_encoder_specs = (
        ("text_encoder", CLIPTextModel, "tokenizer", CLIPTokenizer),
        ("text_encoder_2", T5EncoderModel, "tokenizer_2", T5TokenizerFast),
    )
    resolution_multiple = 16  # VAE /8, then 2x2 packing

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_flux(folder)

    @property
    def t5_max_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_T5_LENGTH.get(self.config.model_flavour or "", 512))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        # a pipeline shell holding only the text encoders, so prompts are encoded by diffusers' own code
        shell = FluxPipeline(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())
        prompt_embeds, pooled, _ = shell.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.t5_max_length
        )
        self.text_encoder_forwards += 1
        self.offload_idle()
        if not self.masked:
            return [TextEmbedding({"prompt_embeds": prompt_embeds[i].float().cpu(),
                                   "pooled_prompt_embeds": pooled[i].float().cpu()}) for i in range(len(prompts))]
        # the T5 tokens the pipeline padded (the same tokenizer call it makes), zeroed and masked out later
        mask = shell.tokenizer_2(list(prompts), padding="max_length", max_length=self.t5_max_length, truncation=True,
                                 return_tensors="pt").attention_mask.bool()
        prompt_embeds = prompt_embeds.float().cpu() * mask.unsqueeze(-1)
        return [TextEmbedding({"prompt_embeds": prompt_embeds[i], "pooled_prompt_embeds": pooled[i].float().cpu(),
                               "attention_mask": mask[i]}) for i in range(len(prompts))]

    @property
    def masked(self) -> bool:
        """``attention_masked_training``: padded T5 tokens are kept out of attention (LibreFlux's default)."""
        return bool(getattr(self.config, "attention_masked_training", False))

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.t5_max_length}"] + (["t5_mask"] if self.masked else [])

    def joint_attention_mask(self, text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
        """(B, T) text mask -> the (B, 1, 1, T + N) boolean mask over [text, image] tokens that Flux's attention
        takes (image tokens are always attended)."""
        image = torch.ones(text_mask.shape[0], image_tokens, dtype=torch.bool, device=text_mask.device)
        return torch.cat([text_mask.bool(), image], dim=1)[:, None, None, :]

    # ---- training ----------------------------------------------------------------------------------------
    @staticmethod
    def pack_latents(latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return FluxPipeline._pack_latents(latents, b, c, h, w)

    @staticmethod
    def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, h/2 * w/2, C*4) tokens -> (B, C, h, w) latents; the inverse of ``pack_latents``."""
        b, _, d = tokens.shape
        c = d // 4
        x = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, height, width)

    def guidance_vector(self, transformer, batch: int, device, dtype) -> torch.Tensor | None:
        if not transformer.config.guidance_embeds:
            return None
        return torch.full((batch,), float(self.config.guidance_value), device=device, dtype=dtype)

    def model_inputs(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """FluxPipeline's transformer arguments: the pipeline passes ``timestep / 1000``, i.e. sigma itself. With
        ``reference_latents`` (Kontext), FluxKontextPipeline's: the reference tokens follow the target tokens, their
        position ids marked 1 in the first coordinate."""
        b, _, h, w = noisy_latents.shape
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        dtype = model.dtype
        device = noisy_latents.device
        prompt_embeds = text["prompt_embeds"].to(device, dtype)
        tokens = self.pack_latents(noisy_latents).to(dtype)
        ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        reference = text.get("reference_latents")
        if reference is not None:
            rh, rw = reference.shape[-2:]
            ref_ids = FluxPipeline._prepare_latent_image_ids(b, rh // 2, rw // 2, device, dtype)
            ref_ids[..., 0] = 1
            tokens = torch.cat([tokens, self.pack_latents(reference.to(device, dtype))], dim=1)
            ids = torch.cat([ids, ref_ids], dim=0)
        inputs = {
            "hidden_states": tokens,
            "timestep": t.to(device, dtype),
            "guidance": self.guidance_vector(model, b, device, dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device, dtype),
            "encoder_hidden_states": prompt_embeds,
            "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
            "img_ids": ids,
            "return_dict": False,
        }
        if self.masked:
            if "attention_mask" not in text:
                raise ValueError("attention_masked_training: these text embeddings were cached without their T5 "
                                 "attention mask; delete the text cache so they are encoded again")
            inputs["joint_attention_kwargs"] = {
                "attention_mask": self.joint_attention_mask(text["attention_mask"].to(device), tokens.shape[1])}
        return inputs

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        _, _, h, w = noisy_latents.shape
        out = transformer(**self.model_inputs(transformer, noisy_latents, t, text))[0]
        return self.unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)  # the target's tokens (Kontext adds more)

    def image_token_mask(self, mask: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """A token is kept when any of its 2x2 latents is masked in; reference tokens (Kontext) are not forced."""
        b, _, h, w = mask.shape
        tokens = mask.view(b, h // 2, 2, w // 2, 2).any(4).any(2).reshape(b, -1)
        reference = text.get("reference_latents")
        if reference is not None:
            extra = (reference.shape[-2] // 2) * (reference.shape[-1] // 2)
            tokens = torch.cat([tokens, tokens.new_zeros(b, extra)], dim=1)
        return tokens

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        """Module names for a ``lora_target`` preset (PEFT matches them as name suffixes)."""
        n_single = len(transformer.single_transformer_blocks)
        presets = {
            "mmdit": [f"transformer_blocks.{i}.attn.{m}" for i in range(len(transformer.transformer_blocks))
                      for m in _ATTN + ["to_out.0"] + _CONTEXT_ATTN],
            "all": _ATTN + ["to_out.0"] + _CONTEXT_ATTN,
            "context": _CONTEXT_ATTN,
            "context+ffs": _CONTEXT_ATTN + _CONTEXT_FF,
            "all+ffs": _ATTN + ["to_out.0"] + _CONTEXT_ATTN + _FF + _CONTEXT_FF + _SINGLE_MLP,
            # two (one) single-block output projections; at 7/38 and 20/38 of the depth, i.e. 7 and 20 on Flux.1
            "tiny": sorted({f"single_transformer_blocks.{_at_depth(f, n_single)}.proj_out" for f in (7 / 38, 20 / 38)}),
            "nano": [f"single_transformer_blocks.{_at_depth(7 / 38, n_single)}.proj_out"],
        }
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    # SimpleTuner trains LyCORIS on Flux's attention by default
    default_lycoris_preset = "attn-only"

    def lycoris_presets(self) -> dict[str, dict]:
        return {
            "attn-only": {"target_module": ["FluxAttention"]},
            "attn-mlp": {"target_module": ["FluxAttention", "FeedForward"]},
            "full": {"target_module": ["FluxTransformerBlock", "FluxSingleTransformerBlock"]},
        }

    def lycoris_module_aliases(self) -> dict[str, str]:
        # diffusers' Flux names its attention class FluxAttention; SimpleTuner's examples say "Attention"
        return {"Attention": "FluxAttention"}

    def transformer_depth(self) -> int:
        """Double + single blocks, read from config.json (or a single file's tensor names) without loading weights."""
        path, subfolder = self.denoiser_source()
        if str(path).endswith((".safetensors", ".sft")):
            return _single_file_depth(path)
        cfg = FluxTransformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                 revision=self.config.revision)
        return int(cfg["num_layers"]) + int(cfg["num_single_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        return TreadLayout(blocks=list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks))

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """FluxPipeline arguments for one image from batched cached embeddings: ``guidance`` is Flux's distilled
        guidance; ``guidance_real`` > 1 with a ``negative`` embedding turns on true classifier-free guidance."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "pooled_prompt_embeds": text["pooled_prompt_embeds"],
                  "guidance_scale": guidance, "max_sequence_length": self.t5_max_length}
        if "reference_latents" in text:  # FluxKontextPipeline takes already-encoded latents as its image
            reference = text["reference_latents"]
            # references are cropped to the output's size; without max_area the pipeline resizes to 1024x1024
            kwargs.update(image=reference, max_area=reference.shape[-2] * reference.shape[-1] * self.vae_scale_factor ** 2)
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"], true_cfg_scale=guidance_real)
        return kwargs

    def validation_attention_kwargs(self, text, negative, width: int, height: int) -> dict:
        """With ``attention_masked_training`` validation images are made with the same masking; the pipeline runs
        its true-CFG negative pass with the same kwargs, so that pass attends to the union of both prompts' tokens
        (their padding embeddings are zero either way)."""
        if not self.masked:
            return {}
        mask = text["attention_mask"].bool()
        if negative is not None and "attention_mask" in negative:
            mask = mask | negative["attention_mask"].bool()
        tokens = (height // 16) * (width // 16)
        return {"joint_attention_kwargs": {"attention_mask": self.joint_attention_mask(mask, tokens)}}

    def reference_pipeline_kwargs(self, image) -> dict:
        """FluxKontextPipeline's ``image``; without its resize to a preferred Kontext resolution, since training
        crops references to their target's bucket, and with the output's area (which it otherwise sets to 1024^2)."""
        return {"image": image, "_auto_resize": False, "max_area": image.width * image.height}

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pack_latents(latents)

    def preview_decoder_source(self) -> tuple[str, str | None]:
        """The Tiny AutoEncoder (taef1) that decodes live previews; the tiny flavour ships its own random one."""
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's packed latents mid-denoise -> (B, C, h, w) in the VAE's raw latent space (what an
        AutoencoderTiny decodes)."""
        cfg = self.vae.config
        unpacked = FluxPipeline._unpack_latents(latents, height, width, 2 ** (len(cfg.block_out_channels) - 1))
        return unpacked / cfg.scaling_factor + cfg.shift_factor


def _single_file_depth(path: str) -> int:
    """Blocks in a single-file Flux checkpoint, counted from its tensor names (BFL's ``double_blocks.N`` /
    ``single_blocks.N`` or diffusers' ``transformer_blocks.N`` / ``single_transformer_blocks.N``)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
    blocks = {".".join(k.split(".")[:2]) for k in keys
              if k.split(".")[0] in ("double_blocks", "single_blocks", "transformer_blocks", "single_transformer_blocks")}
    return len(blocks)


def _at_depth(fraction: float, depth: int) -> int:
    return min(depth - 1, int(math.floor(fraction * depth + 1e-9)))


def write_tiny_flux(folder: Path, seed: int = 0) -> None:
    """Write a random-initialised Flux in the diffusers layout: model_index.json + one folder per component.

    Seeded on a forked RNG, so writing it in the middle of a run does not change that run's random draws.
    """
    with torch.random.fork_rng(devices=[]):
        _write_tiny_flux(folder, seed)


def _write_tiny_flux(folder: Path, seed: int) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = tiny.clip_tokenizer(77)
    tokenizer_2 = tiny.t5_tokenizer(512)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=128,
        # FluxPipeline needs an explicit shift_factor (its None default fails); Flux.1's own values
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    torch.manual_seed(seed + 3)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 4)
    # a Tiny AutoEncoder for live previews, matching the tiny VAE's latents (4 channels, 8x upscale)
    AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), latent_channels=4,
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1),
    ).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
