"""Wan 2.1 / 2.2 (text-to-video and image-to-video): a flow-matching video DiT over a causal 3-D VAE.

Flavours: ``t2v-480p-1.3b-2.1`` / ``t2v-480p-14b-2.1`` (``WanPipeline``), ``i2v-14b-2.1`` / ``i2v-14b-2.1-720p``
(``WanImageToVideoPipeline``: first-frame latents + CLIP image embedding), and Wan 2.2's two-expert A14B models
(``t2v-14b-2.2-high|low``, ``i2v-14b-2.2-high|low``): ``transformer`` denoises the high-noise part of the schedule
(``t >= boundary_ratio * 1000``) and ``transformer_2`` the rest; a run trains one expert, on its part of the
schedule only. Tiny flavours: ``tiny`` (T2V), ``tiny-i2v`` (I2V with a CLIP image encoder), ``tiny-2.2-high`` /
``tiny-2.2-low`` (two experts).

Family quirks kept here:
- latents are (B, 16, F, h, w), ``F = (frames - 1) / 4 + 1``, ``h, w = H / 8, W / 8``, normalised per channel as
  ``(z - latents_mean) / latents_std`` (the VAE config's lists; no scaling_factor);
- the transformer takes ``timestep = sigma * 1000`` (the pipeline passes its scheduler's timesteps);
- I2V: the transformer input is ``concat([noisy latents, condition], dim=1)`` (4 mask + 16 first-frame latent
  channels, built by ``WanImageToVideoPipeline.prepare_latents``), plus ``encoder_hidden_states_image`` (CLIP's
  penultimate hidden states) on 2.1; both are cached beside the latents;
- validation guidance is classifier-free guidance (Wan has no distilled guidance embedding).

The transformer call is one function, ``transformer_inputs`` (what ``WanTransformer3DModel.forward`` takes for a
batch), so recipes other than fine-tuning (distillation) can drive the same model the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import AutoTokenizer, UMT5EncoderModel

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.objectives import FlowMatching
from simpletuner.models.tread_layout import TreadLayout

DEFAULT_TEXT_LENGTH = 512  # WanPipeline's max_sequence_length
TINY_TEXT_LENGTH = 64
_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_FFN = ["ffn.net.0.proj", "ffn.net.2"]


def slice_wan_rotary(rotary: Any, idx: torch.Tensor, text_len: int) -> Any:
    """Wan's 3-D RoPE is a (cos, sin) pair of (1, S, 1, D) tensors over the video tokens only (text goes through
    cross-attention): keep each sample's kept token positions, giving (B, K, 1, D)."""
    cos, sin = rotary
    index = idx.to(cos.device)[:, :, None, None].expand(-1, -1, 1, cos.shape[-1])
    return (cos.expand(idx.shape[0], -1, -1, -1).gather(1, index),
            sin.expand(idx.shape[0], -1, -1, -1).gather(1, index))


class ExpertFlowMatching(FlowMatching):
    """Flow matching on one expert's part of the schedule (Wan 2.2): sigmas drawn as usual, then mapped into
    [low, high)."""

    def __init__(self, base: FlowMatching, low: float, high: float):
        self.__dict__.update(base.__dict__)
        self.low, self.high = low, high

    def sample_timesteps(self, batch, *, generator, image_seq_len):
        sigmas = super().sample_timesteps(batch, generator=generator, image_seq_len=image_seq_len)
        return self.low + sigmas * (self.high - self.low)

    def covers(self, t) -> bool:
        value = float(t.reshape(-1)[0])
        return self.low <= value < self.high or (self.high >= 1.0 and value == 1.0)


