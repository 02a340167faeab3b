"""AuraFlow (v0.3, v0.2, v0.1, pony, tiny): a rectified-flow DiT with MMDiT blocks followed by single-stream blocks.

Family quirks kept here:
- one text encoder, Pile-T5 (a UMT5 encoder with a Llama tokenizer); the pipeline zeroes the padded positions of its
  output and requires the attention mask beside cached embeddings, though the transformer takes no mask;
- the transformer patchifies (B, 4, h, w) SDXL-VAE latents itself (learned positions, 8 register tokens in front of
  the text) and gets ``timestep = sigma`` (the pipeline divides its 0..1000 timesteps by 1000);
- the VAE is SDXL's: ``z * scaling_factor`` with no shift, so taesdxl decodes previews;
- validation runs classifier-free guidance at ``validation_guidance`` > 1;
- TREAD routes image tokens through both kinds of block: the MMDiT blocks carry image and text apart, the single
  blocks one text+image sequence whose image part the router routes (``JointSequence``); positions are added at the
  patch embedding, so nothing else needs slicing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler
from transformers import LlamaTokenizerFast, UMT5EncoderModel

from simpletuner.models import tiny
from simpletuner.models.base import ModelAdapter, TextEmbedding
from simpletuner.models.tread_layout import JointSequence, TreadLayout

# T5 tokens per prompt (SimpleTuner's: 120, pony 768)
DEFAULT_T5_LENGTH = {"pony": 768, "tiny": 32}
T5_LENGTH = 120
PREVIEW_DECODER = "madebyollin/taesdxl"

_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]  # image stream of the MMDiT blocks, the whole sequence in single blocks
_CONTEXT_ATTN = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_FF = ["ff.linear_1", "ff.linear_2", "ff.out_projection"]
_CONTEXT_FF = ["ff_context.linear_1", "ff_context.linear_2", "ff_context.out_projection"]
LORA_PRESETS = {
    "all": _ATTN + _CONTEXT_ATTN,  # SimpleTuner's default for AuraFlow
    "attention": _ATTN,
    "context": _CONTEXT_ATTN,
    "all+ffs": _ATTN + _CONTEXT_ATTN + _FF + _CONTEXT_FF,
}


class AuraFlowAdapter(ModelAdapter):
    family = "auraflow"
    pipeline_class = AuraFlowPipeline
    denoiser_class = AuraFlowTransformer2DModel
    lora_presets = LORA_PRESETS
    text_encoder_specs = (("text_encoder", UMT5EncoderModel, "tokenizer", LlamaTokenizerFast),)
    resolution_multiple = 16  # VAE /8, then 2x2 patches

    @staticmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            _write_tiny_auraflow(folder)

    @property
    def t5_max_length(self) -> int:
        configured = getattr(self.config, "tokenizer_max_length", None)
        return int(configured or DEFAULT_T5_LENGTH.get(self.config.model_flavour or "", T5_LENGTH))

    # ---- encoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        shell = AuraFlowPipeline(transformer=None, scheduler=None, vae=None, **self.text_encoder_components())
        embeds, mask, _, _ = shell.encode_prompt(
            prompt=list(prompts), do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.t5_max_length,
        )
        self.text_encoder_forwards += 1
        # the pipeline's mask is the token mask broadcast over the embedding width; keep one value per token
        tokens = mask.view(*embeds.shape)[..., 0]
        return [TextEmbedding({"prompt_embeds": embeds[i].float().cpu(),
                               "prompt_attention_mask": tokens[i].float().cpu()}) for i in range(len(prompts))]

    def text_identity_extras(self) -> list[str]:
        return [f"t5_len={self.t5_max_length}"]

    # ---- training ----------------------------------------------------------------------------------------
    def predict(self, transformer, noisy_latents, t, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pipeline's call: latents as they are, ``timestep = sigma`` (its 0..1000 timestep / 1000)."""
        model = getattr(transformer, "module", transformer)
        dtype, device = model.dtype, noisy_latents.device
        return transformer(
            noisy_latents.to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
            timestep=t.to(device, dtype),
            return_dict=False,
        )[0]

    def image_seq_len(self, latent_shape) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def transformer_depth(self) -> int:
        """MMDiT + single blocks, read from config.json without loading weights."""
        path, subfolder = self.denoiser_source()
        if str(path).endswith((".safetensors", ".sft")):
            raise ValueError("tread_config: count AuraFlow's blocks from a diffusers folder, not a single file")
        cfg = AuraFlowTransformer2DModel.load_config(path, subfolder=subfolder if subfolder != "none" else None,
                                                     revision=self.config.revision)
        return int(cfg["num_mmdit_layers"]) + int(cfg["num_single_dit_layers"])

    def tread_layout(self, transformer) -> TreadLayout:
        """MMDiT blocks: ``block(hidden_states, encoder_hidden_states, temb)`` -> ``(encoder_hidden_states,
        hidden_states)``; single blocks: ``block(register+text+image sequence, temb)`` -> that sequence."""
        joint = transformer.joint_transformer_blocks
        return TreadLayout(
            blocks=list(joint) + list(transformer.single_transformer_blocks), rotary_arg=None, rotary_pos=None,
            shared_selection=False, joint=JointSequence(start=len(joint), image_tokens=_patch_tokens),
        )

    # ---- validation ----------------------------------------------------------------------------------------
    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        return guidance > 1

    def validation_pipeline_kwargs(self, text, negative=None, *, guidance: float, guidance_real: float) -> dict:
        kwargs = {"prompt_embeds": text["prompt_embeds"], "prompt_attention_mask": text["prompt_attention_mask"],
                  "guidance_scale": guidance, "max_sequence_length": self.t5_max_length}
        if negative is not None and guidance > 1:
            kwargs.update(negative_prompt_embeds=negative["prompt_embeds"],
                          negative_prompt_attention_mask=negative["prompt_attention_mask"])
        return kwargs

    def preview_decoder_source(self) -> tuple[str, str | None]:
        if self.config.model_flavour == "tiny":
            return self.model_path(), "vae_preview"
        return PREVIEW_DECODER, None


def _patch_tokens(model, args: tuple, kwargs: dict) -> int:
    """Image tokens of the transformer's (B, C, h, w) input: one per patch."""
    latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    p = model.config.patch_size
    return (latents.shape[-2] // p) * (latents.shape[-1] // p)


def _write_tiny_auraflow(folder: Path, seed: int = 0) -> None:
    """A random AuraFlow: 2 MMDiT + 2 single blocks, a UMT5 encoder with a Llama tokenizer, an SDXL-style VAE."""
    tokenizer = tiny.llama_tokenizer(512)
    torch.manual_seed(seed)
    transformer = AuraFlowTransformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
        out_channels=4, pos_embed_max_size=256,
    )
    # this narrow, the default init leaves the bias-free AdaLN-Zero gates and gated feed-forwards so small that the
    # blocks move the residual stream by ~1%: draw every linear weight N(0, 1/fan_in) so they act (and LoRA shows)
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features ** -0.5)
    torch.manual_seed(seed + 1)
    vae = tiny.autoencoder_kl(latent_channels=4, scaling_factor=0.13025, quant_conv=True)  # SDXL's VAE value
    torch.manual_seed(seed + 2)
    text_encoder = tiny.t5_encoder(tokenizer, d_model=32, umt5=True)
    AuraFlowPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.73),
    ).save_pretrained(folder, safe_serialization=True)
    torch.manual_seed(seed + 3)
    tiny.autoencoder_tiny(4).save_pretrained(Path(folder) / "vae_preview", safe_serialization=True)
