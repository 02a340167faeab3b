"""Lumina-Image 2.0 (2.0, neta-lumina, tiny): a unified next-DiT over one text+image sequence, trained with flow
matching.

Family quirks kept here:
- one text encoder, Gemma 2 (its penultimate hidden state and attention mask). Prompts get the pipeline's system
  prompt prepended (``"<system prompt> <Prompt Start> <prompt>"``); negative prompts go in without it, as
  ``Lumina2Pipeline`` encodes its negatives;
- time runs the other way: the transformer gets ``timestep = 1 - sigma`` (0 is noise) and predicts the velocity
  towards the image, so the adapter negates it as the pipeline does before its scheduler step;
- the VAE is Flux's (``(z - shift_factor) * scaling_factor``, 16 channels), so taef1 decodes previews;
- validation runs classifier-free guidance (with the pipeline's CFG normalisation) at ``validation_guidance`` > 1;
- no TREAD: after two refiner stages the joint blocks see, per sample, the caption's real tokens, then the image
  tokens, then padding, in one sequence with a per-sample rotary table. The image tokens start at a different
  place in each sample of a batch (captions differ in length), so there is no fixed span for a router to take out
  and put back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
from transformers import Gemma2Model, GemmaTokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding

# Gemma tokens per prompt, system prompt included: the pipeline's default (and SimpleTuner's)
TEXT_LENGTH = 256
PREVIEW_DECODER = "madebyollin/taef1"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_FF = ["feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3"]


class Lumina2Adapter(ModelAdapter):
    family = "lumina2"
    pipeline_class = Lumina2Pipeline
    denoiser_class = Lumina2Transformer2DModel
    text_encoder_specs = (("text_encoder", Gemma2Model, "tokenizer", GemmaTokenizerFast),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_lumina2(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or TEXT_LENGTH)

    # ---- encoding --------------------------------------------------------------------------------------
    def _shell(self) -> Lumina2Pipeline:
        return Lumina2Pipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())

    @staticmethod
    def _embeddings(embeds, mask) -> list[TextEmbedding]:
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "prompt_attention_mask": mask[i].float().cpu()}) for i in range(embeds.shape[0])]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        embeds, mask, _, _ = self._shell().encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        self.text_encoder_forwards += 1
        return self._embeddings(embeds, mask)

    @torch.no_grad()
    def encode_negative_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        # the pipeline's own negative branch (no system prompt); it encodes the prompts beside them too
        _, _, embeds, mask = self._shell().encode_prompt(
            list(prompts), do_classifier_free_guidance=True, negative_prompt=list(prompts), device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        self.text_encoder_forwards += 1
        return self._embeddings(embeds, mask)

    def text_identity_extras(self) -> list[str]:
        return [f"text_len={self.max_sequence_length}"]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call: ``timestep = 1 - sigma``, the output negated (it points from noise to image)."""
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        out = transformer(
            hidden_states=noisy_latents.to(dtype),
            timestep=(1 - t.to(device)).to(dtype).expand(noisy_latents.shape[0]),
            encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
            # integer, as the tokenizer gives it: the transformer counts real caption tokens from it
            encoder_attention_mask=text["prompt_attention_mask"].to(device).long(),
            return_dict=False,
        )[0]
        return -out

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        presets = {
            "attention": _ATTN,  # every block's attention, refiners included: SimpleTuner's default
            "joint": [f"layers.{i}.attn.{m}" for i in range(len(transformer.layers)) for m in _ATTN],
            "all+ffs": _ATTN + _FF,
        }
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return list(presets[preset])

    def tread_layout(self, transformer) -> None:
        return None  # image tokens sit at a per-sample offset in one joint sequence (see the module docstring)

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"].long(),
                  "guidance_scale": guidance, "max_sequence_length": self.max_sequence_length}
        if negative is not None and guidance > 1:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"].long())
        return kwargs

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _write_tiny_lumina2(folder: Path, seed: int = 0) -> None:
    """A random Lumina 2: 1 refiner + 2 joint blocks, Gemma 2, a Flux-style 16-channel VAE."""
    tokenizer = tiny.gemma_tokenizer(4096)
    torch.manual_seed(seed)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(300, 64, 64),
        cap_feat_dim=32,
    )
    torch.manual_seed(seed + 1)
    vae = tiny.autoencoder_kl(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)  # Flux's VAE values
    torch.manual_seed(seed + 2)
    text_encoder = tiny.gemma2_encoder(tokenizer, hidden_size=32)
    Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0), vae=vae,
                    text_encoder=text_encoder, tokenizer=tokenizer).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 3)
    tiny.autoencoder_tiny(16).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
