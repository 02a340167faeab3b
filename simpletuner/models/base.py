"""The contract every model family implements: one subclass of ``ModelAdapter`` per file (``flux.py``, ...).

An adapter knows how to load its family's pieces (transformer, VAE, text encoders) with ``from_pretrained``, write
its ``tiny`` flavour, encode prompts and images, turn cached latents into the transformer's inputs and its output
back into the latent layout, its LoRA presets, where a TREAD router hooks, and how to build its diffusers pipeline
for validation and previews. The training objective (flow matching, epsilon, v-prediction) comes from
``objectives.py``; everything else (the loop, caches, checkpoints) lives in ``simpletuner.training`` and
``simpletuner.data``.

Every method the trainer, the evaluator and the data layer call is declared here, abstract where each family must
decide. A family class (one that sets ``family``) that misses any of them fails when its module is imported, with
the list of what is missing, never at the first validation step. ``tests/models/test_contract.py`` then proves each
family in the table against its diffusers pipeline.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from simpletuner.models import tiny
from simpletuner.models.objectives import Objective, build_objective
from simpletuner.models.tread_layout import TreadLayout


@dataclass
class TextEmbedding:
    """One prompt's cached encoder outputs, per sample (no batch dimension)."""

    tensors: dict[str, torch.Tensor]

    @staticmethod
    def collate(items: list["TextEmbedding"]) -> dict[str, torch.Tensor]:
        keys = items[0].tensors.keys()
        return {k: torch.stack([it.tensors[k] for it in items]) for k in keys}


class _AdapterMeta(ABCMeta):
    """Refuses, at import, a family class (one that sets ``family``) that leaves part of the contract out."""

    def __new__(mcls, name, bases, namespace, **kwargs):
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        if namespace.get("family"):
            missing = sorted(cls.__abstractmethods__)
            if cls.pipeline_class is None:
                missing.append("pipeline_class")
            if missing:
                raise TypeError(f"{name} (model family {namespace['family']!r}) does not implement the adapter "
                                f"contract: {', '.join(missing)} (see simpletuner/models/base.py)")
        return cls


