"""Stable Diffusion 3 / 3.5 (medium, large, 3.0-medium, tiny): a rectified-flow MMDiT.

Family quirks kept here:
- three text encoders: CLIP-L and CLIP-G (penultimate hidden states, concatenated, zero-padded to T5's width, and
  their pooled projections concatenated) and T5-XXL, whose tokens follow the 77 CLIP tokens in one sequence;
- the transformer patchifies (B, 16, h, w) latents itself (2x2 patches, learned positions) and gets
  ``timestep = sigma * 1000``, as the pipeline passes its scheduler's 0..1000 timesteps;
- SD3.5 medium adds a second, image-only attention in its first 13 blocks (MMDiT-X) and RMS qk-norm; the same
  class and the same adapter load all of them;
- validation runs classifier-free guidance at ``validation_guidance`` > 1 (no distilled-guidance embedding);
- TREAD routes image tokens through the joint blocks: positions are added at the patch embedding, so a kept token
  carries its own, and no rotary table needs slicing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# T5 tokens per prompt: SimpleTuner caps SD3 at 154 (longer drifts from what SD3 was trained on)
DEFAULT_T5_LENGTH = {"tiny": 32}
T5_LENGTH = 154
# Tiny AutoEncoder for SD3's 16-channel latents (live previews); the tiny flavour ships its own in vae_preview/
PREVIEW_DECODER = "madebyollin/taesd3"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]  # image stream (and SD3.5's second, image-only attention)
_CONTEXT_ATTN = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_FF = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
LORA_PRESETS = {
    # SimpleTuner's default for SD3: the image stream's attention only ("seems to help more with SD3")
    "attention": _ATTN,
    "all": _ATTN + _CONTEXT_ATTN,
    "context": _CONTEXT_ATTN,
    "all+ffs": _ATTN + _CONTEXT_ATTN + _FF,
}


class SD3Adapter(ModelAdapter):
    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    denoiser_class = SD3Transformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (
        ("text_encoder", CLIPTextModelWithProjection, "tokenizer", CLIPTokenizer),
        ("text_encoder_2", CLIPTextModelWithProjection, "tokenizer_2", CLIPTokenizer),
        ("text_encoder_3", T5EncoderModel, "tokenizer_3", T5TokenizerFast),
    )
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_sd3(folder)

    @property
    def t5_max_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_T5_LENGTH.get(self.config.model_flavour or "", T5_LENGTH))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = StableDiffusion3Pipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())
        embeds, _, pooled, _ = shell.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.t5_max_length,
        )
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "pooled_prompt_embeds": pooled[i].float().cpu()}) for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.t5_max_length}"]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call: latents as they are, ``timestep = sigma * 1000``."""
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        return transformer(
            hidden_states=noisy_latents.to(dtype),
            timestep=(t.to(device) * 1000).to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
            pooled_projections=text["pooled_prompt_embeds"].to(device, dtype),
            return_dict=False,
        )[0]

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        if str(path).endswith((".safetensors", ".sft")):
            return _single_file_depth(path)
        cfg = SD3Transformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                revision=self.config.revision)
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """Joint blocks: ``block(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)`` ->
        ``(encoder_hidden_states, hidden_states)``; no rotary table, so each sample keeps its own token subset."""
        return TreadLayout(blocks=list(transformer.transformer_blocks), rotary_arg=None, rotary_pos=None,
                           shared_selection=False)

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": text["prompt_embeds"], "pooled_prompt_embeds": text["pooled_prompt_embeds"],
                  "guidance_scale": guidance, "max_sequence_length": self.t5_max_length}
        if negative is not None and guidance > 1:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"])
        return kwargs

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _single_file_depth(path: str) -> int:
    """Joint blocks in a single-file SD3 checkpoint (SAI's ``joint_blocks.N``, diffusers' ``transformer_blocks.N``)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
    blocks = set()
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in ("joint_blocks", "transformer_blocks") and parts[i + 1].isdigit():
                blocks.add(int(parts[i + 1]))
    return len(blocks)


def _write_tiny_sd3(folder: Path, seed: int = 0) -> None:
    """A random SD3.5-medium-shaped model: 4 joint blocks (the first two with the second attention), RMS qk-norm."""
    tokenizer, tokenizer_2 = tiny.clip_tokenizer(77), tiny.clip_tokenizer(77)
    tokenizer_3 = tiny.t5_tokenizer(512)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=4, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=16,
        pos_embed_max_size=32, dual_attention_layers=(0, 1), qk_norm="rms_norm",
    )
    torch.manual_seed(seed + 1)
    vae = tiny.autoencoder_kl(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609)  # SD3's own values
    torch.manual_seed(seed + 2)
    text_encoder = tiny.clip_text_encoder(tokenizer, hidden_size=16, projection_dim=16)
    torch.manual_seed(seed + 3)
    text_encoder_2 = tiny.clip_text_encoder(tokenizer_2, hidden_size=16, projection_dim=16)
    torch.manual_seed(seed + 4)
    text_encoder_3 = tiny.t5_encoder(tokenizer_3, d_model=32)
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    ).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 5)
    tiny.autoencoder_tiny(16).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
