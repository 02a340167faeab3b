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

Qwen-Image-Edit (``edit-v1``, and ``tiny`` when the data pairs reference images) trains on (reference, edited) pairs
exactly as ``QwenImageEditPipeline`` runs: the reference, cropped as its target was, is resized to the pipeline's
1024x1024 area (its aspect kept, sides multiples of 32); its latents are packed into tokens after the target's, with
its own (frame, h/2, w/2) entry in ``img_shapes``, and only the target tokens of the output are the prediction; and
the prompt is encoded with that resized reference by Qwen2.5-VL (the edit template, with the image's vision tokens
kept in the embedding), so text embeddings are cached per (caption, reference image). Qwen2.5-VL's processor lives
in ``processor/``; without torchvision (which its video half needs) it loads as the same processor without the
video half.

Qwen-Image 2.1 (``QwenImage21Pipeline``) is not a flavour here: its transformer is a different class
(``QwenImage21Transformer2DModel``, KV-cached prefix attention), with a Qwen3-VL text encoder and its own VAE.

Qwen-Image-Edit Plus (2509/2511, ``QwenImageEditPlusPipeline``) is not a flavour yet: it encodes several references
at two other areas (384x384 for the text encoder, 1024x1024 for the VAE) under another template.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout
from simpletuner.models.weights import WeightSource, explained

