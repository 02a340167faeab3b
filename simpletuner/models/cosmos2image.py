"""Cosmos-Predict2 text-to-image (2B, 14B, tiny): NVIDIA's DiT with a T5-XXL text encoder, trained as EDM.

Family quirks kept here:
- Cosmos2TextToImagePipeline runs an EDM sampler (Karras sigmas from ``sigma_max`` = 80, latents scaled by it) but
  preconditions its model so that the transformer sees rectified-flow latents ``x_t = (1 - t) x_0 + t noise`` at
  ``t = sigma / (1 + sigma)`` and predicts the velocity ``noise - x_0``: training is flow matching in ``t``.
  SimpleTuner's EDM loss (log-normal sigma, x0 error weighted by ``(sigma^2 + 1) / sigma^2``) is exactly that
  velocity loss with logit-normal ``t`` (shift 1) and the weight ``t^2 + (1 - t)^2``; ``CosmosFlowMatching`` adds the
  weight and reads the pipeline's EDM sigmas as ``t``. The pipeline hands its scheduler an EDM noise estimate,
  ``x_t + (1 - t) * velocity`` (``scheduler_input``);
- T5 embeddings are zeroed after each prompt's tokens and the pipeline passes all 512 positions to the transformer
  with no mask: a prompt is cached as its own tokens and zero-padded back to 512 at use (the same input);
- the VAE is the Wan 2.1 video VAE (one frame), latents normalised by ``latents_mean`` / ``latents_std``;
- diffusers resizes the transformer's padding mask with torchvision; where torchvision is not installed (its CUDA
  wheels do not load beside the CPU torch) this module gives diffusers the one call it makes, a nearest resize,
  which is what torchvision's tensor resize runs (``torch.nn.functional.interpolate(mode="nearest")``);
- the pipeline refuses to run without NVIDIA's guardrail (the cosmos_guardrail package, which downloads its own
  models): ``Cosmos2TrainingPipeline`` uses the guardrail when it is installed and otherwise runs validation without
  it, as SimpleTuner's copy of the pipeline does; generating for use rather than for training previews is governed
  by the NVIDIA Open Model License;
- Cosmos2TextToImagePipeline has no ``load_lora_weights``: a LoRA is saved in diffusers' Cosmos LoRA format and
  loaded with the transformer's ``load_lora_adapter(path, prefix="transformer")``, as its users load it;
- no Tiny AutoEncoder in diffusers' format decodes the Wan latent space, so there are no live previews.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLWan,
    Cosmos2TextToImagePipeline,
    CosmosTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.loaders import CosmosLoraLoaderMixin
from diffusers.models.transformers import transformer_cosmos
from diffusers.pipelines.cosmos import pipeline_cosmos2_text2image
from diffusers.utils import is_cosmos_guardrail_available
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.objectives import FlowMatching
from simpletuner.models.tread_layout import TreadLayout

# Cosmos2TextToImagePipeline's default (T5 is padded to it)
DEFAULT_MAX_SEQUENCE_LENGTH = 512
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_PRESETS = {
    "attention": _ATTN,  # self- and cross-attention: SimpleTuner's default
    "self-attention": [f"attn1.{m}" for m in _ATTN],
    "all+ffs": _ATTN + ["ff.net.0.proj", "ff.net.2"],
}

if not hasattr(transformer_cosmos, "transforms"):  # torchvision missing: see the module docstring
    def _nearest_resize(tensor: torch.Tensor, size, interpolation=None) -> torch.Tensor:
        return F.interpolate(tensor, size=list(size), mode="nearest")

    transformer_cosmos.transforms = SimpleNamespace(functional=SimpleNamespace(resize=_nearest_resize),
                                                    InterpolationMode=SimpleNamespace(NEAREST="nearest"))


class _NoGuardrail:
    """Stands in for CosmosSafetyChecker when cosmos_guardrail is not installed: passes text and video through."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames):
        return frames


