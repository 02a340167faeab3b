"""Chroma (base, hd, flash, tiny): a pruned Flux.1-schnell MMDiT (8.9B) without CLIP or a guidance embedding,
trained with flow matching.

Family quirks kept here:
- one text encoder, T5-XXL, with its attention mask: unlike Flux, the padded T5 positions are masked out of the
  transformer's attention, except the first padding token (the pipeline's mask, cached beside the embeddings), and
  the image tokens are appended to that mask;
- latents are Flux's: 2x2-packed into tokens with (0, row, col) position ids, ``timestep = sigma``, the VAE
  normalising as ``(z - shift_factor) * scaling_factor``, so taef1 decodes previews;
- the modulation of every block comes from one small "approximator" network of the timestep (no pooled text, no
  guidance embedding), so classifier-free guidance is real CFG: as in SimpleTuner, ``validation_guidance_real`` is
  the pipeline's ``guidance_scale`` (1 = one pass) and ``validation_guidance`` does not apply;
- TREAD routes image tokens through the double blocks (separate streams) and the single blocks (one text+image
  sequence, ``JointSequence``), slicing the rotary table and the text+image attention mask to the kept tokens.
  diffusers' Chroma drops the mask from single blocks under gradient checkpointing; routing follows whatever
  the blocks are given.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
from transformers import T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import JointSequence, TreadLayout

# T5 tokens per prompt: the pipeline's default
DEFAULT_T5_LENGTH = {"tiny": 32}
T5_LENGTH = 512
PREVIEW_DECODER = "madebyollin/taef1"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_CONTEXT_ATTN = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_FF = ["ff.net.0.proj", "ff.net.2"]
_CONTEXT_FF = ["ff_context.net.0.proj", "ff_context.net.2"]
_SINGLE_MLP = ["proj_mlp", "proj_out"]  # single blocks' MLP and output projections (and the final one), as in Flux
LORA_PRESETS = {  # Flux's vocabulary, as SimpleTuner's Chroma uses it
    "all": _ATTN + _CONTEXT_ATTN,
    "context": _CONTEXT_ATTN,
    "context+ffs": _CONTEXT_ATTN + _CONTEXT_FF,
    "all+ffs": _ATTN + _CONTEXT_ATTN + _FF + _CONTEXT_FF + _SINGLE_MLP,
}


class ChromaAdapter(ModelAdapter):
    family = "chroma"
    pipeline_class = ChromaPipeline
    denoiser_class = ChromaTransformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (("text_encoder", T5EncoderModel, "tokenizer", T5TokenizerFast),)
    resolution_multiple = 16  # VAE /8, then 2x2 packing

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_chroma(folder)

    @property
    def t5_max_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_T5_LENGTH.get(self.config.model_flavour or "", T5_LENGTH))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = ChromaPipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())
        embeds, _, mask, _, _, _ = shell.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.t5_max_length,
        )
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "prompt_attention_mask": mask[i].float().cpu()}) for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.t5_max_length}"]

    # ---- training ----------------------------------------------------------------------------------------
    @staticmethod
    def pack_latents(latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return ChromaPipeline._pack_latents(latents, b, c, h, w)

    @staticmethod
    def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, h/2 * w/2, C*4) tokens -> (B, C, h, w) latents; the inverse of ``pack_latents``."""
        b, _, d = tokens.shape
        c = d // 4
        x = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, height, width)

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call: packed latents, ``timestep = sigma``, the text mask extended over the image."""
        b, _, h, w = noisy_latents.shape
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        embeds = text["prompt_embeds"].to(device, dtype)
        tokens = self.pack_latents(noisy_latents).to(dtype)
        # the text mask, then every image token attended (the pipeline's _prepare_attention_mask)
        mask = torch.cat([text["prompt_attention_mask"].to(device, dtype),
                          torch.ones(b, tokens.shape[1], device=device, dtype=torch.bool)], dim=1)
        out = transformer(
            hidden_states=tokens,
            timestep=t.to(device, dtype).expand(b),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
            attention_mask=mask,
            return_dict=False,
        )[0]
        return self.unpack_latents(out, h, w)

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def transformer_depth(self) -> int:
        """Double + single blocks, read from config.json without loading weights."""
        path, subfolder = self.denoiser_source()
        if str(path).endswith((".safetensors", ".sft")):
            raise ValueError("tread_config: count Chroma's blocks from a diffusers folder, not a single file")
        cfg = ChromaTransformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                   revision=self.config.revision)
        return int(cfg["num_layers"]) + int(cfg["num_single_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """Double blocks: ``block(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_mask)``;
        single blocks: ``block(text+image sequence, temb, image_rotary_emb, attention_mask)``."""
        double = transformer.transformer_blocks
        return TreadLayout(
            blocks=list(double) + list(transformer.single_transformer_blocks), mask_arg="attention_mask", mask_pos=4,
            joint=JointSequence(start=len(double), image_tokens=_packed_tokens, rotary_arg="image_rotary_emb",
                                rotary_pos=2, mask_arg="attention_mask", mask_pos=3),
        )

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """``guidance_real`` is Chroma's (real) CFG scale; ``guidance`` has nothing to feed."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "guidance_scale": guidance_real, "max_sequence_length": self.t5_max_length}
        if negative is not None and guidance_real > 1:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return kwargs

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pack_latents(latents)

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        cfg = self.vae.config
        unpacked = ChromaPipeline._unpack_latents(latents, height, width, 2 ** (len(cfg.block_out_channels) - 1))
        return unpacked / cfg.scaling_factor + cfg.shift_factor


def _packed_tokens(model, args: tuple, kwargs: dict) -> int:
    """Image tokens of the transformer's packed (B, N, C) input."""
    return (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]


def _write_tiny_chroma(folder: Path, seed: int = 0) -> None:
    """A random Chroma: 2 double + 2 single blocks, a T5 encoder, a Flux-style 16-channel VAE."""
    tokenizer = tiny.t5_tokenizer(512)
    torch.manual_seed(seed)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=1,
    )
    torch.manual_seed(seed + 1)
    vae = tiny.autoencoder_kl(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)  # Flux's VAE values
    torch.manual_seed(seed + 2)
    text_encoder = tiny.t5_encoder(tokenizer, d_model=32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   transformer=transformer).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 3)
    tiny.autoencoder_tiny(16).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
