"""PixArt Sigma (900M-1024-v0.6, 600M-512, 600M-1024, 600M-2048, tiny): a DiT trained with DDPM epsilon and a
learned variance.

Family quirks kept here:
- one text encoder, T5-XXL, with its attention mask (the transformer masks padded tokens in cross-attention);
  captions are encoded as written (``clean_caption=False``: the pipeline's cleaning needs bs4 and ftfy and
  lowercases and strips text);
- the objective is DDPM epsilon on the model's own beta schedule (``t`` an integer timestep, as the pipeline passes
  it). The transformer predicts epsilon and a variance (8 channels for 4 latent ones); the pipeline steps with the
  epsilon half only, and training, as SimpleTuner's, fits that half and leaves the variance head as it is;
- the VAE is SDXL's (``z * scaling_factor``), so taesdxl decodes previews; the pipeline reports latents through the
  older ``callback(step, t, latents)`` API;
- validation runs classifier-free guidance at ``validation_guidance`` > 1 and renders the requested size
  (``use_resolution_binning=False``);
- neither ``PixArtSigmaPipeline`` (no ``load_lora_weights``) nor diffusers' PixArt transformer (no PEFT mixin) loads
  LoRA weights: PixArt LoRAs are PEFT adapters, loaded with ``PeftModel.from_pretrained(pipe.transformer, folder)``
  as PixArt's own LoRA guide does. The LoRA is written in that format (adapter_config.json +
  adapter_model.safetensors); training uses the transformer with diffusers' PEFT methods mixed in;
- TREAD routes image tokens through the blocks: self-attention runs over image tokens only, text comes in through
  cross-attention, and positions are added at the patch embedding, so a kept token carries its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline
from diffusers import PixArtTransformer2DModel as DiffusersPixArtTransformer
from diffusers.loaders import PeftAdapterMixin
from transformers import T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# T5 tokens per prompt: PixArt Sigma was trained on 300 (SimpleTuner caps at 300 too)
DEFAULT_T5_LENGTH = {"tiny": 32}
T5_LENGTH = 300
PREVIEW_DECODER = "madebyollin/taesdxl"
# added conditions the Sigma pipeline passes (its transformers were trained without resolution/aspect embeddings)
_ADDED_COND = {"resolution": None, "aspect_ratio": None}

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_PRESETS = {
    "attention": _ATTN,  # self- and cross-attention: SimpleTuner's default for PixArt
    "self-attention": [f"attn1.{m}" for m in _ATTN],
    "all+ffs": _ATTN + ["ff.net.0.proj", "ff.net.2"],
}


class PixArtTransformer2DModel(PeftAdapterMixin, DiffusersPixArtTransformer):
    """diffusers' PixArt transformer with diffusers' PEFT methods (``add_adapter``, ``disable_adapters``), which the
    trainer uses and its class lacks; same name, config and weights."""


class PixArtSigmaAdapter(ModelAdapter):
    family = "pixart_sigma"
    pipeline_class = PixArtSigmaPipeline
    denoiser_class = PixArtTransformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (("text_encoder", T5EncoderModel, "tokenizer", T5TokenizerFast),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_pixart_sigma(folder)

    @property
    def t5_max_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_T5_LENGTH.get(self.config.model_flavour or "", T5_LENGTH))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = PixArtSigmaPipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())
        embeds, mask, _, _ = shell.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device, clean_caption=False,
            max_sequence_length=self.t5_max_length,
        )
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "prompt_attention_mask": mask[i].float().cpu()}) for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.t5_max_length}", "clean_caption=False"]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call with an integer timestep; the epsilon half of the learned-sigma output."""
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        out = transformer(
            noisy_latents.to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
            encoder_attention_mask=text["prompt_attention_mask"].to(device),
            timestep=t.to(device).long().expand(noisy_latents.shape[0]),
            added_cond_kwargs=dict(_ADDED_COND),
            return_dict=False,
        )[0]
        if model.config.out_channels // 2 == noisy_latents.shape[1]:
            out = out.chunk(2, dim=1)[0]
        return out

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        if str(path).endswith((".safetensors", ".sft")):
            raise ValueError("tread_config: count PixArt's blocks from a diffusers folder, not a single file")
        cfg = PixArtTransformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                   revision=self.config.revision)
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """Blocks: ``block(hidden_states, attention_mask, encoder_hidden_states, ...)`` -> image tokens; no text
        stream to keep and no rotary table, so each sample keeps its own subset."""
        return TreadLayout(blocks=list(transformer.transformer_blocks), image_output=None, text_arg=None,
                           text_pos=None, rotary_arg=None, rotary_pos=None, shared_selection=False)

    # ---- LoRA: PEFT's adapter format (the pipeline has no load_lora_weights) --------------------------------
    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], output_dir: str | Path) -> Path:
        """A PEFT adapter folder: adapter_config.json (rank, alpha, target modules) + adapter_model.safetensors."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        rank = self.config.lora_rank
        LoraConfig(r=rank, lora_alpha=self.config.lora_alpha if self.config.lora_alpha is not None else rank,
                   target_modules=self.lora_target_modules(None, self.config.lora_target)).save_pretrained(output_dir)
        path = output_dir / "adapter_model.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({f"base_model.model.{k}": v.contiguous() for k, v in lora_state_dict.items()}, tmp,
                  metadata={"format": "pt"})
        tmp.replace(path)
        return path

    def load_lora(self, pipeline, path: str | Path) -> None:
        """As PixArt users load a LoRA: PEFT injects it into the pipeline's transformer in place."""
        from peft import PeftModel

        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        PeftModel.from_pretrained(pipeline.transformer, str(folder))

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "guidance_scale": guidance, "max_sequence_length": self.t5_max_length, "clean_caption": False,
                  "use_resolution_binning": False}
        if negative is not None and guidance > 1:
            # negative_prompt defaults to "" in this pipeline, and may not come with negative embeddings
            kwargs.update(negative_prompt=None, negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return kwargs

    def preview_callback_kwargs(self, on_latents) -> dict:
        """The Sigma pipeline's older per-step callback (it has no ``callback_on_step_end``)."""
        return {"callback": lambda step, timestep, latents: on_latents(step, latents), "callback_steps": 1}

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _write_tiny_pixart_sigma(folder: Path, seed: int = 0) -> None:
    """A random PixArt Sigma: 4 blocks with a learned-sigma output, a T5 encoder, an SDXL-style VAE, DPM-Solver."""
    tokenizer = tiny.t5_tokenizer(512)
    torch.manual_seed(seed)
    transformer = DiffusersPixArtTransformer(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=4,
        cross_attention_dim=32, attention_bias=True, sample_size=8, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        caption_channels=32, use_additional_conditions=False,
    )
    torch.manual_seed(seed + 1)
    vae = tiny.autoencoder_kl(latent_channels=4, scaling_factor=0.13025, quant_conv=True)  # SDXL's VAE value
    torch.manual_seed(seed + 2)
    text_encoder = tiny.t5_encoder(tokenizer, d_model=32)
    scheduler = DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02,
                                            prediction_type="epsilon", num_train_timesteps=1000)
    PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 3)
    tiny.autoencoder_tiny(4).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