class Cosmos2TrainingPipeline(Cosmos2TextToImagePipeline):
    """Cosmos2TextToImagePipeline for training-time validation: NVIDIA's guardrail when cosmos_guardrail is
    installed, otherwise none (diffusers' class refuses to start without it). Loads the same model folders."""

    def __init__(self, text_encoder, tokenizer, transformer, vae, scheduler, safety_checker=None):
        if safety_checker is None and is_cosmos_guardrail_available():
            safety_checker = pipeline_cosmos2_text2image.CosmosSafetyChecker()
        super().__init__(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                         scheduler=scheduler, safety_checker=safety_checker or _NoGuardrail())
        if isinstance(self.safety_checker, _NoGuardrail):
            self.register_to_config(safety_checker=(None, None))  # nothing to save or to load


class CosmosFlowMatching(FlowMatching):
    """Flow matching in Cosmos's ``t = sigma / (1 + sigma)``, weighted as its EDM loss (see the module docstring)."""

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor:
        """SimpleTuner's EDM weighting of each sample's squared error: t^2 + (1 - t)^2."""
        t = t.float()
        return t ** 2 + (1 - t) ** 2

    def per_sample_loss(self, pred, target, t, weight=None):
        """Cosmos's eval loss is its training loss per sample: the EDM weight included."""
        return super().per_sample_loss(pred, target, t, weight) * self.loss_weights(t).to(pred.device)

    def pipeline_timestep(self, scheduler, index: int) -> torch.Tensor:
        sigma = scheduler.sigmas[index].reshape(1).float()
        return sigma / (1 + sigma)


