"""HunyuanVideo (``HunyuanVideoPipeline``): a 13B guidance-distilled flow-matching video DiT (20 dual-stream and 40
single-stream blocks) over a causal 3-D VAE (8x spatial, 4x temporal), with a Llama and a CLIP text encoder.

Family quirks kept here:
- text: a Llava-Llama-3-8B (``LlamaModel``) reads each prompt inside HunyuanVideo's prompt template (the pipeline's
  ``DEFAULT_PROMPT_TEMPLATE``: a system turn about describing a video, then the prompt as the user turn); its
  third-to-last hidden state (``num_hidden_layers_to_skip=2``) with the template's ``crop_start`` (95) tokens cut off
  gives the token embeddings and their mask, CLIP-L's pooled output the pooled vector; both come from the pipeline's
  own ``encode_prompt``. The Llama tokens are cached without their padding: the transformer keeps padding out of
  every attention (and out of its token refiner's mean), so the prediction does not depend on it;
- latents are (B, 16, F, h, w), ``F = (frames - 1) / 4 + 1``, ``h, w = H / 8, W / 8``, times the VAE's
  ``scaling_factor`` (0.476986; no shift); the transformer patchifies them 1x2x2 itself and answers in that layout;
- the transformer takes ``timestep = sigma * 1000`` (the pipeline passes its scheduler's timesteps; shift 7.0),
  the Llama mask, the pooled CLIP vector and, the model being guidance-distilled, ``guidance = scale * 1000``:
  ``guidance_value`` while training (1.0 unless set), ``validation_guidance`` as the pipeline's ``guidance_scale``
  in validation (the pipeline's default is 6.0); ``validation_guidance_real`` > 1 with a negative prompt is the
  pipeline's true classifier-free guidance (``true_cfg_scale``);
- TREAD: every block (dual- and single-stream alike) takes the video tokens and the text tokens as separate
  arguments and returns them separately; the rotary table is (S, D) over the video tokens only and the attention
  mask (B, 1, 1, video + text) keys; both are sliced to the kept tokens, with one selection for the whole batch
  (the rotary table has no batch dimension).

Not here: HunyuanVideo's image-to-video model (``HunyuanVideoImageToVideoPipeline``, a LLaVA image encoder and
token-replace blocks) and FramePack are other pipelines, not flavours of this family.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, LlamaModel

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

DEFAULT_TEXT_LENGTH = 256  # HunyuanVideoPipeline's max_sequence_length (Llama tokens after the template)
LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Llama 3's pre-tokenizer split (a run of newlines is one piece: the blank line after each header is one token)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_ATTN = ["to_q", "to_k", "to_v"]
_DUAL_ATTN = _ATTN + ["to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_DUAL_FF = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
_SINGLE_MLP = ["proj_mlp", "proj_out"]


def slice_video_rotary(rotary: Any, idx: torch.Tensor, text_len: int) -> Any:
    """HunyuanVideo's RoPE is a (cos, sin) pair of (S, D) tables over the video tokens only, without a batch
    dimension: keep the rows of the kept tokens (one selection shared by the batch)."""
    kept = idx[0]
    if idx.shape[0] > 1 and idx.stride(0) != 0 and not bool((idx == kept).all()):
        raise ValueError("slice_video_rotary: RoPE without a batch dimension needs shared_selection=True")
    return tuple(r.index_select(0, kept.to(r.device)) for r in rotary)


def slice_video_text_mask(mask: Any, idx: torch.Tensor, text_len: int) -> Any:
    """The attention mask over keys (B, 1, 1, video + text), video first: keep the kept video columns and every
    text column."""
    if mask is None:
        return None
    video = mask.shape[-1] - text_len
    index = idx.to(mask.device)
    if index.shape[0] != mask.shape[0]:
        index = index.expand(mask.shape[0], -1)
    kept = mask[..., :video].gather(-1, index[:, None, None, :].expand(-1, *mask.shape[1:3], -1))
    return torch.cat([kept, mask[..., video:]], dim=-1)


class HunyuanVideoAdapter(ModelAdapter):
    family = "hunyuanvideo"
    pipeline_class = HunyuanVideoPipeline
    denoiser_class = HunyuanVideoTransformer3DModel
    vae_class = AutoencoderKLHunyuanVideo
    # the pipeline declares LlamaTokenizerFast; AutoTokenizer reads the class the folder's tokenizer_config names
    text_encoder_specs = (
        ("text_encoder", LlamaModel, "tokenizer", AutoTokenizer),
        ("text_encoder_2", CLIPTextModel, "tokenizer_2", CLIPTokenizer),
    )
    resolution_multiple = 16  # VAE /8, then 2x2 patches
    temporal_compression = 4
    default_fps = 24.0
    default_validation_frames = 129  # the pipeline's num_frames

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        write_tiny_hunyuanvideo(folder)

    @property
    def text_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_TEXT_LENGTH)

    def text_identity_extras(self) -> list[str]:
        template = hashlib.sha256(DEFAULT_PROMPT_TEMPLATE["template"].encode()).hexdigest()[:12]
        return [f"llama_len={self.text_length}", f"template={template}:{DEFAULT_PROMPT_TEMPLATE['crop_start']}"]

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = HunyuanVideoPipeline(transformer=None, vae=None, scheduler=None, **self.text_encoder_components())
        embeds, pooled, mask = shell.encode_prompt(prompt=list(prompts), device=self.device,
                                                   max_sequence_length=self.text_length)
        self.text_encoder_forwards += 1
        self.offload_idle()
        # each prompt keeps its own tokens only; a batch right-pads them again (TextEmbedding.collate)
        kept = [embeds[i][mask[i].bool()] for i in range(len(prompts))]
        return [TextEmbedding({"prompt_embeds": tokens.float().cpu(),
                               "prompt_attention_mask": torch.ones(tokens.shape[0], dtype=torch.bool),
                               "pooled_prompt_embeds": pooled[i].float().cpu()}) for i, tokens in enumerate(kept)]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, frames, H, W) in [-1, 1] (an image: (B, 3, H, W), one frame) -> (B, 16, F, h, w): the posterior
        mean times ``scaling_factor``."""
        return super().encode_images(pixels.unsqueeze(2) if pixels.ndim == 4 else pixels)

    # ---- training ----------------------------------------------------------------------------------------
    def transformer_inputs(self, transformer, noisy_latents: torch.Tensor, t: torch.Tensor,
                           text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``HunyuanVideoTransformer3DModel.forward``'s arguments for a batch, as the pipeline builds them."""
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        dtype, device = model.dtype, noisy_latents.device
        batch = noisy_latents.shape[0]
        guidance = None
        if model.config.guidance_embeds:
            guidance = torch.full((batch,), float(self.config.guidance_value), device=device, dtype=dtype) * 1000.0
        return {
            "hidden_states": noisy_latents.to(dtype),
            "timestep": (t.to(device, torch.float32) * 1000).expand(batch),
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device, dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device, dtype),
            "guidance": guidance,
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        return transformer(**self.transformer_inputs(transformer, noisy_latents, t, text))[0]

    def image_seq_len(self, latent_shape) -> int:
        frames = latent_shape[-3] if len(latent_shape) == 5 else 1
        return frames * (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        """Module names in the dual- and single-stream blocks (named in full: the text encoder's token refiner has
        attention and feed-forward layers of the same names, left out)."""
        dual = range(len(transformer.transformer_blocks))
        single = range(len(transformer.single_transformer_blocks))
        attention = ([f"transformer_blocks.{i}.attn.{m}" for i in dual for m in _DUAL_ATTN]
                     + [f"single_transformer_blocks.{i}.attn.{m}" for i in single for m in _ATTN])
        presets = {
            "all": attention,
            "all+ffs": attention + [f"transformer_blocks.{i}.{m}" for i in dual for m in _DUAL_FF]
            + [f"single_transformer_blocks.{i}.{m}" for i in single for m in _SINGLE_MLP],
        }
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return presets[preset]

    def transformer_depth(self) -> int:
        path, subfolder = self.denoiser_source()
        cfg = HunyuanVideoTransformer3DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                         revision=self.config.revision)
        return int(cfg["num_layers"]) + int(cfg["num_single_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """``block(hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb, ...)`` ->
        ``(hidden_states, encoder_hidden_states)`` for both kinds of block (the single-stream ones concatenate the
        two inside): the video tokens are routed, the text kept whole, the rotary table and the key mask sliced."""
        return TreadLayout(blocks=[*transformer.transformer_blocks, *transformer.single_transformer_blocks],
                           image_arg="hidden_states", image_pos=0, text_arg="encoder_hidden_states", text_pos=1,
                           rotary_arg="freqs_cis", rotary_pos=4, image_output=0, slice_rotary=slice_video_rotary,
                           shared_selection=True, mask_arg="attention_mask", mask_pos=3,
                           slice_mask=slice_video_text_mask)

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """``guidance`` is the distilled-guidance embedding's scale (``guidance_scale``); ``guidance_real`` > 1 with a
        negative embedding is true classifier-free guidance."""
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "pooled_prompt_embeds": text["pooled_prompt_embeds"], "guidance_scale": guidance,
                  "max_sequence_length": self.text_length}
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"],
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"], true_cfg_scale=guidance_real)
        return kwargs

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's latents mid-denoise -> the first latent frame (the poster frame) in the VAE's raw space."""
        return latents[:, :, :1] / self.vae.config.scaling_factor


def template_words() -> tuple[str, ...]:
    """The words of HunyuanVideo's prompt template, and the blank line after each header, as single tokens of the
    tiny Llama tokenizer: its template prefix is then ``crop_start`` (95) tokens long, as with the real tokenizer, so
    the pipeline's fixed crop cuts exactly the template."""
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    return (*dict.fromkeys(re.findall(r"[A-Za-z]+", prefix)), "\n\n")


def write_tiny_hunyuanvideo(folder: Path, seed: int = 0) -> None:
    """A random-initialised HunyuanVideo in the diffusers layout (tiny Llama + tiny CLIP + a 2+2-block transformer
    + a 4-level causal VAE with the real 8x/4x compression and scaling factor), seeded on a forked RNG."""
    with torch.random.fork_rng(devices=[]):
        _write_tiny_hunyuanvideo(Path(folder), seed)


def tiny_llama_tokenizer():
    """A byte-level BPE tokenizer shaped like Llama 3's (BOS first, its chat special tokens, its pre-tokenizer split)
    in which HunyuanVideo's template prefix is ``crop_start`` tokens long (see ``template_words``)."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = tiny.fast_byte_level_tokenizer(bos="<|begin_of_text|>", eos="<|end_of_text|>",
                                               specials=LLAMA_SPECIALS, words=template_words())
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.pad_token = "<|end_of_text|>"  # the pipeline pads to max_length
    return tokenizer


def _write_tiny_hunyuanvideo(folder: Path, seed: int) -> None:
    from transformers import LlamaConfig

    tokenizer = tiny_llama_tokenizer()
    torch.manual_seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 4, 4))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLHunyuanVideo(latent_channels=16, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                    norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4)
    torch.manual_seed(seed + 2)
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    clip_tokenizer = tiny.clip_tokenizer(77)
    torch.manual_seed(seed + 3)
    clip = tiny.clip_text_encoder(clip_tokenizer, hidden_size=32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # HunyuanVideo's
    HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                         scheduler=scheduler, text_encoder_2=clip, tokenizer_2=clip_tokenizer).save_pretrained(
        folder, safe_serialization=True)
