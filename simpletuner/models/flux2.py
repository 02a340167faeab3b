"""FLUX.2 (dev; Klein: klein-4b, klein-9b; tiny): a rectified-flow MMDiT on a 32-channel VAE, with an LLM encoder.

Two pipelines, chosen by flavour (``pipeline_class`` and ``text_encoder_specs`` are set per instance):
- ``dev``: ``Flux2Pipeline``, Mistral-Small-3.1 (``Mistral3ForConditionalGeneration``, hidden layers 10, 20, 30
  stacked per token) behind Mistral's system prompt, and a distilled-guidance embedding (``guidance_value``);
- Klein (``klein-4b``, ``klein-9b``, and ``tiny``, a Klein-shaped random model): ``Flux2KleinPipeline``, Qwen3
  (layers 9, 18, 27) behind Qwen3's chat template with thinking off, no guidance embedding, true CFG.

Family quirks kept here:
- prompts are padded to 512 tokens and the transformer attends to all of them (no mask), so the whole padded
  sequence is cached (the padding tokens' hidden states are not zero);
- the VAE's latents are 2x2-patchified (32 -> 128 channels) and normalised by the VAE's own BatchNorm statistics;
  that patchified, normalised (B, 128, H/16, W/16) tensor is the training layout, packed into tokens one per pixel;
- the transformer gets ``timestep = sigma`` (the pipelines divide their 0..1000 timesteps by 1000);
- TREAD routes the double-stream blocks only: the single-stream blocks take text and image as one concatenated
  sequence the layout cannot tell apart (8 of 56 blocks on dev, 5 of 25 on Klein 4B, 8 of 32 on Klein 9B);
- FLUX.2's Tiny AutoEncoder (taef2) is not in diffusers' AutoencoderTiny format: no live previews.

Flux2Pipeline's ``tokenizer`` is Mistral's PixtralProcessor, of which the pipeline uses only the chat template and the
tokenizer; the processor needs torchvision (whose CUDA wheels do not load beside a CPU torch), so without torchvision
the same folder's tokenizer is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import Mistral3ForConditionalGeneration, Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

KLEIN_FLAVOURS = ("klein-4b", "klein-9b", "tiny")
# both pipelines' default (and the only length FLUX.2 was trained with; SimpleTuner forces it)
DEFAULT_MAX_SEQUENCE_LENGTH = 512

_ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj"]
_CONTEXT = ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
_FF = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]


class MistralTokenizer:
    """Loads Flux2Pipeline's ``tokenizer`` folder: the PixtralProcessor with torchvision, its tokenizer without."""

    @staticmethod
    def from_pretrained(path, **kwargs):
        from transformers import AutoProcessor, AutoTokenizer
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():
            return AutoProcessor.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if tokenizer.chat_template is None:
            raise ValueError(f"{path}: the tokenizer has no chat template of its own; FLUX.2 dev's PixtralProcessor "
                             "(which carries it) needs torchvision installed")
        return tokenizer