class Cosmos2ImageAdapter(ModelAdapter):
    family = "cosmos2image"
    pipeline_class = Cosmos2TrainingPipeline
    denoiser_class = CosmosTransformer3DModel
    lora_presets = LORA_PRESETS
    vae_class = AutoencoderKLWan
    text_encoder_specs = (("text_encoder", T5EncoderModel, "tokenizer", T5TokenizerFast),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_cosmos2image(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_MAX_SEQUENCE_LENGTH)

    @cached_property
    def objective(self) -> CosmosFlowMatching:
        return CosmosFlowMatching.from_config(self.config, self.noise_schedule_config())

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = self.pipeline_class(transformer=None, vae=None, scheduler=None, safety_checker=_NoGuardrail(),
                                    **self.text_encoder_components())
        embeds, _ = shell.encode_prompt(list(prompts), do_classifier_free_guidance=False, device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        self.text_encoder_forwards += 1
        lengths = shell.tokenizer(list(prompts), max_length=self.max_sequence_length, truncation=True,
                                  return_length=True).length
        # each prompt keeps its own tokens; the pipeline's zeros after them come back in padded_embeds
        return [TextEmbedding({"prompt_embeds": embeds[i, :n].float().cpu()}) for i, n in enumerate(lengths)]

    def padded_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, max_sequence_length, D), zeros after the tokens: what the pipeline's T5 call returns."""
        return F.pad(embeds, (0, 0, 0, self.max_sequence_length - embeds.shape[1]))

    def text_identity_extras(self) -> list[str]:
        return [f"max_sequence_length={self.max_sequence_length}"]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, 3, H, W) in [-1, 1] -> (B, C, h, w): the posterior mean of the one-frame video VAE, normalised
        per channel (the pipeline decodes ``latents * latents_std / sigma_data + latents_mean``, sigma_data = 1)."""
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
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity the transformer predicts for rectified-flow latents at ``t``: the pipeline's call with
        ``latents * c_in`` = ``x_t``, ``timestep = t``, all T5 positions and an empty padding mask (pixel-sized)."""
        b, _, h, w = noisy_latents.shape
        dtype = getattr(transformer, "module", transformer).dtype  # unwrap DDP
        device = noisy_latents.device
        out = transformer(
            hidden_states=noisy_latents.to(dtype).unsqueeze(2),
            timestep=t.to(device, dtype).expand(b),
            encoder_hidden_states=self.padded_embeds(text["prompt_embeds"].to(device, dtype)),
            padding_mask=noisy_latents.new_zeros(1, 1, h * 8, w * 8, dtype=dtype),
            return_dict=False,
        )[0]
        return out[:, :, 0]

    def scheduler_input(self, prediction, noisy_latents, t):
        """The pipeline's EDM noise estimate ``(x_edm - x0_hat) / sigma``, which in ``t`` is ``x_t + (1 - t) v``."""
        t = t.to(noisy_latents).view(-1, 1, 1, 1)
        return (noisy_latents + (1 - t) * prediction.to(noisy_latents)).unsqueeze(2)

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline multiplies its ``latents=`` by sigma_max and its model sees them times ``1 / (1 + sigma)``:
        at its first step (sigma = sigma_max) the model sees ``latents`` itself."""
        sigma_max = float(self.noise_schedule_config().get("sigma_max") or 80.0)
        return (latents * (1 + sigma_max) / sigma_max).unsqueeze(2)

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        cfg = CosmosTransformer3DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                   revision=self.config.revision)
        if cfg.get("extra_pos_embed_type"):
            raise ValueError("tread_config: this Cosmos transformer adds a per-token position embedding inside every "
                             "block, which TREAD does not route")
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout | None:
        """Blocks take (hidden_states, encoder_hidden_states, embedded_timestep, temb, image_rotary_emb,
        extra_pos_emb, ...) positionally and return the image tokens; text only enters through cross-attention
        and the (cos, sin) rotary table covers the image tokens alone. Cosmos 1.0's learnable per-token position
        embedding (``extra_pos_embed_type``) would need slicing too: no routing there."""
        if transformer.config.extra_pos_embed_type:
            return None
        return TreadLayout(blocks=list(transformer.transformer_blocks), text_arg=None, text_pos=None,
                           rotary_pos=4, image_output=None)

    def save_lora(self, lora_state_dict, output_dir) -> Path:
        CosmosLoraLoaderMixin.save_lora_weights(str(output_dir), transformer_lora_layers=lora_state_dict,
                                                weight_name=LORA_WEIGHT_NAME, safe_serialization=True)
        return Path(output_dir) / LORA_WEIGHT_NAME

    def load_lora(self, pipeline, path) -> None:
        """Cosmos2TextToImagePipeline has no ``load_lora_weights``: the transformer loads the file itself."""
        path = Path(path)
        pipeline.transformer.load_lora_adapter(str(path / LORA_WEIGHT_NAME if path.is_dir() else path),
                                               prefix="transformer")

    # ---- validation ----------------------------------------------------------------------------------------
    def _pipeline(self, transformer, text_components):
        # the guardrail is Cosmos2TrainingPipeline's to choose, whatever a model folder's model_index names
        return super()._pipeline(transformer, {**text_components, "safety_checker": None})

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """Cosmos has no guidance embedding; its ``guidance_scale`` is classifier-free guidance, which the pipeline
        runs above 1 (adding ``scale * (cond - uncond)``; its default is 7): ``guidance_real`` is passed as it is
        when a ``negative`` embedding is given, and 1 (off) otherwise."""
        kwargs = {"prompt_embeds": self.padded_embeds(text["prompt_embeds"]), "guidance_scale": 1.0,
                  "max_sequence_length": self.max_sequence_length}
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=self.padded_embeds(negative["prompt_embeds"]),
                          guidance_scale=guidance_real)
        return kwargs


def _write_tiny_cosmos2image(folder: Path, seed: int = 0) -> None:
    tokenizer = tiny.t5_tokenizer(512)
    torch.manual_seed(seed)
    transformer = CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3, mlp_ratio=2.0,
        text_embed_dim=32, adaln_lora_dim=8, max_size=(8, 64, 64), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
        concat_padding_mask=True, extra_pos_embed_type=None,  # Cosmos-Predict2's settings
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.8, 1.2],
    )
    torch.manual_seed(seed + 2)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)  # as diffusers' Cosmos 2.0 conversion
    Cosmos2TrainingPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                            scheduler=scheduler).save_pretrained(folder, safe_serialization=True)
    index = Path(folder) / "model_index.json"  # the layout diffusers' own class writes and reads
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "Cosmos2TextToImagePipeline"},
                                indent=2))