# QwenImagePipeline's __call__ default; prompts are cut to it when the pipeline is given embeddings
DEFAULT_MAX_SEQUENCE_LENGTH = 512
# QwenImageEditPipeline resizes every reference image to this area (aspect kept) before the VAE and Qwen2.5-VL see it
EDIT_REFERENCE_AREA = 1024 * 1024
# the words of QwenImageEditPipeline's template: single tokens in the tiny tokenizer, so its system prompt is 64 tokens
# as with the real one and the pipeline's fixed drop index cuts exactly the template
EDIT_TEMPLATE_WORDS = ("key", "features", "input", "then", "explain", "how", "instruction", "should", "alter", "or",
                       "modify", "Generate", "new", "meets", "requirements", "while", "maintaining", "consistency",
                       "original", "where", "appropriate", "'s", "(", "),")

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


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """Qwen2.5-VL's processor without its video half (whose video processor needs torchvision, not installable beside
    a CPU torch): the same tokenizer and image processor, the same expansion of each image into its vision tokens."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class QwenImageAdapter(ModelAdapter):
    family = "qwen_image"
    pipeline_class = QwenImagePipeline
    edit_pipeline_class = QwenImageEditPipeline
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
        """A pipeline shell holding only the text encoder (and, for an edit run, the processor), so prompts are
        encoded by diffusers' own code."""
        return self.run_pipeline_class(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())

    def text_encoder_components(self) -> dict[str, Any]:
        components = super().text_encoder_components()
        if self.references:
            components["processor"] = self.load_processor()
        return components

    def load_processor(self) -> Qwen2VLProcessor:
        """Qwen2.5-VL's processor from ``processor/`` (QwenImageEditPipeline's component): transformers' own where
        torchvision is installed, otherwise the same without its video half."""
        from transformers.utils import is_torchvision_available

        if getattr(self, "_processor", None) is None:
            path, revision = self.component_source("processor")
            cls = Qwen2VLProcessor if is_torchvision_available() else Qwen2VLImageTextProcessor
            with explained(self._processor_weights()):
                self._processor = cls.from_pretrained(path, subfolder="processor", revision=revision)
        return self._processor

    def _processor_weights(self) -> WeightSource:
        path, revision = self.component_source("processor")
        return WeightSource(self._base_field(), path, "processor", need=(), weights=False, what="processor",
                            revision=revision)

    def weight_sources(self) -> list[WeightSource]:
        return super().weight_sources() + ([self._processor_weights()] if self.references else [])

    def build_validation_pipeline(self, transformer):
        """Validation hands the pipeline cached embeddings: no text encoder, tokenizer or processor."""
        names = ["text_encoder", "tokenizer"] + (["processor"] if self.references else [])
        return self._pipeline(transformer, dict.fromkeys(names))

    def load_pipeline(self, path=None):
        """An edit run's QwenImageEditPipeline gets the processor this adapter loads (see ``load_processor``)."""
        extra = {"processor": self.load_processor()} if self.references else {}
        return self.run_pipeline_class.from_pretrained(str(path or self.model_path()), **extra)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        if self.references:
            raise ValueError("an edit run encodes each prompt with its reference image (encode_text)")
        embeds, mask = self.text_pipeline().encode_prompt(
            list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        return self._embeddings(embeds, mask)

    @property
    def prompt_takes_reference(self) -> bool:
        """Qwen-Image-Edit's Qwen2.5-VL reads the reference image with the prompt."""
        return self.references

    @torch.no_grad()
    def encode_prompts_with_references(self, prompts, references, *, negative: bool = False) -> list[TextEmbedding]:
        """Each prompt with its reference, as QwenImageEditPipeline encodes them (negatives alike): the reference
        resized to the pipeline's area, then Qwen2.5-VL over the edit template with the image's vision tokens."""
        pipe = self.text_pipeline()
        images = [self.edit_reference_image(pixels) for pixels in references]
        embeds, mask = pipe.encode_prompt(list(prompts), image=images, device=self.device)
        return self._embeddings(embeds, mask)

    def _embeddings(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> list[TextEmbedding]:
        self.text_encoder_forwards += 1
        lengths = mask.sum(1).tolist() if mask is not None else [embeds.shape[1]] * embeds.shape[0]
        # each prompt keeps its own tokens only; a batch pads them again (TextEmbedding.collate)
        return [TextEmbedding({"prompt_embeds": embeds[i, :n].float().cpu(),
                               "prompt_embeds_mask": torch.ones(n, dtype=torch.long)})
                for i, n in enumerate(int(n) for n in lengths)]

    def text_identity_extras(self) -> list[str]:
        extras = [f"max_sequence_length={self.max_sequence_length}"]
        if self.references:  # the processor decides how the reference becomes vision tokens
            path, _ = self.component_source("processor")
            digest = hashlib.sha256()
            for name in ("processor_config.json", "preprocessor_config.json"):
                config = Path(path) / "processor" / name
                digest.update(config.read_bytes() if config.is_file() else b"")
            extras.append(f"edit-processor={path}:{digest.hexdigest()[:16]}")
        return extras

    # ---- reference images --------------------------------------------------------------------------------
    def edit_reference_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) QwenImageEditPipeline resizes a width x height reference image to."""
        w, h, _ = calculate_dimensions(EDIT_REFERENCE_AREA, width / height)
        return int(w), int(h)

    def edit_reference_image(self, pixels: torch.Tensor):
        """A reference (3, H, W) in [-1, 1] (8-bit values, as the data layer loads them) -> the PIL image the pipeline
        encodes: the same image resized by the pipeline's own image processor to ``edit_reference_size``."""
        image = self._pil(pixels)
        width, height = self.edit_reference_size(*image.size)
        return self._image_processor.resize(image, height, width)

    @cached_property
    def _image_processor(self):
        """QwenImageEditPipeline's image processor (VAE scale x 2 packing), built by the pipeline itself."""
        return QwenImageEditPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                     transformer=None).image_processor

    @torch.no_grad()
    def encode_references(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) references -> (B, C, h', w') latents of the pipeline's resized references (its VAE input)."""
        images = [self.edit_reference_image(p) for p in pixels]
        width, height = images[0].size
        prepared = self._image_processor.preprocess(images, height, width)
        return self.encode_images(prepared)

    def reference_cache_identity(self) -> str:
        return self.vae_cache_identity() + f"|edit-reference-area={EDIT_REFERENCE_AREA}"

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
        mask (None when every token is real, as the pipeline passes it) and the (frames, h/2, w/2) token grid. With
        ``reference_latents``, QwenImageEditPipeline's: the reference tokens follow the target's, with their own
        grid in ``img_shapes``."""
        b, _, h, w = noisy_latents.shape
        dtype = getattr(transformer, "module", transformer).dtype  # unwrap DDP
        device = noisy_latents.device
        mask = text["prompt_embeds_mask"].to(device)
        tokens = self.pack_latents(noisy_latents).to(dtype)
        shapes = [(1, h // 2, w // 2)]
        reference = text.get("reference_latents")
        if reference is not None:
            tokens = torch.cat([tokens, self.pack_latents(reference.to(device, dtype))], dim=1)
            shapes.append((1, reference.shape[-2] // 2, reference.shape[-1] // 2))
        return {
            "hidden_states": tokens,
            "timestep": t.to(device, dtype).expand(b),
            "guidance": None,
            "encoder_hidden_states": text["prompt_embeds"].to(device, dtype),
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
            "img_shapes": [shapes] * b,
            "return_dict": False,
        }

    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        _, _, h, w = noisy_latents.shape
        out = transformer(**self.model_inputs(transformer, noisy_latents, t, text))[0]
        return self.unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)  # the target's tokens (an edit adds more)

    def image_token_mask(self, mask: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """A token is kept when any of its 2x2 latents is masked in; reference tokens are not forced."""
        b, _, h, w = mask.shape
        tokens = mask.view(b, h // 2, 2, w // 2, 2).any(4).any(2).reshape(b, -1)
        reference = text.get("reference_latents")
        if reference is not None:
            tokens = torch.cat([tokens, tokens.new_zeros(b, self.image_seq_len(reference.shape))], dim=1)
        return tokens

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
        if "reference_pixels" in text:  # QwenImageEditPipeline takes the image itself (it sizes it from the PIL)
            kwargs.update(self.reference_pipeline_kwargs(self._pil(text["reference_pixels"][0])))
        return kwargs

    def reference_pipeline_kwargs(self, image) -> dict:
        """QwenImageEditPipeline's ``image``: it resizes the image to its area and encodes it for the VAE and the text
        encoder itself, as training encoded the references."""
        return {"image": image}

    @staticmethod
    def _pil(pixels: torch.Tensor):
        from PIL import Image

        array = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(array)

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pack_latents(latents)


def _write_tiny_qwen_image(folder: Path, seed: int = 0) -> None:
    tokenizer = tiny.qwen2_tokenizer(chat_template=None, words=EDIT_TEMPLATE_WORDS)
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
    _write_tiny_processor(folder, tokenizer)


def _write_tiny_processor(folder: Path, tokenizer) -> None:
    """Qwen2.5-VL's processor in ``processor/``, as Qwen-Image-Edit ships it, listed in model_index.json (which
    QwenImagePipeline ignores and QwenImageEditPipeline loads): Qwen2.5-VL's image settings, but at most 112x112
    pixels (16 vision tokens) per image, so the tiny text encoder reads a reference in a few milliseconds."""
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder / "processor")
    config = folder / "processor" / "processor_config.json"
    values = json.loads(config.read_text())
    values["processor_class"] = "Qwen2VLProcessor"  # the real folder's class; it loads without its video half too
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    index = folder / "model_index.json"
    values = json.loads(index.read_text())
    values["processor"] = ["transformers", "Qwen2VLProcessor"]
    index.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
