"""LTX-2 (``LTX2Pipeline``): Lightricks' 19B audio+video flow-matching DiT over a 32x spatial / 8x temporal video
VAE and an audio VAE + vocoder, with Gemma 3 text through the pipeline's own ``LTX2TextConnectors``.

Family quirks kept here:
- text: Gemma 3 (``Gemma3ForConditionalGeneration``) reads each prompt left-padded to ``max_sequence_length`` (1024;
  32 for the tiny flavour); every hidden state (embeddings + each layer) is stacked per token and the connectors
  (a per-layer masked normalisation, a projection, then a small transformer per stream that replaces the padding
  with learned registers) turn them into one embedding for the video stream and one for the audio stream. The
  connectors are frozen, so the cache keeps their outputs (video, audio, mask): at the real size the stacked Gemma
  states would be 49 x 3840 values per token (770 MB per caption in fp32), the connectors' outputs 2 x 3840;
- the pipeline only takes Gemma's stacked states as ``prompt_embeds`` and runs the connectors itself, so the
  pipelines built here hold ``ConnectorOutputs``: it hands cached connector outputs (passed as ``prompt_embeds``,
  video and audio side by side) straight through and runs the real connectors on Gemma's states (a prompt the
  pipeline encodes itself). The LoRA loads into the plain ``LTX2Pipeline``;
- latents are (B, 128, F, h, w), ``F = (frames - 1) / 8 + 1``, ``h, w = H / 32, W / 32``, normalised as
  ``(z - latents_mean) * scaling_factor / latents_std``; the transformer sees them packed into (B, F*h*w, C) tokens,
  with ``timestep = sigma = t * 1000`` and RoPE positions at the clip's frame rate (``framerate``, LTX-2's 24 unless
  set; validation generates at the same rate); the pipeline takes its ``latents=`` unpacked and un-normalised;
- audio: every block runs an audio stream beside the video one (audio-to-video and video-to-audio cross-attention).
  Video datasets here carry no audio, so while training the audio stream is what it is at the very start of
  generation: pure noise at sigma 1 (``audio_timestep = 1000``), as many audio latents as the clip lasts
  (``frames / fps`` seconds at the audio VAE's 25 latents a second). The video stream thus learns with no
  information about the sound, which the model knows from the audio timestep. That noise is drawn from a generator
  seeded by the sample's timestep, so a prediction is a function of its inputs (eval loss repeats, resume is bit for
  bit) and still changes from step to step; validation starts the audio from the sigma-1 draw and the pipeline
  generates both streams (the mp4 keeps the video);
- validation guidance: ``validation_guidance`` > 1 is the pipeline's own multi-guidance (classifier-free guidance at
  that scale with the negative prompt, plus its spatio-temporal and modality-isolation guidance and rescale at their
  defaults); 1 turns every guidance term off (the model's plain prediction);
- TREAD is not offered: each block takes two per-token RoPE tables over the video tokens (self-attention's and the
  audio-to-video cross-attention's) and the audio stream's cross-attention reads every video token, which one
  routed token subset and one rotary slice cannot describe.

Not here: LTX-2's image-to-video and conditioning pipelines, LTX-2.3 (per-modality connector projections) and the
distilled / two-stage upsampling pipelines.
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.ltxvideo import poster_frame
from simpletuner.models.weights import WeightSource, explained

DEFAULT_TEXT_LENGTH = 1024  # LTX2Pipeline's max_sequence_length (a multiple of the connectors' 128 registers)
TINY_TEXT_LENGTH = 32
AUDIO_NOISE_SEED = 0x17A2  # the audio stream's noise generator: this seed plus the timestep in millionths
_QKVO = ("to_q", "to_k", "to_v", "to_out.0")
_VIDEO_ATTN = [f"{a}.{m}" for a in ("attn1", "attn2", "audio_to_video_attn") for m in _QKVO]
_AUDIO_ATTN = [f"{a}.{m}" for a in ("audio_attn1", "audio_attn2", "video_to_audio_attn") for m in _QKVO]
_FF = ["ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]


class ConnectorOutputs(torch.nn.Module):
    """The pipeline's ``connectors`` component for pipelines built from cached text: ``prompt_embeds`` of
    ``2 * caption_channels`` features are cached connector outputs (video, then audio) and pass straight through with
    their mask; Gemma's stacked hidden states (``caption_channels * text_proj_in_factor`` features: a prompt the
    pipeline encodes itself) go through ``connectors``, the real ones."""

    def __init__(self, caption_channels: int, connectors: LTX2TextConnectors | None = None):
        super().__init__()
        if connectors is not None and connectors.config.text_proj_in_factor == 2:
            raise ValueError("connectors: text_proj_in_factor 2 makes Gemma's stacked states as wide as the cached "
                             "connector outputs; this family cannot tell them apart")
        self.caption_channels = caption_channels
        self.connectors = connectors
        self.register_buffer("anchor", torch.zeros(0), persistent=False)  # where the pipeline finds its device

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.connectors.dtype if self.connectors is not None else torch.float32

    def forward(self, text_encoder_hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                padding_side: str = "left", scale_factor: int = 8):
        if text_encoder_hidden_states.shape[-1] == 2 * self.caption_channels:
            video, audio = text_encoder_hidden_states.split(self.caption_channels, dim=-1)
            return video, audio, attention_mask
        if self.connectors is None:
            raise ValueError(f"prompt_embeds: {text_encoder_hidden_states.shape[-1]} features are neither cached "
                             f"connector outputs ({2 * self.caption_channels}) nor usable without the connectors")
        return self.connectors(text_encoder_hidden_states, attention_mask, padding_side=padding_side,
                               scale_factor=scale_factor)


class LTX2Adapter(ModelAdapter):
    family = "ltxvideo2"
    pipeline_class = LTX2Pipeline
    denoiser_class = LTX2VideoTransformer3DModel
    vae_class = AutoencoderKLLTX2Video
    # the pipeline declares GemmaTokenizer(Fast); AutoTokenizer reads the class the folder's tokenizer_config names
    text_encoder_specs = (("text_encoder", Gemma3ForConditionalGeneration, "tokenizer", AutoTokenizer),)
    resolution_multiple = 32  # VAE /32, 1x1 patches
    temporal_compression = 8
    default_fps = 24.0  # LTX2Pipeline's frame_rate
    default_validation_frames = 121  # LTX2Pipeline's num_frames
    # everything outside the blocks (input projections, timestep and caption embedders, the audio-video modulation):
    # as for the other families, and group offload moves these as one group after each forward
    full_precision_modules = ("proj_in", "audio_proj_in", "audio_proj_out", "caption_projection*",
                              "audio_caption_projection*", "time_embed*", "audio_time_embed*", "av_cross_attn_*")
    lora_presets = {
        "video": _VIDEO_ATTN,  # what writes to the video stream: its attention and the audio-to-video attention
        "all": _VIDEO_ATTN + _AUDIO_ATTN,
        "all+ffs": _VIDEO_ATTN + _AUDIO_ATTN + _FF,
    }

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.connectors: LTX2TextConnectors | None = None

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_ltx2(folder)

    @classmethod
    def fsdp_block_classes(cls) -> list[str]:
        return ["LTX2VideoTransformerBlock"]  # diffusers' LTX-2 transformer lists no _no_split_modules

    @property
    def text_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or (TINY_TEXT_LENGTH if self.is_tiny else DEFAULT_TEXT_LENGTH))

    def text_identity_extras(self) -> list[str]:
        return [f"gemma_len={self.text_length}", self.component_identity("connectors")]

    @cached_property
    def vae_scale_factor(self) -> int:
        return self.resolution_multiple

    # ---- the text connectors load and unload with the text encoder -------------------------------------------
    def _text_weights(self) -> list[WeightSource]:
        path, revision = self.component_source("connectors")
        return [*super()._text_weights(),
                WeightSource(self._base_field(), path, "connectors", what="text connectors", revision=revision)]

    def load_text_encoders(self) -> None:
        super().load_text_encoders()
        path, revision = self.component_source("connectors")
        with explained(self._text_weights()[-1]):
            connectors = LTX2TextConnectors.from_pretrained(path, subfolder="connectors", revision=revision,
                                                            torch_dtype=self.weight_dtype)
        connectors.requires_grad_(False).eval()
        self._place(connectors)
        self.connectors = connectors

    def unload_encoders(self) -> None:
        super().unload_encoders()
        self.connectors = None

    def caption_channels(self) -> int:
        if self.connectors is not None:
            return int(self.connectors.config.caption_channels)
        path, revision = self.component_source("connectors")
        with explained(self._text_weights()[-1]):
            return int(LTX2TextConnectors.load_config(path, subfolder="connectors", revision=revision)
                       ["caption_channels"])

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        """Gemma's stacked hidden states through the connectors, exactly as ``LTX2Pipeline.__call__`` computes them:
        per prompt the video-stream and audio-stream embeddings and the connectors' mask."""
        components = self.text_encoder_components()
        registers = self.connectors.config.video_connector_num_learnable_registers
        if registers and self.text_length % registers:
            raise ValueError(f"tokenizer_max_length: {self.text_length} is not a multiple of the text connectors' "
                             f"{registers} learnable registers")
        shell = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, transformer=None, vocoder=None,
                             connectors=None, **components)
        embeds, mask, _, _ = shell.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                 max_sequence_length=self.text_length, device=self.device)
        video, audio, kept = self.connectors(embeds.to(self.connectors.dtype), mask,
                                             padding_side=components["tokenizer"].padding_side)
        self.text_encoder_forwards += 1
        self.offload_idle()
        return [TextEmbedding({"prompt_embeds": v.float().cpu(), "audio_prompt_embeds": a.float().cpu(),
                               "prompt_attention_mask": m.bool().cpu()}) for v, a, m in zip(video, audio, kept)]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, frames, H, W) in [-1, 1] (an image: one frame) -> normalised (B, 128, F, h, w) latents (the
        posterior mean)."""
        if self.vae is None:
            self.load_vae()
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mean.float()
        self.vae_forwards += 1
        self.offload_idle()
        return LTX2Pipeline._normalize_latents(z, self.vae.latents_mean, self.vae.latents_std,
                                               self.vae.config.scaling_factor).cpu()

    # ---- the audio stream --------------------------------------------------------------------------------
    def audio_latent_frames(self, transformer_config, frames: int) -> int:
        """Audio latents for a clip of ``frames`` pixel frames at the run's frame rate, as ``LTX2Pipeline`` counts
        them (the transformer's config carries the audio VAE's sample rate, hop length and downscale)."""
        per_second = (transformer_config.audio_sampling_rate / transformer_config.audio_hop_length
                      / float(transformer_config.audio_scale_factor))
        return round(frames / self.validation_fps() * per_second)

    @staticmethod
    def audio_noise(t: torch.Tensor, batch: int, length: int, channels: int) -> torch.Tensor:
        """(B, length, channels) standard normal audio tokens, each sample's drawn from a generator seeded by its
        timestep (the same timestep always sees the same noise)."""
        ts = t.detach().float().cpu().reshape(-1).expand(batch) if t.numel() == 1 else t.detach().float().cpu()
        return torch.stack([torch.randn(length, channels, generator=torch.Generator().manual_seed(
            AUDIO_NOISE_SEED + int(round(float(ti) * 1_000_000)))) for ti in ts])

    # ---- training ----------------------------------------------------------------------------------------
    def transformer_inputs(self, transformer, noisy_latents: torch.Tensor, t: torch.Tensor,
                           text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``LTX2VideoTransformer3DModel.forward``'s arguments for a batch, as the pipeline builds them at a step
        where the audio is still pure noise."""
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        cfg = model.config
        dtype, device = model.dtype, noisy_latents.device
        b, _, f, h, w = noisy_latents.shape
        audio_frames = self.audio_latent_frames(cfg, (f - 1) * self.temporal_compression + 1)
        audio = self.audio_noise(t, b, audio_frames, cfg.audio_in_channels)
        timestep = (t.to(device, torch.float32) * 1000).expand(b)
        audio_timestep = torch.full((b,), 1000.0, device=device)
        mask = text["prompt_attention_mask"].to(device)
        return {
            "hidden_states": LTX2Pipeline._pack_latents(noisy_latents, cfg.patch_size, cfg.patch_size_t).to(dtype),
            "audio_hidden_states": audio.to(device, dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "audio_encoder_hidden_states": text["audio_prompt_embeds"].to(device, dtype),
            "timestep": timestep, "sigma": timestep,
            "audio_timestep": audio_timestep, "audio_sigma": audio_timestep,
            "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
            "num_frames": f // cfg.patch_size_t, "height": h // cfg.patch_size, "width": w // cfg.patch_size,
            "fps": conditioning_frame_rate(self.validation_fps(), 1.0), "audio_num_frames": audio_frames,
            "use_cross_timestep": True,  # as LTX2Pipeline calls it
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = getattr(transformer, "module", transformer).config
        _, _, f, h, w = noisy_latents.shape
        video, _ = transformer(**self.transformer_inputs(transformer, noisy_latents, t, text))
        return LTX2Pipeline._unpack_latents(video, f // cfg.patch_size_t, h // cfg.patch_size, w // cfg.patch_size,
                                            cfg.patch_size, cfg.patch_size_t)

    def image_seq_len(self, latent_shape) -> int:
        frames = latent_shape[-3] if len(latent_shape) == 5 else 1
        return frames * latent_shape[-2] * latent_shape[-1]

    def tread_layout(self, transformer) -> None:
        return None  # see the module docstring

    # ---- validation ----------------------------------------------------------------------------------------
    def load_pipeline(self, path: str | Path | None = None):
        """``LTX2Pipeline.from_pretrained`` as its users load it, with its connectors wrapped in ``ConnectorOutputs``
        so that it also takes cached embeddings."""
        path = str(path or self.model_path())
        connectors = LTX2TextConnectors.from_pretrained(path, subfolder="connectors")
        return self.pipeline_class.from_pretrained(
            path, connectors=ConnectorOutputs(connectors.config.caption_channels, connectors))

    def build_pipeline(self, transformer):
        components = self.text_encoder_components()
        return self._pipeline(transformer, {**components,
                                            "connectors": ConnectorOutputs(self.caption_channels(), self.connectors)})

    def build_validation_pipeline(self, transformer):
        return self._pipeline(transformer, {"text_encoder": None, "tokenizer": None,
                                            "connectors": ConnectorOutputs(self.caption_channels())})

    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": torch.cat([text["prompt_embeds"], text["audio_prompt_embeds"]], dim=-1),
                  "prompt_attention_mask": text["prompt_attention_mask"], "max_sequence_length": self.text_length,
                  "guidance_scale": guidance}
        if guidance > 1:
            if negative is not None:
                kwargs.update(
                    negative_prompt_embeds=torch.cat([negative["prompt_embeds"], negative["audio_prompt_embeds"]],
                                                     dim=-1),
                    negative_prompt_attention_mask=negative["prompt_attention_mask"])
        else:  # the plain prediction: no guidance term of any kind, for either stream
            kwargs.update(audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                          audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
        return kwargs

    @cached_property
    def _audio_latent_stats(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The audio VAE's (latents_mean, latents_std, latent mel bins): what ``LTX2Pipeline`` normalises given
        ``audio_latents`` with."""
        path, revision = self.component_source("audio_vae")
        with explained(WeightSource(self._base_field(), path, "audio_vae", what="audio VAE", revision=revision)):
            audio_vae = AutoencoderKLLTX2Audio.from_pretrained(path, subfolder="audio_vae", revision=revision)
        mel_bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        return audio_vae.latents_mean.float().clone(), audio_vae.latents_std.float().clone(), mel_bins

    def pipeline_call_kwargs(self, *, height: int, width: int, num_frames: int | None = None) -> dict:
        """Size and frame rate, and the audio stream's starting noise: the sigma-1 draw training's audio sees,
        un-normalised and unpacked as the pipeline takes ``audio_latents``."""
        kwargs = {**super().pipeline_call_kwargs(height=height, width=width, num_frames=num_frames),
                  "frame_rate": self.validation_fps()}
        path, subfolder = self.denoiser_source()
        cfg = LTX2VideoTransformer3DModel.load_config(path, subfolder=subfolder if subfolder not in ("", "none") else None,
                                                      revision=self.config.revision)
        length = self.audio_latent_frames(SimpleNamespace(**cfg), kwargs["num_frames"])
        mean, std, mel_bins = self._audio_latent_stats
        noise = self.audio_noise(torch.ones(1), 1, length, int(cfg["audio_in_channels"]))
        kwargs["audio_latents"] = LTX2Pipeline._unpack_audio_latents(noise * std + mean, length, mel_bins)
        return kwargs

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline takes 5-D latents in the VAE's raw space and normalises them itself."""
        return LTX2Pipeline._denormalize_latents(latents, self.vae.latents_mean, self.vae.latents_std,
                                                 self.vae.config.scaling_factor)

    def scheduler_input(self, prediction, noisy_latents, t) -> torch.Tensor:
        return LTX2Pipeline._pack_latents(prediction, 1, 1)  # the pipeline steps its scheduler on packed tokens

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return poster_frame(LTX2Pipeline, self.vae, latents, height // self.resolution_multiple,
                            width // self.resolution_multiple)


def write_tiny_ltx2(folder: Path, seed: int = 0) -> None:
    """A random-initialised LTX-2 in the diffusers layout, with LTX-2's compression (32x spatial, 8x temporal video;
    25 audio latents a second), seeded on a forked RNG."""
    with torch.random.fork_rng(devices=[]):
        _write_tiny_ltx2(Path(folder), seed)


def _write_tiny_ltx2(folder: Path, seed: int) -> None:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = tiny.gemma_tokenizer(TINY_TEXT_LENGTH)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=256, sliding_window=16, pad_token_id=tokenizer.pad_token_id,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=vocab, eoi_token_index=vocab + 1, image_token_index=vocab + 2))
    torch.manual_seed(seed + 1)
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=3,  # Gemma's 2 layers + its embeddings
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=TINY_TEXT_LENGTH, rope_type="split")
    torch.manual_seed(seed + 2)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=32, rope_type="split")
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), decoder_inject_noise=(False,) * 4,
        upsample_residual=(False,) * 3, upsample_factor=(1,) * 3, patch_size=4, patch_size_t=1,
        spatial_compression_ratio=32, temporal_compression_ratio=8)
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    # LTX's scheduler settings (resolution-dependent shift, terminal sigma 0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 connectors=connectors, transformer=transformer, vocoder=vocoder).save_pretrained(
        folder, safe_serialization=True)