class Flux2Adapter(ModelAdapter):
    family = "flux2"
    # the tiny (Klein-shaped) flavour's; dev sets its own in __init__
    pipeline_class = Flux2KleinPipeline
    denoiser_class = Flux2Transformer2DModel
    vae_class = AutoencoderKLFlux2
    text_encoder_specs = (("text_encoder", Qwen3ForCausalLM, "tokenizer", Qwen2Tokenizer),)
    resolution_multiple = 16  # VAE /8, then 2x2 patchified

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        if not self.is_klein:
            self.pipeline_class = Flux2Pipeline
            self.text_encoder_specs = (("text_encoder", Mistral3ForConditionalGeneration, "tokenizer",
                                        MistralTokenizer),)

    @property
    def is_klein(self) -> bool:
        return self.config.model_flavour in KLEIN_FLAVOURS

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_flux2_klein(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_MAX_SEQUENCE_LENGTH)

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = self.pipeline_class(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())
        embeds, _ = shell.encode_prompt(list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": e.float().cpu()}) for e in embeds]

    def text_identity_extras(self) -> list[str]:
        return [f"max_sequence_length={self.max_sequence_length}"]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, 3, H, W) in [-1, 1] -> (B, 128, H/16, W/16): the posterior mode, 2x2-patchified, normalised by
        the VAE's BatchNorm statistics (what the pipelines do to a reference image)."""
        if self.vae is None:
            self.load_vae()
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        self.vae_forwards += 1
        mean, std = self._bn_stats(latents)
        return ((Flux2Pipeline._patchify_latents(latents) - mean) / std).float().cpu()

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.load_vae()
        latents = latents.to(self.device, self.vae.dtype)
        mean, std = self._bn_stats(latents)
        return self.vae.decode(Flux2Pipeline._unpatchify_latents(latents * std + mean)).sample

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like)
        return mean, torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like)

    # ---- training ----------------------------------------------------------------------------------------
    def model_inputs(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The pipelines' transformer arguments: one token per latent pixel with (t, h, w, l) position ids, the text
        with (0, 0, 0, l) ids, ``timestep / 1000`` (sigma itself), and dev's guidance vector."""
        b = noisy_latents.shape[0]
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        dtype, device = model.dtype, noisy_latents.device
        prompt_embeds = text["prompt_embeds"].to(device, dtype)
        guidance = None
        if model.config.guidance_embeds:
            guidance = torch.full((b,), float(self.config.guidance_value), device=device, dtype=torch.float32)
        return {
            "hidden_states": Flux2Pipeline._pack_latents(noisy_latents).to(dtype),
            "timestep": t.to(device, dtype).expand(b),
            "guidance": guidance,
            "encoder_hidden_states": prompt_embeds,
            "txt_ids": Flux2Pipeline._prepare_text_ids(prompt_embeds).to(device),
            "img_ids": Flux2Pipeline._prepare_latent_ids(noisy_latents).to(device),
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        out = transformer(**self.model_inputs(transformer, noisy_latents, t, text))[0][:, : h * w]
        return out.permute(0, 2, 1).reshape(b, c, h, w)

    def image_seq_len(self, latent_shape) -> int:
        return latent_shape[-2] * latent_shape[-1]

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        # the single-stream blocks' output projection is named like the double-stream blocks' ModuleList
        single_out = [f"single_transformer_blocks.{i}.attn.to_out"
                      for i in range(len(transformer.single_transformer_blocks))]
        presets = {
            "attention": _ATTN,  # SimpleTuner's default: image attention and the single blocks' fused projection
            "all": _ATTN + _CONTEXT + single_out,
            "context": _CONTEXT,
            "all+ffs": _ATTN + _CONTEXT + single_out + _FF,
        }
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    def transformer_depth(self) -> int:
        """The double-stream blocks TREAD routes (read from config.json, without loading weights)."""
        path, subfolder = self.denoiser_source()
        cfg = Flux2Transformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                  revision=self.config.revision)
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """The double-stream blocks: (hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
        image_rotary_emb, ...) -> (encoder_hidden_states, hidden_states), a (cos, sin) table over text then image
        without a batch dimension."""
        return TreadLayout(blocks=list(transformer.transformer_blocks), rotary_pos=4)

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """dev: ``guidance`` is its distilled guidance (Flux2Pipeline has no negative prompt). Klein: no guidance
        embedding; ``guidance_real`` > 1 with a ``negative`` embedding is its classifier-free guidance scale."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "max_sequence_length": self.max_sequence_length}
        if not self.is_klein:
            return {**kwargs, "guidance_scale": guidance}
        kwargs["guidance_scale"] = 1.0
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"], guidance_scale=guidance_real)
        return kwargs

    def scheduler_input(self, prediction, noisy_latents, t):
        """The pipelines take (B, C, h, w) ``latents=`` but pack them, and step their scheduler on tokens."""
        return Flux2Pipeline._pack_latents(prediction)


def tiny_flux2_vae(seed: int) -> AutoencoderKLFlux2:
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=64,
    )
    # BatchNorm statistics as a trained VAE has them (not the identity a fresh BatchNorm starts as)
    vae.bn.running_mean.normal_(0, 0.2)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def tiny_flux2_transformer(seed: int, *, joint_attention_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=3, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=joint_attention_dim, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def _write_tiny_flux2_klein(folder: Path, seed: int = 0) -> None:
    tokenizer = tiny.qwen2_tokenizer()
    transformer = tiny_flux2_transformer(seed, joint_attention_dim=3 * 32, guidance_embeds=False)
    vae = tiny_flux2_vae(seed + 1)
    torch.manual_seed(seed + 2)
    # 27 layers: the pipeline stacks hidden layers 9, 18 and 27, as on the real Qwen3
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=27, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer, is_distilled=False).save_pretrained(folder, safe_serialization=True)
