"""Z-Image (turbo, base, tiny): a 6B single-stream DiT with a Qwen3-4B text encoder.

Family quirks kept here:
- the prompt goes through Qwen3's chat template (one user turn, the generation prompt, thinking on) and the
  second-to-last hidden layer of every real token is the embedding (``ZImagePipeline.encode_prompt``): cached
  unpadded with a mask, handed to the transformer as one tensor per sample;
- the transformer takes lists of (C, 1, h, w) latents and per-sample caption tensors, its timestep runs the other
  way (``1 - sigma``) and the pipeline negates its output;
- the VAE is Flux.1's (``(z - shift_factor) * scaling_factor``), so taef1 decodes live previews;
- ``guidance_scale`` in ZImagePipeline adds ``s * (cond - uncond)`` to the conditional prediction, i.e. standard
  classifier-free guidance of weight ``s + 1``: ``validation_guidance_real`` (the standard weight) maps to
  ``guidance_scale = validation_guidance_real - 1``.

No TREAD layout: every block sees one per-sample sequence of image tokens followed by caption tokens, each padded to
a multiple of 32 and the batch padded to its longest, with an attention mask; the layout cannot tell the image part
of that tensor from the caption part.

Turbo is distilled for few-step sampling; SimpleTuner trains it through Ostris's de-distillation assistant LoRA,
which is not loaded here, so ``base`` (the undistilled model) is the default flavour.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# ZImagePipeline's default (its __call__ and encode_prompt)
DEFAULT_MAX_SEQUENCE_LENGTH = 512
# Tiny AutoEncoder for Flux.1 latents (Z-Image uses Flux.1's VAE); the tiny flavour ships its own in vae_preview/
PREVIEW_DECODER = "madebyollin/taef1"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_PRESETS = {
    "attention": _ATTN,  # SimpleTuner's default: every block's attention (main layers and both refiners)
    "all+ffs": _ATTN + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
}


class ZImageAdapter(ModelAdapter):
    family = "z_image"
    pipeline_class = ZImagePipeline
    denoiser_class = ZImageTransformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (("text_encoder", Qwen3Model, "tokenizer", Qwen2Tokenizer),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_z_image(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_MAX_SEQUENCE_LENGTH)

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = ZImagePipeline(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())
        embeds, _ = shell.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                        max_sequence_length=self.max_sequence_length)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": e.float().cpu(), "prompt_embeds_mask": torch.ones(len(e), dtype=torch.long)})
                for e in embeds]

    def text_identity_extras(self) -> list[str]:
        return [f"max_sequence_length={self.max_sequence_length}"]

    @staticmethod
    def caption_list(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """A padded batch (B, L, D) + mask -> the per-sample caption tensors the pipeline hands the transformer."""
        return [e[m.bool()] for e, m in zip(embeds, mask.to(embeds.device))]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """ZImagePipeline's call: one (C, 1, h, w) latent and one caption per sample, ``timestep = 1 - sigma``, the
        stacked output negated."""
        b = noisy_latents.shape[0]
        dtype = getattr(transformer, "module", transformer).dtype  # unwrap DDP
        device = noisy_latents.device
        captions = self.caption_list(text["prompt_embeds"].to(device, dtype), text["prompt_embeds_mask"])
        out = transformer(list(noisy_latents.to(dtype).unsqueeze(2).unbind(0)),
                          (1 - t.to(device, dtype)).expand(b), captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def tread_layout(self, transformer) -> TreadLayout | None:
        return None  # see the module docstring: image and caption tokens share one padded sequence per sample

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": self.caption_list(text["prompt_embeds"], text["prompt_embeds_mask"]),
                  "guidance_scale": 0.0, "max_sequence_length": self.max_sequence_length}
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=self.caption_list(negative["prompt_embeds"],
                                                                   negative["prompt_embeds_mask"]),
                          guidance_scale=guidance_real - 1)
        return kwargs

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _write_tiny_z_image(folder: Path, seed: int = 0) -> None:
    tokenizer = tiny.qwen2_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64],
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=128,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,  # Flux.1's
    )
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)  # Z-Image-Turbo's
    ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   transformer=transformer).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 3)
    # a Tiny AutoEncoder for live previews, matching the tiny VAE's latents (4 channels, 8x upscale)
    AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), latent_channels=4,
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1),
    ).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
