"""HiDream-I1 (full, dev, fast, tiny): a 17B sparse (mixture-of-experts) DiT with four text encoders.

Family quirks kept here:
- four encoders, all through ``HiDreamImagePipeline.encode_prompt``: CLIP-L and CLIP-G give the pooled vector
  (their projections, concatenated), T5-XXL the T5 tokens, and Llama-3.1-8B-Instruct every hidden layer (the
  transformer feeds a different layer to each block), all padded to ``max_sequence_length`` (128, HiDream's limit);
- the Llama encoder is not in HiDream's repositories: real flavours load ``text_encoder_4`` / ``tokenizer_4`` from
  ``LLAMA_PATH`` (as SimpleTuner does), a local model folder that has them (the tiny flavour) from itself;
- the transformer takes (B, C, h, w) latents, patchifies them itself and gets ``timesteps = sigma * 1000``; the
  pipeline negates its output (the model predicts minus the velocity); in train mode the transformer returns its
  patches as (B, C, tokens, p*p) instead of an image, which ``predict`` folds back;
- the VAE is Flux.1's (``(z - shift_factor) * scaling_factor``), so taef1 decodes live previews.

No TREAD layout: the single-stream blocks (32 of 48) take image and text as one concatenated sequence the layout
cannot tell apart, the dual-stream blocks' rotary table orders (image, text) per sample, and non-square images are
padded to ``max_seq`` tokens with a key mask that routing would have to slice too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import TreadLayout

# where SimpleTuner loads HiDream's Llama text encoder and tokenizer from (text_encoder_4/, tokenizer_4/)
LLAMA_PATH = "terminusresearch/HiDream-I1-Llama-3.1-8B-Instruct"
# HiDream was trained on 128 tokens per encoder (SimpleTuner refuses more without i_know_what_i_am_doing)
DEFAULT_MAX_SEQUENCE_LENGTH = 128
# latents per side of the area the tiny flavour's pipeline generates at (HiDream-I1's is 128: 1024x1024 pixels)
TINY_SAMPLE_SIZE = 8
# Tiny AutoEncoder for Flux.1 latents (HiDream uses Flux.1's VAE); the tiny flavour ships its own in vae_preview/
PREVIEW_DECODER = "madebyollin/taef1"

_ATTN = ["to_q", "to_k", "to_v", "to_out"]
_TEXT_ATTN = ["to_q_t", "to_k_t", "to_v_t", "to_out_t"]
_SWIGLU = ["w1", "w2", "w3"]  # every feed-forward: shared and routed experts, the text stream's
LORA_PRESETS = {
    "attention": _ATTN,  # image (and, in single-stream blocks, joint) attention: SimpleTuner's default
    "all": _ATTN + _TEXT_ATTN,
    "context": _TEXT_ATTN,
    "all+ffs": _ATTN + _TEXT_ATTN + _SWIGLU,
}


class HiDreamAdapter(ModelAdapter):
    family = "hidream"
    pipeline_class = HiDreamImagePipeline
    denoiser_class = HiDreamImageTransformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (
        ("text_encoder", CLIPTextModelWithProjection, "tokenizer", CLIPTokenizer),
        ("text_encoder_2", CLIPTextModelWithProjection, "tokenizer_2", CLIPTokenizer),
        ("text_encoder_3", T5EncoderModel, "tokenizer_3", T5Tokenizer),
        ("text_encoder_4", LlamaForCausalLM, "tokenizer_4", PreTrainedTokenizerFast),
    )
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_hidream(folder)

    @property
    def max_sequence_length(self) -> int:
        return int(getattr(self.config, "tokenizer_max_length", None) or DEFAULT_MAX_SEQUENCE_LENGTH)

    def component_source(self, component: str) -> tuple[str, str | None]:
        path, revision = super().component_source(component)
        if component in ("text_encoder_4", "tokenizer_4") and not (Path(path) / component).is_dir():
            return LLAMA_PATH, None
        return path, revision

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = HiDreamImagePipeline(scheduler=None, vae=None, transformer=None, **self.text_encoder_components())
        t5, _, llama, _, pooled, _ = shell.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        self.text_encoder_forwards += 1
        # llama is (layers, batch, tokens, dim): each prompt keeps all of its layers
        return [TextEmbedding({"t5_prompt_embeds": t5[i].float().cpu(), "llama_prompt_embeds": llama[:, i].float().cpu(),
                               "pooled_prompt_embeds": pooled[i].float().cpu()}) for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"max_sequence_length={self.max_sequence_length}"]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """HiDreamImagePipeline's call: ``timesteps`` on the 0..1000 scale, Llama layers first, the output negated."""
        b, c, h, w = noisy_latents.shape
        model = getattr(transformer, "module", transformer)  # unwrap DDP
        dtype, device = model.dtype, noisy_latents.device
        out = transformer(
            hidden_states=noisy_latents.to(dtype),
            timesteps=(t.to(device, torch.float32) * 1000).expand(b),
            encoder_hidden_states_t5=text["t5_prompt_embeds"].to(device, dtype),
            encoder_hidden_states_llama3=text["llama_prompt_embeds"].to(device, dtype).transpose(0, 1),
            pooled_embeds=text["pooled_prompt_embeds"].to(device, dtype),
            return_dict=False,
        )[0]
        if model.training and not model.config.force_inference_output:
            out = self._fold_patches(out, h, w, model.config.patch_size)
        return -out

    @staticmethod
    def _fold_patches(patches: torch.Tensor, height: int, width: int, p: int) -> torch.Tensor:
        """Train-mode output (B, C, tokens, p*p) -> (B, C, h, w); tokens beyond the image (non-square images are
        padded to the transformer's max_seq) are dropped."""
        b, c = patches.shape[:2]
        ph, pw = height // p, width // p
        x = patches[:, :, : ph * pw].reshape(b, c, ph, pw, p, p).permute(0, 1, 2, 4, 3, 5)
        return x.reshape(b, c, height, width)

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def tread_layout(self, transformer) -> TreadLayout | None:
        return None  # see the module docstring: single-stream blocks carry image and text as one sequence

    # ---- validation ----------------------------------------------------------------------------------------
    def _pipeline(self, transformer, text_components):
        """HiDreamImagePipeline generates at one fixed area whatever height and width ask for (it keeps their aspect
        ratio): ``default_sample_size`` latents squared, HiDream-I1's 128 (1024x1024 pixels). The tiny flavour's own
        area is 64x64 pixels."""
        pipe = super()._pipeline(transformer, text_components)
        if self.config.model_flavour == "tiny":
            pipe.default_sample_size = TINY_SAMPLE_SIZE
        return pipe

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        """HiDream has no guidance embedding; its ``guidance_scale`` is classifier-free guidance, on here when
        ``guidance_real`` > 1 and a ``negative`` embedding is given (the pipeline's own default of 5 would need
        negative embeddings it cannot encode without its text encoders)."""
        kwargs = {"prompt_embeds_t5": text["t5_prompt_embeds"],
                  "prompt_embeds_llama3": text["llama_prompt_embeds"].transpose(0, 1),
                  "pooled_prompt_embeds": text["pooled_prompt_embeds"], "guidance_scale": 0.0,
                  "max_sequence_length": self.max_sequence_length}
        if guidance_real > 1 and negative is not None:
            kwargs.update(negative_prompt_embeds_t5=negative["t5_prompt_embeds"],
                          negative_prompt_embeds_llama3=negative["llama_prompt_embeds"].transpose(0, 1),
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"], guidance_scale=guidance_real)
        return kwargs

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _write_tiny_hidream(folder: Path, seed: int = 0) -> None:
    clip = tiny.clip_tokenizer(248)  # HiDream's CLIPs read 128 tokens: their position tables are longer than 77
    t5_tokenizer = tiny.t5_tokenizer(512)
    llama_tokenizer = tiny.fast_byte_level_tokenizer(
        bos="<|begin_of_text|>", eos="<|eot_id|>", specials=["<|end_of_text|>", "<|start_header_id|>",
                                                              "<|end_header_id|>"])
    torch.manual_seed(seed)
    # max_resolution (16, 16) latents: non-square training images up to 128x128 pixels of area
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16), llama_layers=[0, 1, 1],
    )
    torch.manual_seed(seed + 1)
    # a pipeline loaded as users load it decodes HiDream's fixed 1024x1024 area: thin full-resolution layers and no
    # mid-block attention (over 128x128 latents) keep that decode quick
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(4, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=128, mid_block_add_attention=False,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,  # Flux.1's
    )
    encoders = {}
    for n, name in enumerate(("text_encoder", "text_encoder_2")):
        torch.manual_seed(seed + 2 + n)
        encoders[name] = CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=248, projection_dim=32, bos_token_id=clip.bos_token_id,
            eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id,
        ))
    torch.manual_seed(seed + 4)
    encoders["text_encoder_3"] = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    torch.manual_seed(seed + 5)
    encoders["text_encoder_4"] = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(llama_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)  # HiDream-I1-Fast's
    HiDreamImagePipeline(
        scheduler=scheduler, vae=vae, tokenizer=clip, tokenizer_2=clip, tokenizer_3=t5_tokenizer,
        tokenizer_4=llama_tokenizer, transformer=transformer, **encoders,
    ).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 6)
    # a Tiny AutoEncoder for live previews, matching the tiny VAE's latents (4 channels, 8x upscale)
    AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), latent_channels=4,
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1),
    ).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