class WanAdapter(ModelAdapter):
    family = "wan"
    pipeline_class = WanPipeline
    denoiser_class = WanTransformer3DModel
    vae_class = AutoencoderKLWan
    text_encoder_specs = (("text_encoder", UMT5EncoderModel, "tokenizer", AutoTokenizer),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches
    temporal_compression = 4
    default_fps = 16.0
    default_validation_frames = 81

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        flavour = config.model_flavour or ""
        self.is_i2v = "i2v" in flavour
        self.expert = "high" if flavour.endswith("-high") else "low" if flavour.endswith("-low") else None
        if self.is_i2v:
            self.pipeline_class = WanImageToVideoPipeline
        if self.expert == "low":  # the low-noise expert is the pipeline's transformer_2
            self.denoiser_subfolder = "transformer_2"
        self.image_encoder = None
        self.image_processor = None

    # ---- tiny flavours ------------------------------------------------------------------------------------
    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_wan(folder, variant="t2v")

    def tiny_checkpoint_name(self) -> str:
        return {"t2v": "wan", "i2v": "wan-i2v", "2.2": "wan-2.2"}[self._tiny_variant()]

    def write_tiny(self, folder: Path) -> None:
        write_tiny_wan(folder, variant=self._tiny_variant())

    def _tiny_variant(self) -> str:
        flavour = self.config.model_flavour or ""
        return "2.2" if "2.2" in flavour else "i2v" if self.is_i2v else "t2v"

    @property
    def text_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or (TINY_TEXT_LENGTH if self.is_tiny else DEFAULT_TEXT_LENGTH))

    def text_identity_extras(self) -> list[str]:
        return [f"umt5_len={self.text_length}"]

    def boundary_ratio(self) -> float | None:
        """Wan 2.2's expert boundary (model_index.json's ``boundary_ratio``), None for single-expert models."""
        path = Path(self.model_path()) / "model_index.json"
        if path.is_file():
            return json.loads(path.read_text()).get("boundary_ratio")
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(self.model_path(), "model_index.json",
                                               revision=self.config.revision)).read_text()).get("boundary_ratio")

    @property
    def objective(self):
        base = super().objective
        if self.expert is None or not isinstance(base, FlowMatching):
            return base
        if not hasattr(self, "_expert_objective"):
            boundary = self.boundary_ratio()
            if boundary is None:
                raise ValueError(f"model_flavour: {self.config.model_flavour!r} trains one expert of a two-expert "
                                 "model, and this model's model_index.json has no boundary_ratio")
            low, high = (boundary, 1.0) if self.expert == "high" else (0.0, boundary)
            self._expert_objective = ExpertFlowMatching(base, low, high)
        return self._expert_objective

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = WanPipeline(vae=None, scheduler=None, transformer=None, **self.text_encoder_components())
        embeds, _ = shell.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                        max_sequence_length=self.text_length, device=self.device)
        self.text_encoder_forwards += 1
        return [TextEmbedding({"prompt_embeds": e.float().cpu()}) for e in embeds]

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        return (torch.tensor(cfg.latents_mean).view(shape).to(like), torch.tensor(cfg.latents_std).view(shape).to(like))

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, frames, H, W) in [-1, 1] -> (B, 16, F, h, w): the posterior mean, ``(z - mean) / std``."""
        if self.vae is None:
            self.load_vae()
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mean.float()
        self.vae_forwards += 1
        mean, std = self._latent_stats(z)
        return ((z - mean) / std).cpu()

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.load_vae()
        mean, std = self._latent_stats(latents.float())
        return self.vae.decode((latents.float() * std + mean).to(self.device, self.vae.dtype)).sample

    def latent_cache_entries(self, pixels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """T2V: the latents. I2V: also the first frame itself, the pipeline's first-frame condition (mask + VAE
        latents of the first frame followed by black frames) and, on 2.1, CLIP's image embedding."""
        latents = self.encode_images(pixels)
        if not self.is_i2v:
            return [{"latents": latent} for latent in latents]
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        batch, _, frames, height, width = pixels.shape
        first = pixels[:, :, 0].float()
        shell = self._i2v_shell()
        entries = []
        with torch.no_grad():
            for i in range(batch):  # prepare_latents encodes one image and repeats it over its batch
                _, condition = shell.prepare_latents(first[i:i + 1].to(self.device), 1, latents.shape[1], height,
                                                     width, frames, torch.float32, self.device,
                                                     latents=torch.zeros(latents[i:i + 1].shape, device=self.device))
                self.vae_forwards += 1
                entries.append({"latents": latents[i], "condition": condition[0].float().cpu(),
                                "first_frame": first[i].cpu()})
            if shell.image_encoder is not None:
                embeds = shell.encode_image([_to_pil(f) for f in first], self.device)
                for entry, embed in zip(entries, embeds):
                    entry["image_embeds"] = embed.float().cpu()
        return entries

    def _i2v_shell(self):
        if self.vae is None:
            self.load_vae()
        path = self.model_path()
        if self.image_encoder is None and (Path(path) / "image_encoder").is_dir() or (
                self.image_encoder is None and not Path(path).exists() and "2.1" in (self.config.model_flavour or "")):
            from transformers import CLIPImageProcessor, CLIPVisionModel

            self.image_encoder = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder",
                                                                 revision=self.config.revision,
                                                                 dtype=torch.float32).eval().to(self.device)
            self.image_processor = CLIPImageProcessor.from_pretrained(path, subfolder="image_processor",
                                                                      revision=self.config.revision)
        return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=self.vae, scheduler=None,
                                       image_encoder=self.image_encoder, image_processor=self.image_processor)

    def unload_encoders(self) -> None:
        super().unload_encoders()
        self.image_encoder = self.image_processor = None

    # ---- training ----------------------------------------------------------------------------------------
    def transformer_inputs(self, transformer, noisy_latents: torch.Tensor, t: torch.Tensor,
                           text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``WanTransformer3DModel.forward``'s arguments for a batch, as the pipeline builds them: the latents (with
        the I2V condition channels appended), ``timestep = sigma * 1000`` per sample, the UMT5 embeddings and, for
        an I2V 2.1 model, the CLIP image embedding."""
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        dtype, device = model.dtype, noisy_latents.device
        hidden = noisy_latents
        if self.is_i2v:
            hidden = torch.cat([noisy_latents, text["condition"].to(device, noisy_latents.dtype)], dim=1)
        timestep = (t.to(device, torch.float32) * 1000).expand(noisy_latents.shape[0])
        image = text.get("image_embeds") if model.config.image_dim is not None else None
        return {
            "hidden_states": hidden.to(dtype),
            "timestep": timestep,
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "encoder_hidden_states_image": image.to(device, dtype) if image is not None else None,
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        return transformer(**self.transformer_inputs(transformer, noisy_latents, t, text))[0]

    def image_seq_len(self, latent_shape) -> int:
        frames = latent_shape[-3] if len(latent_shape) == 5 else 1
        return frames * (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        presets = {
            "all": _ATTN,  # self- and cross-attention projections (SimpleTuner's default for Wan)
            "self-attention": [f"attn1.{m}" for m in _ATTN],
            "all+ffs": _ATTN + _FFN,
        }
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        cfg = WanTransformer3DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                revision=self.config.revision)
        return int(cfg["num_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """``WanTransformerBlock(hidden_states, encoder_hidden_states, temb, rotary_emb) -> hidden_states``: video
        tokens only in self-attention, text through cross-attention, the 3-D RoPE sliced per sample."""
        return TreadLayout(blocks=list(transformer.blocks), image_arg="hidden_states", image_pos=0,
                           text_arg="encoder_hidden_states", text_pos=1, rotary_arg="rotary_emb", rotary_pos=3,
                           image_output=None, slice_rotary=slice_wan_rotary, shared_selection=False)

    def load_lora(self, pipeline, path) -> None:
        """A low-noise expert's LoRA goes into ``transformer_2`` (``load_into_transformer_2=True``), as diffusers'
        Wan 2.2 docs load it."""
        pipeline.load_lora_weights(str(path), **({"load_into_transformer_2": True} if self.expert == "low" else {}))

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1 or guidance_real > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """Wan's ``guidance_scale`` is classifier-free guidance (on when > 1, with the negative embedding)."""
        scale = max(guidance, guidance_real)
        kwargs = {"prompt_embeds": text["prompt_embeds"], "guidance_scale": scale,
                  "max_sequence_length": self.text_length}
        if negative is not None and scale > 1:
            kwargs["negative_prompt_embeds"] = negative["prompt_embeds"]
        if self.expert is not None:
            kwargs["guidance_scale_2"] = scale
        return kwargs

    def validation_conditioning(self, text, height, width) -> dict:
        """I2V: the first frame to animate (the cached ``first_frame`` the evaluator supplies)."""
        if not self.is_i2v:
            return {}
        if "first_frame" not in text:
            raise ValueError("validation: an image-to-video flavour needs a first frame to condition on")
        return {"image": _to_pil(text["first_frame"].reshape(-1, *text["first_frame"].shape[-3:])[0])}

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's latents mid-denoise -> the first latent frame (the poster frame) in the VAE's raw space."""
        mean, std = self._latent_stats(latents.float())
        return latents[:, :, :1].float() * std + mean


def _to_pil(frame: torch.Tensor):
    """(3, H, W) in [-1, 1] -> a PIL image (exact for pixels that came from 8-bit images)."""
    from PIL import Image

    arr = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(arr)


def write_tiny_wan(folder: Path, variant: str = "t2v", seed: int = 0) -> None:
    """A random-initialised Wan in the diffusers layout: ``t2v`` (WanPipeline), ``i2v`` (WanImageToVideoPipeline
    with a CLIP image encoder, 2.1-style) or ``2.2`` (two experts and a boundary). Seeded on a forked RNG."""
    with torch.random.fork_rng(devices=[]):
        _write_tiny_wan(Path(folder), variant, seed)


def _write_tiny_wan(folder: Path, variant: str, seed: int) -> None:
    from transformers import UMT5Config

    def transformer(offset: int, **extra):
        torch.manual_seed(seed + offset)
        return WanTransformer3DModel(**{
            "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
            "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32, "num_layers": 4,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32, **extra,
        })

    tokenizer = tiny.t5_tokenizer(512)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(seed + 2)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    # Wan ships UniPC; its flow-matching Euler scheduler (the pipeline's declared type) passes float timesteps
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler)
    if variant == "i2v":
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(seed + 3)
        image_encoder = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8, projection_dim=16))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        pipe = WanImageToVideoPipeline(**common, transformer=transformer(0, in_channels=36, image_dim=16,
                                                                         added_kv_proj_dim=24),
                                       image_encoder=image_encoder, image_processor=processor)
    elif variant == "2.2":
        pipe = WanPipeline(**common, transformer=transformer(0), transformer_2=transformer(10), boundary_ratio=0.875)
    else:
        pipe = WanPipeline(**common, transformer=transformer(0))
    pipe.save_pretrained(folder, safe_serialization=True)
