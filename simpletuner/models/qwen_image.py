"""Qwen-Image (v1.0, v2.0 = Qwen-Image-2512, tiny): a 20B rectified-flow MMDiT with a Qwen2.5-VL text encoder.

Family quirks kept here:
- the prompt is wrapped in Qwen-Image's system template and the template's tokens are cut off after encoding
  (``QwenImagePipeline.encode_prompt`` does both); the last hidden state of Qwen2.5-VL is the text embedding, one
  vector per real token, so embeddings are cached unpadded with their mask and padded per batch;
- the VAE is the Wan-style video VAE (one frame) and normalises latents per channel with ``latents_mean`` /
  ``latents_std``; the transformer sees the latents 2x2-packed into tokens and gets ``timestep = sigma``;
- the scheduler's resolution-dependent (exponential) shift constants are Qwen-Image's own (8192 max tokens);
- TREAD routes image tokens through the dual-stream blocks: the image and text streams stay separate tensors in
  every block and the rotary table is an (image, text) pair, so only the image half is sliced;
- no Tiny AutoEncoder in diffusers' format decodes the Wan latent space, so there are no live previews.

Qwen-Image 2.1 (``QwenImage21Pipeline``) is not a flavour here: its transformer is a different class
(``QwenImage21Transformer2DModel``, KV-cached prefix attention), with a Qwen3-VL text encoder and its own VAE.

Reference-image conditioning (the Edit flavours) is meant to extend this adapter: ``encode_prompts`` takes the
images through ``encode_kwargs``, and ``model_inputs`` builds the transformer's arguments in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# QwenImagePipeline's __call__ default; prompts are cut to it when the pipeline is given embeddings
DEFAULT_MAX_SEQUENCE_LENGTH = 512

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_CONTEXT_ATTN = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_FF = ["img_mlp.net.0.proj", "img_mlp.net.2"]
_CONTEXT_FF = ["txt_mlp.net.0.proj", "txt_mlp.net.2"]
LORA_PRESETS = {
    "attention": _ATTN,  # SimpleTuner's default: the image stream's attention
    "all": _ATTN + _CONTEXT_ATTN,
    "context": _CONTEXT_ATTN,
    "context+ffs": _CONTEXT_ATTN + _CONTEXT_FF,
    "all+ffs": _ATTN + _CONTEXT_ATTN + _FF + _CONTEXT_FF,
}


def slice_image_rotary(rotary: Any, idx: torch.Tensor, text_len: int) -> Any:
    """Qwen-Image's rotary table is ``(image_freqs, text_freqs)``, each (tokens, dim) without a batch dimension:
    keep the rows of the kept image tokens, the text half as it is."""
    image_freqs, text_freqs = rotary
    kept = idx[0]
    if idx.shape[0] > 1 and idx.stride(0) != 0 and not bool((idx == kept).all()):
        raise ValueError("slice_image_rotary: a rotary table without a batch dimension needs shared_selection=True")
    return image_freqs.index_select(0, kept.to(image_freqs.device)), text_freqs


def qwen_image_tread_layout(transformer) -> TreadLayout:
    """The dual-stream blocks, as they take their arguments (also positionally, under gradient checkpointing)."""
    return TreadLayout(blocks=list(transformer.transformer_blocks), image_pos=0, text_pos=1, rotary_pos=4,
                       image_output=1, slice_rotary=slice_image_rotary)


class QwenImageAdapter(ModelAdapter):
    family = "qwen_image"
    pipeline_class = QwenImagePipeline
    denoiser_class = QwenImageTransformer2DModel
    lora_presets = LORA_PRESETS
    vae_class = AutoencoderKLQwenImage
    text_encoder_specs = (("text_encoder", Qwen2_5_VLForConditionalGeneration, "tokenizer", Qwen2Tokenizer),)
    resolution_multiple = 16  # VAE /8, then 2x2 packing

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_qwen_image(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_MAX_SEQUENCE_LENGTH)

    # ---- encoding --------------------------------------------------------------------------------------
    def text_pipeline(self):
        """A pipeline shell holding only the text encoder, so prompts are encoded by diffusers' own code."""
        return self.pipeline_class(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())

    def encode_kwargs(self, prompts: list[str]) -> dict:
        """Extra ``encode_prompt`` arguments (an Edit flavour adds its reference images here)."""
        return {}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        embeds, mask = self.text_pipeline().encode_prompt(
            list(prompts), device=self.device, max_sequence_length=self.max_sequence_length,
            **self.encode_kwargs(prompts),
        )
        self.text_encoder_forwards += 1
        lengths = mask.sum(1).tolist() if mask is not None else [embeds.shape[1]] * len(prompts)
        # each prompt keeps its own tokens only; a batch pads them again (TextEmbedding.collate)
        return [TextEmbedding({"prompt_embeds": embeds[i, :n].float().cpu(),
                               "prompt_embeds_mask": torch.ones(n, dtype=torch.long)})
                for i, n in enumerate(int(n) for n in lengths)]

    def text_identity_extras(self) -> list[str]:
        return [f"max_sequence_length={self.max_sequence_length}"]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, 3, H, W) in [-1, 1] -> (B, C, h, w): the posterior mean of the one-frame video VAE, normalised
        per channel, ``(z - latents_mean) / latents_std``."""
        if self.vae is None:
            self.load_vae()
        latents = self.vae.encode(pixels.unsqueeze(2).to(self.device, self.vae.dtype)).latent_dist.mean[:, :, 0]
        self.vae_forwards += 1
        mean, std = self._latent_stats(latents)
        return ((latents - mean) / std).float().cpu()

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.load_vae()
        latents = latents.to(self.device, self.vae.dtype)
        mean, std = self._latent_stats(latents)
        return self.vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0]

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1)
        return (torch.tensor(cfg.latents_mean).view(shape).to(like), torch.tensor(cfg.latents_std).view(shape).to(like))

    # ---- training ----------------------------------------------------------------------------------------
    @staticmethod
    def pack_latents(latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return QwenImagePipeline._pack_latents(latents, b, c, h, w)

    @staticmethod
    def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, h/2 * w/2, C*4) tokens -> (B, C, h, w) latents; the inverse of ``pack_latents``."""
        b, _, d = tokens.shape
        x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, d // 4, height, width)

    def model_inputs(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """QwenImagePipeline's transformer arguments: packed latents, ``timestep / 1000`` (sigma itself), the text
        mask (None when every token is real, as the pipeline passes it) and the (frames, h/2, w/2) token grid."""
        b, _, h, w = noisy_latents.shape
        dtype = getattr(transformer, "module", transformer).dtype  # unwrap DDP
        device = noisy_latents.device
        mask = text["prompt_embeds_mask"].to(device)
        return {
            "hidden_states": self.pack_latents(noisy_latents).to(dtype),
            "timestep": t.to(device, dtype).expand(b),
            "guidance": None,
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
            "img_shapes": [[(1, h // 2, w // 2)]] * b,
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        _, _, h, w = noisy_latents.shape
        out = transformer(**self.model_inputs(transformer, noisy_latents, t, text))[0]
        return self.unpack_latents(out, h, w)

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def _transformer_config(self) -> dict:
        path, subfolder = self.denoiser_source()
        return QwenImageTransformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                       revision=self.config.revision)

    def transformer_depth(self) -> int:
        cfg = self._transformer_config()
        if cfg.get("zero_cond_t"):
            raise ValueError("tread_config: this Qwen-Image transformer (zero_cond_t) modulates each image token by "
                             "its own index, which TREAD does not route")
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout | None:
        """Blocks take (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb,
        ...) and return (encoder_hidden_states, hidden_states); the text mask is text-only, so routing leaves it.
        A zero_cond_t transformer (Edit 2509 and later) also takes a per-image-token ``modulate_index`` that the
        layout cannot slice: no routing there."""
        if transformer.config.zero_cond_t:
            return None
        return qwen_image_tread_layout(transformer)

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """Qwen-Image has no guidance embedding: ``guidance_real`` > 1 with a ``negative`` embedding is its (true)
        classifier-free guidance scale, otherwise guidance is off."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_embeds_mask": text["prompt_embeds_mask"],
                  "max_sequence_length": self.max_sequence_length, "true_cfg_scale": 1.0}
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_embeds_mask=negative["prompt_embeds_mask"], true_cfg_scale=guidance_real)
        return kwargs

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pack_latents(latents)


def _write_tiny_qwen_image(folder: Path, seed: int = 0) -> None:
    tokenizer = tiny.qwen2_tokenizer(chat_template=None)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.8, 1.2],
    )
    torch.manual_seed(seed + 2)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.QWEN_SPECIALS}
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=1e6,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=56),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    ))
    # Qwen-Image's own scheduler settings (exponential resolution-dependent shift up to 8192 tokens)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
    )
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer).save_pretrained(folder, safe_serialization=True)
