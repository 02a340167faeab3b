"""The small surface every model family implements.

An adapter knows how to load its family's pieces (transformer, VAE, text encoders) with ``from_pretrained``,
how to encode prompts and images, how to turn cached latents into the transformer's inputs and back, what the
training target is, its LoRA presets, where a TREAD router hooks, and how to build its diffusers pipeline.
Everything else (the loop, caches, checkpoints) lives in ``simpletuner.training`` and ``simpletuner.data``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class TextEmbedding:
    """One prompt's cached encoder outputs, per sample (no batch dimension)."""

    tensors: dict[str, torch.Tensor]

    @staticmethod
    def collate(items: list["TextEmbedding"]) -> dict[str, torch.Tensor]:
        keys = items[0].tensors.keys()
        return {k: torch.stack([it.tensors[k] for it in items]) for k in keys}


class ModelAdapter:
    """Base class for one model family. Subclasses live one per file (``flux.py``, ...)."""

    family: str = ""
    #: diffusers pipeline class used for validation and for saving LoRA weights
    pipeline_class: Any = None
    #: pixel multiple a training image must have (VAE downscale x transformer patch size)
    resolution_multiple: int = 16
    #: "flow_matching" (velocity target), "epsilon" or "v_prediction"
    prediction_type: str = "flow_matching"

    def __init__(self, config, *, device: torch.device | str = "cpu", weight_dtype: torch.dtype = torch.float32):
        self.config = config
        self.device = torch.device(device)
        self.weight_dtype = weight_dtype
        self.vae = None
        self.text_encoders: list[torch.nn.Module] = []
        self.tokenizers: list[Any] = []
        # how many encoder forwards ran in this process (a warm cache must keep these at zero)
        self.vae_forwards = 0
        self.text_encoder_forwards = 0

    # ---- where the weights live -------------------------------------------------------------------------
    def model_path(self) -> str:
        """The folder or hub id holding the pipeline layout (model_index.json, transformer/, vae/, ...)."""
        if self.config.model_flavour == "tiny":
            return str(self.ensure_tiny_checkpoint())
        if self.config.pretrained_model_name_or_path:
            return self.config.pretrained_model_name_or_path
        raise ValueError("pretrained_model_name_or_path: not set and the flavour gives no default")

    def ensure_tiny_checkpoint(self) -> Path:
        raise NotImplementedError(f"{self.family} has no tiny flavour")

    def component_identity(self, component: str) -> str:
        """A stable string naming the weights of ``component`` (a cache fingerprint ingredient)."""
        path = self.model_path()
        folder = Path(path) / component
        digest = ""
        for name in ("config.json", "tokenizer_config.json"):
            cfg = folder / name
            if cfg.is_file():
                digest += hashlib.sha256(cfg.read_bytes()).hexdigest()[:16]
        revision = getattr(self.config, "revision", None) or ""
        return json.dumps([self.family, path, component, revision, digest])

    # ---- loading ---------------------------------------------------------------------------------------
    def load_transformer(self) -> torch.nn.Module:
        raise NotImplementedError

    def load_vae(self) -> torch.nn.Module:
        raise NotImplementedError

    def load_text_encoders(self) -> None:
        raise NotImplementedError

    def quantize_text_encoders(self) -> None:
        """Apply ``text_encoder_<n>_precision`` to the loaded text encoders (frozen, so any quanto type works)."""
        for n, encoder in enumerate(self.text_encoders, start=1):
            precision = getattr(self.config, f"text_encoder_{n}_precision", None) or "no_change"
            if precision != "no_change":
                from simpletuner.training.quantize import quantize_model

                quantize_model(encoder, precision, exclude=[], field=f"text_encoder_{n}_precision")

    def unload_encoders(self) -> None:
        """Drop the VAE and text encoders (after caching they are not needed for training)."""
        self.vae = None
        self.text_encoders = []
        self.tokenizers = []

    # ---- encoding --------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        raise NotImplementedError

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], (B, 3, H, W) -> normalised latents (B, C, h, w) as the transformer trains on."""
        raise NotImplementedError

    def text_cache_identity(self) -> str:
        raise NotImplementedError

    def vae_cache_identity(self) -> str:
        return self.component_identity("vae")

    # ---- training ----------------------------------------------------------------------------------------
    def model_inputs(self, transformer, noisy_latents, sigmas, text: dict[str, torch.Tensor]) -> dict[str, Any]:
        raise NotImplementedError

    def predict(self, transformer, noisy_latents, sigmas, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's prediction in the latent layout (B, C, h, w)."""
        raise NotImplementedError

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "flow_matching":
            return noise - latents
        raise NotImplementedError(self.prediction_type)

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        raise NotImplementedError

    def transformer_depth(self) -> int:
        """How many blocks a TREAD route can index (read from config, without loading weights)."""
        raise NotImplementedError

    def tread_layout(self, transformer):
        raise NotImplementedError(f"{self.family} has no TREAD router support yet")

    # ---- saving and pipelines ----------------------------------------------------------------------------
    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], output_dir: str | Path) -> Path:
        """Write a LoRA the family's diffusers pipeline loads with ``load_lora_weights`` as is."""
        self.pipeline_class.save_lora_weights(
            str(output_dir), transformer_lora_layers=lora_state_dict, safe_serialization=True
        )
        return Path(output_dir) / "pytorch_lora_weights.safetensors"

    def build_pipeline(self, transformer, **kwargs):
        raise NotImplementedError