class ModelAdapter(metaclass=_AdapterMeta):
    """Base class for one model family. Subclasses set the class attributes and implement the abstract methods."""

    #: the ``model_family`` name, as in the family table
    family: str = ""
    #: the diffusers pipeline class used for validation and for saving/loading LoRA weights
    pipeline_class: Any = None
    #: pixel multiple a training image must have (VAE downscale x transformer patch size)
    resolution_multiple: int = 16

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
        """The ``tiny`` flavour's folder, written (once, atomically) by ``write_tiny_checkpoint``."""
        return tiny.ensure_checkpoint(self.family, type(self).write_tiny_checkpoint)

    @staticmethod
    @abstractmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        """Write a small random-initialised model in the real diffusers layout (model_index.json and one folder
        per component) into ``folder``; deterministic, on a forked RNG so it never shifts a run's random draws."""

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
    @abstractmethod
    def load_transformer(self) -> torch.nn.Module:
        """The denoiser (transformer or UNet) in ``weight_dtype``, on the CPU, in train mode and unfrozen."""

    @abstractmethod
    def load_vae(self) -> torch.nn.Module:
        """Load ``self.vae`` (frozen, eval, on ``self.device``) and return it."""

    @abstractmethod
    def load_text_encoders(self) -> None:
        """Load ``self.text_encoders`` and ``self.tokenizers`` (frozen, eval, on ``self.device``), then call
        ``quantize_text_encoders``."""

    def quantize_text_encoders(self) -> None:
        """Apply ``text_encoder_<n>_precision`` to the loaded text encoders (frozen, so any quanto type works)."""
        for n, encoder in enumerate(self.text_encoders, start=1):
            precision = getattr(self.config, f"text_encoder_{n}_precision", None) or "no_change"
            if precision != "no_change":
                from simpletuner.models.quantize import quantize_model

                quantize_model(encoder, precision, exclude=[], field=f"text_encoder_{n}_precision")

    def unload_encoders(self) -> None:
        """Drop the VAE and text encoders (after caching they are not needed for training)."""
        self.vae = None
        self.text_encoders = []
        self.tokenizers = []

    # ---- encoding --------------------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        """Each prompt's encoder outputs exactly as the family's pipeline computes them (loading the text encoders
        on first use), one ``TextEmbedding`` per prompt, float32 on the CPU."""

    @abstractmethod
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], (B, 3, H, W) -> normalised latents (B, C, h, w) as the transformer trains on (loading
        the VAE on first use), float32 on the CPU."""

    @abstractmethod
    def text_cache_identity(self) -> str:
        """A string that changes whenever a prompt would encode differently (encoders, tokenizers, lengths,
        precisions): part of every text-cache key."""

    def vae_cache_identity(self) -> str:
        """Like ``text_cache_identity`` for latents."""
        return self.component_identity("vae")

    # ---- training ----------------------------------------------------------------------------------------
    @cached_property
    def objective(self) -> Objective:
        """The run's training objective (``prediction_type``) with this model's scheduler constants."""
        return build_objective(self.config, self.noise_schedule_config())

    def noise_schedule_config(self) -> dict:
        """The model's own scheduler config (``scheduler/scheduler_config.json``): the constants an objective
        needs (flow shift bounds, DDPM betas)."""
        from diffusers import DDPMScheduler

        # any scheduler class reads scheduler/scheduler_config.json as it is, whatever class it names
        return dict(DDPMScheduler.load_config(self.model_path(), subfolder="scheduler",
                                              revision=getattr(self.config, "revision", None)))

    @abstractmethod
    def predict(self, transformer, noisy_latents: torch.Tensor, t: torch.Tensor,
                text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's prediction in the latent layout of ``noisy_latents`` (B, C, h, w), for timesteps ``t``
        in the objective's units and a batch of cached text embeddings, exactly as the pipeline calls it."""

    @abstractmethod
    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """How many image tokens the transformer sees for latents of this shape ((B, C, h, w), or (B, C, F, h, w)
        for video); the resolution-dependent shift reads it."""

    @abstractmethod
    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        """PEFT target module names for the family's ``lora_target`` preset (declared in the family table)."""

    @abstractmethod
    def transformer_depth(self) -> int:
        """How many blocks a TREAD route can index (read from config, without loading weights)."""

    @abstractmethod
    def tread_layout(self, transformer) -> TreadLayout | None:
        """Where TREAD hooks in this family's blocks, or None when its token path does not allow routing."""

    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], output_dir: str | Path) -> Path:
        """Write a LoRA the family's diffusers pipeline loads with ``load_lora_weights`` as is."""
        self.pipeline_class.save_lora_weights(
            str(output_dir), transformer_lora_layers=lora_state_dict, safe_serialization=True
        )
        return Path(output_dir) / "pytorch_lora_weights.safetensors"

    # ---- pipelines ---------------------------------------------------------------------------------------
    @abstractmethod
    def build_pipeline(self, transformer):
        """The family's whole diffusers pipeline around ``transformer`` (text encoders and VAE loaded)."""

    @abstractmethod
    def build_validation_pipeline(self, transformer):
        """The pipeline around the training transformer that takes cached prompt embeddings (no text encoders)."""

    @abstractmethod
    def validation_pipeline_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None,
                                   *, guidance: float, guidance_real: float) -> dict:
        """Pipeline keyword arguments for one image from batched cached embeddings: ``guidance`` is the family's
        guidance scale, ``guidance_real`` > 1 with a ``negative`` embedding turns on true CFG where the family
        distinguishes the two. Non-tensor arguments (lengths, guidance) must also be right for a call with
        ``prompt=`` instead of the embeddings."""

    @abstractmethod
    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents in the training layout (B, C, h, w) -> the pipeline's ``latents=`` argument."""

    @abstractmethod
    def preview_decoder_source(self) -> tuple[str, str | None] | None:
        """(path or hub id, subfolder) of the Tiny AutoEncoder that decodes live previews, or None if the family
        has none (previews are then refused when validation starts)."""

    def load_preview_decoder(self):
        from diffusers import AutoencoderTiny

        source = self.preview_decoder_source()
        if source is None:
            raise ValueError(f"validation_preview: model_family {self.family!r} has no tiny autoencoder for previews")
        path, subfolder = source
        decoder = AutoencoderTiny.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32)
        return decoder.requires_grad_(False).eval().to(self.device)

    @abstractmethod
    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's latents mid-denoise -> (B, C, h, w) in the VAE's raw latent space (what the preview
        decoder decodes)."""
