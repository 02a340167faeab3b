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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from simpletuner.models import tiny
from simpletuner.models.objectives import Objective, build_objective
from simpletuner.models.tread_layout import TreadLayout
from simpletuner.models.weights import WeightLoadError, WeightSource, check_weight_sources, explained


@dataclass
class TextEmbedding:
    """One prompt's cached encoder outputs, per sample (no batch dimension)."""

    tensors: dict[str, torch.Tensor]

    @staticmethod
    def collate(items: list["TextEmbedding"]) -> dict[str, torch.Tensor]:
        """Stack a batch; variable-length sequences (an LLM encoder's tokens and their masks, kept unpadded in the
        cache) are right-padded with zeros to the longest, zero meaning "not a token" in a mask."""
        keys = items[0].tensors.keys()
        return {k: _stack_padded([it.tensors[k] for it in items]) for k in keys}


def _stack_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    if any(t.dim() == 0 or t.shape[1:] != tensors[0].shape[1:] for t in tensors):
        raise ValueError(f"text embeddings differ beyond their length: {[tuple(t.shape) for t in tensors]}")
    longest = max(t.shape[0] for t in tensors)
    return torch.stack([torch.cat([t, t.new_zeros(longest - t.shape[0], *t.shape[1:])]) for t in tensors])


class EncoderNotLoaded(ValueError):
    """Split training's stage 2 was asked to encode something stage 1 did not cache."""


def _refuse_encode(*args, **kwargs):
    raise EncoderNotLoaded("train_from_cache: the VAE only decodes in split training's stage 2, and an image this "
                           "run needs is not in the cache; run `simpletuner cache` again")


class _AdapterMeta(ABCMeta):
    """Refuses, at import, a family class (one that sets ``family``) that leaves part of the contract out."""

    def __new__(mcls, name, bases, namespace, **kwargs):
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        if namespace.get("family"):
            missing = sorted(cls.__abstractmethods__)
            missing += [attr for attr in ("pipeline_class", "denoiser_class") if getattr(cls, attr) is None]
            if cls.lora_presets is None and cls.lora_target_modules is ModelAdapter.lora_target_modules:
                missing.append("lora_presets (or lora_target_modules)")
            if missing:
                raise TypeError(f"{name} (model family {namespace['family']!r}) does not implement the adapter "
                                f"contract: {', '.join(missing)} (see simpletuner/models/base.py)")
        return cls


class ModelAdapter(metaclass=_AdapterMeta):
    """Base class for one model family. Subclasses set the class attributes and implement the abstract methods;
    the rest has defaults that fit diffusers' usual layout (override what a family does differently)."""

    #: the ``model_family`` name, as in the family table
    family: str = ""
    #: the diffusers pipeline class used for validation and for saving/loading LoRA weights
    pipeline_class: Any = None
    #: the pipeline of the family's edit flavours (``reference_flavours`` in the family table), which takes a
    #: reference image beside the prompt; None for a family without one
    edit_pipeline_class: Any = None
    #: the denoiser's model class, and its subfolder (also its pipeline component name: "transformer" or "unet")
    denoiser_class: Any = None
    denoiser_subfolder: str = "transformer"
    #: the VAE's model class (subfolder and component "vae"); None means diffusers' AutoencoderKL
    vae_class: Any = None
    #: ``lora_target`` preset -> PEFT target module names (matched as name suffixes); a family whose names depend
    #: on the loaded model (block counts) overrides ``lora_target_modules`` instead
    lora_presets: Mapping[str, Sequence[str]] | None = None
    #: (encoder subfolder, encoder class, tokenizer subfolder, tokenizer class) for each text encoder, in the order
    #: ``text_encoder_1_precision``, ``text_encoder_2_precision``, ... refer to them
    text_encoder_specs: tuple[tuple[str, Any, str, Any], ...] = ()
    #: module-name patterns (fnmatch) of the denoiser that ``base_model_precision`` keeps in full precision besides
    #: the shared ones (``quantize.DEFAULT_EXCLUDE``): a family's embedders and projections outside its blocks
    full_precision_modules: tuple[str, ...] = ()
    #: the keyword the pipeline's ``save_lora_weights`` takes the denoiser's LoRA layers under
    lora_layers_argument: str = "transformer_lora_layers"
    #: pixel multiple a training image must have (VAE downscale x transformer patch size)
    resolution_multiple: int = 16
    #: video families: pixel frames per latent frame (a clip is ``k * temporal_compression + 1`` frames); None for
    #: image families. Latents are then (B, C, F, h, w) and pixels (B, 3, frames, H, W); images are 1-frame clips.
    temporal_compression: int | None = None
    #: video families: frames per second the model was trained at (validation videos' rate unless ``framerate``)
    default_fps: float = 16.0
    #: video families: frames of a validation video unless ``validation_num_video_frames`` says otherwise
    default_validation_frames: int = 9

    def __init__(self, config, *, device: torch.device | str = "cpu", weight_dtype: torch.dtype = torch.float32,
                 references: bool | None = None):
        """``references``: the run trains on (reference, target) pairs (its image datasets have ``conditioning_data``
        reference images); None means "if the flavour is an edit flavour"."""
        self.config = config
        self.device = torch.device(device)
        self.weight_dtype = weight_dtype
        if references is None:
            from simpletuner.config.families import get_family

            references = config.model_flavour in get_family(self.family).reference_flavours
        if references and self.edit_pipeline_class is None:
            raise ValueError(f"conditioning_data: model_family {self.family!r} does not take reference images")
        self.references = bool(references)
        self.vae = None
        self.text_encoders: list[torch.nn.Module] = []
        self.tokenizers: list[Any] = []
        # how many encoder forwards ran in this process (a warm cache must keep these at zero)
        self.vae_forwards = 0
        self.text_encoder_forwards = 0
        self._offload_hooks: list[Any] = []  # enable_model_cpu_offload: accelerate hooks of the encoders
        self._cached_identities: tuple[str, str] | None = None  # (vae, text) in split training's stage 2

    # ---- where the weights live -------------------------------------------------------------------------
    def model_path(self) -> str:
        """The folder or hub id holding the pipeline layout (model_index.json, transformer/, vae/, ...)."""
        if self.is_tiny:
            return str(self.ensure_tiny_checkpoint())
        if self.config.pretrained_model_name_or_path:
            return self.config.pretrained_model_name_or_path
        raise ValueError("pretrained_model_name_or_path: not set and the flavour gives no default")

    @property
    def is_tiny(self) -> bool:
        """A ``tiny`` flavour (``tiny``, or ``tiny-<variant>`` where a family has several architectures)."""
        return (self.config.model_flavour or "").split("-")[0] == "tiny"

    def ensure_tiny_checkpoint(self) -> Path:
        """The tiny flavour's folder, written (once, atomically) by ``write_tiny``."""
        return tiny.ensure_checkpoint(self.tiny_checkpoint_name(), self.write_tiny)

    def tiny_checkpoint_name(self) -> str:
        """The tiny checkpoint's folder name (a family with several tiny flavours names one per architecture)."""
        return self.family

    def write_tiny(self, folder: Path) -> None:
        """Write this flavour's tiny checkpoint (``write_tiny_checkpoint`` unless the family has several)."""
        type(self).write_tiny_checkpoint(folder)

    @staticmethod
    @abstractmethod
    def write_tiny_checkpoint(folder: Path) -> None:
        """Write a small random-initialised model in the real diffusers layout (model_index.json and one folder
        per component, as ``pipeline.save_pretrained`` writes it) into ``folder``; deterministic, on a forked RNG
        (``torch.random.fork_rng``) so writing it mid-run never shifts the run's random draws."""

    def component_identity(self, component: str) -> str:
        """A stable string naming the weights of ``component`` (a cache fingerprint ingredient)."""
        path, revision = self.component_source(component)
        folder = Path(path) / component
        digest = ""
        for name in ("config.json", "tokenizer_config.json"):
            cfg = folder / name
            if cfg.is_file():
                digest += hashlib.sha256(cfg.read_bytes()).hexdigest()[:16]
        return json.dumps([self.family, path, component, revision or "", digest])

    def component_source(self, component: str) -> tuple[str, str | None]:
        """(path or hub id, revision) holding the ``component`` subfolder: the model itself, unless the family keeps
        a component in another repository (HiDream's Llama text encoder)."""
        return self.model_path(), getattr(self.config, "revision", None)

    # ---- where each piece comes from, checked before the run -------------------------------------------------
    def _base_field(self) -> str:
        return "model_flavour" if self.config.model_flavour == "tiny" else "pretrained_model_name_or_path"

    def denoiser_weights(self) -> WeightSource:
        path, subfolder = self.denoiser_source()
        field = ("pretrained_transformer_model_name_or_path" if self.config.pretrained_transformer_model_name_or_path
                 else self._base_field())
        folder = subfolder if subfolder not in ("", "none", None) else None
        return WeightSource(field, str(path), folder, what=self.denoiser_subfolder, revision=self.config.revision,
                            subfolder_field="pretrained_transformer_subfolder")

    def _vae_weights(self) -> WeightSource:
        path, subfolder = self.vae_source()
        field = "pretrained_vae_model_name_or_path" if self.config.pretrained_vae_model_name_or_path \
            else self._base_field()
        return WeightSource(field, str(path), subfolder, what="VAE")

    def _text_weights(self) -> list[WeightSource]:
        """(encoder, tokenizer) sources per text encoder, in ``text_encoder_specs`` order."""
        field = self._base_field()
        out = []
        for n, (enc_dir, _, tok_dir, _) in enumerate(self.text_encoder_specs, start=1):
            path, revision = self.component_source(enc_dir)
            out.append(WeightSource(field, path, enc_dir, what=f"text encoder {n}", revision=revision))
            path, revision = self.component_source(tok_dir)
            out.append(WeightSource(field, path, tok_dir, need=(), weights=False, what=f"tokenizer {n}",
                                    revision=revision))
        return out

    def _scheduler_weights(self) -> WeightSource:
        return WeightSource(self._base_field(), self.model_path(), "scheduler", need=("scheduler_config.json",),
                            weights=False, what="scheduler config", revision=self.config.revision)

    def weight_sources(self) -> list[WeightSource]:
        """Everything this run loads: the denoiser, the VAE, the text encoders and tokenizers, the scheduler config,
        the pipeline's ``model_index.json`` and, with ``validation_preview``, the preview decoder. Split training's
        stage 2 (``train_from_cache``) loads no encoder: its VAE, needed only to decode validation images, is
        checked when validation starts (see ``vae_weights``)."""
        base = self.model_path()
        encoders = [] if self.cache_only else [self._vae_weights(), *self._text_weights()]
        sources = [self.denoiser_weights(), *encoders, self._scheduler_weights(),
                   WeightSource(self._base_field(), base, None, need=("model_index.json",), weights=False,
                                what="pipeline layout", revision=self.config.revision)]
        if getattr(self.config, "validation_preview", False):
            preview = self.preview_decoder_source()
            if preview is not None:
                sources.append(WeightSource("validation_preview", preview[0], preview[1], what="preview decoder",
                                            alternative="turn previews off (validation_preview: false)"))
        return sources

    def encoder_weight_sources(self) -> list[WeightSource]:
        """What split training's stage 1 (``simpletuner cache``) loads: the VAE, and the text encoders and
        tokenizers; never the denoiser."""
        return [self._vae_weights(), *self._text_weights()]

    def vae_weights(self) -> WeightSource:
        """The VAE's source (stage 2 checks it before its first validation image)."""
        return self._vae_weights()

    def check_weights(self, extra: list[WeightSource] | tuple = (), *, encoders_only: bool = False) -> None:
        """Before anything is cached or written: refuse a generated flavour (``tiny``) combined with paths to other
        weights, then prove every source of ``weight_sources`` (or, with ``encoders_only``, of
        ``encoder_weight_sources``) and ``extra`` can be loaded (see :mod:`simpletuner.models.weights`). Raises
        WeightLoadError naming the field, the id or path and the fix."""
        from simpletuner.config.train import flavour_path_errors

        contradictions = flavour_path_errors(self.config)
        if contradictions:
            raise WeightLoadError("\n".join(str(e) for e in contradictions))
        sources = self.encoder_weight_sources() if encoders_only else self.weight_sources()
        check_weight_sources([*sources, *extra])

    # ---- split training --------------------------------------------------------------------------------
    def trainable_preprocessing(self) -> list[str]:
        """The parts of this run's preprocessing (text encoders, frozen conditioning encoders) that receive
        gradients, each as "<part> (<the setting that trains it>)": their outputs change as training runs, so they
        cannot be cached ahead of it. Empty for every family here (text encoder training is refused by the config);
        a family that trains one lists it."""
        return []

    @property
    def cache_only(self) -> bool:
        """Split training's stage 2 (``train_from_cache``): everything encoded comes from the cache; no text encoder
        loads, and the VAE loads only to decode validation images."""
        return bool(getattr(self.config, "train_from_cache", False))

    def use_cached_identities(self, vae_identity: str, text_identity: str, vae_scale_factor: int) -> None:
        """Stage 2: the cache keys are the ones stage 1 wrote under, and the VAE's downscale the one it read (both
        from its manifest, once the manifest was checked against this config), so neither needs the encoders'
        files."""
        self._cached_identities = (vae_identity, text_identity)
        self.__dict__["vae_scale_factor"] = int(vae_scale_factor)  # the cached_property, without the VAE's config

    # ---- loading ---------------------------------------------------------------------------------------
    def denoiser_source(self) -> tuple[str, str | None]:
        """(path, subfolder) of the denoiser: ``pretrained_transformer_model_name_or_path`` when set (a folder, a
        hub id or a single ``.safetensors`` file), else the model itself; ``pretrained_transformer_subfolder``
        defaults to the family's own subfolder, as in SimpleTuner ('none' means the path itself)."""
        path = self.config.pretrained_transformer_model_name_or_path or self.model_path()
        return path, self.config.pretrained_transformer_subfolder or self.denoiser_subfolder

    def load_transformer(self) -> torch.nn.Module:
        """The denoiser (transformer or UNet) in ``weight_dtype``, on the CPU."""
        path, subfolder = self.denoiser_source()
        with explained(self.denoiser_weights()):
            if str(path).endswith((".safetensors", ".sft")):
                return self.denoiser_class.from_single_file(path, torch_dtype=self.weight_dtype)
            return self.denoiser_class.from_pretrained(
                path, subfolder=subfolder if subfolder not in ("", "none", None) else None,
                torch_dtype=self.weight_dtype, revision=self.config.revision, variant=self.config.variant,
            )

    def vae_source(self) -> tuple[str, str | None]:
        """(path, subfolder) of the VAE: ``pretrained_vae_model_name_or_path`` (a VAE folder or a model with a
        ``vae/`` subfolder) or the model's own ``vae/``."""
        path = self.config.pretrained_vae_model_name_or_path
        if not path:
            return self.model_path(), "vae"
        subfolder = "vae" if (not Path(path).exists() or (Path(path) / "vae").is_dir()) else None
        return path, subfolder

    def load_vae(self) -> torch.nn.Module:
        """Load ``self.vae`` (frozen, eval, float32, on ``self.device``) from ``vae_source``."""
        if self.vae_class is None:
            from diffusers import AutoencoderKL

            vae_class = AutoencoderKL
        else:
            vae_class = self.vae_class
        path, subfolder = self.vae_source()
        with explained(self._vae_weights()):
            self.vae = vae_class.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32)
        if getattr(self.config, "vae_enable_tiling", False):
            self.vae.enable_tiling()  # overlapping tiles: large images encode and decode in bounded memory
        if self.cache_only:
            self.vae.encode = _refuse_encode  # stage 2 decodes validation images only; every latent is cached
        self.vae.requires_grad_(False).eval()
        self._place(self.vae)
        return self.vae

    def _place(self, module: torch.nn.Module) -> None:
        """Put a frozen encoder on the device, or (``enable_model_cpu_offload``) keep it on the CPU with a hook that
        moves it to the device for its forward; ``offload_idle`` sends it back."""
        if getattr(self.config, "enable_model_cpu_offload", False) and self.device.type != "cpu":
            from accelerate import cpu_offload_with_hook

            module.to("cpu")
            _, hook = cpu_offload_with_hook(module, execution_device=self.device)
            self._offload_hooks.append(hook)
        else:
            module.to(self.device)

    def offload_idle(self) -> None:
        """``enable_model_cpu_offload``: move the encoders that ran back to the CPU (no-op otherwise)."""
        for hook in self._offload_hooks:
            hook.offload()

    def load_text_encoders(self) -> None:
        """Load ``self.text_encoders`` and ``self.tokenizers`` from ``text_encoder_specs`` (frozen, eval, on
        ``self.device``) and apply ``text_encoder_<n>_precision``."""
        if self.cache_only:
            raise EncoderNotLoaded(
                "train_from_cache: the text encoders are never loaded in split training's stage 2, and a prompt "
                "this run needs is not in the cache; add it to the config and run `simpletuner cache` again")
        sources = self._text_weights()
        self.tokenizers, self.text_encoders = [], []
        for n, (enc_dir, enc_cls, tok_dir, tok_cls) in enumerate(self.text_encoder_specs):
            tok_path, tok_revision = self.component_source(tok_dir)
            with explained(sources[2 * n + 1]):
                self.tokenizers.append(tok_cls.from_pretrained(tok_path, subfolder=tok_dir, revision=tok_revision))
            enc_path, enc_revision = self.component_source(enc_dir)
            with explained(sources[2 * n]):
                self.text_encoders.append(enc_cls.from_pretrained(enc_path, subfolder=enc_dir, revision=enc_revision,
                                                                  dtype=self.weight_dtype))
        self.quantize_text_encoders()
        for encoder in self.text_encoders:
            encoder.requires_grad_(False).eval()
            self._place(encoder)

    def quantize_text_encoders(self) -> None:
        """Apply ``text_encoder_<n>_precision`` to the loaded text encoders (frozen, so any quanto type works)."""
        for n, encoder in enumerate(self.text_encoders, start=1):
            precision = getattr(self.config, f"text_encoder_{n}_precision", None) or "no_change"
            if precision != "no_change":
                from simpletuner.models.quantize import quantize_model

                quantize_model(encoder, precision, exclude=[], field=f"text_encoder_{n}_precision")

    def unload_vae(self) -> None:
        """Drop the VAE (``offload_during_startup``: it is not held while the text encoders run); it is loaded
        again on its next use."""
        self.vae = None

    def unload_encoders(self) -> None:
        """Drop the VAE and text encoders (after caching they are not needed for training)."""
        self.vae = None
        self.text_encoders = []
        self.tokenizers = []

    def text_encoder_components(self) -> dict[str, Any]:
        """The loaded text encoders and tokenizers by pipeline component name (loading them on first use)."""
        if not self.text_encoders:
            self.load_text_encoders()
        out = {}
        for (enc_dir, _, tok_dir, _), encoder, tokenizer in zip(self.text_encoder_specs, self.text_encoders,
                                                                self.tokenizers):
            out[enc_dir], out[tok_dir] = encoder, tokenizer
        return out

    @property
    def is_video(self) -> bool:
        return self.temporal_compression is not None

    def validation_num_frames(self) -> int:
        """Frames of a validation video (``validation_num_video_frames``, rounded down to a count the VAE takes)."""
        frames = getattr(self.config, "validation_num_video_frames", None) or self.default_validation_frames
        tc = self.temporal_compression or 1
        return max(1, (int(frames) - 1) // tc * tc + 1)

    def validation_fps(self) -> float:
        return float(getattr(self.config, "framerate", None) or self.default_fps)

    # ---- encoding --------------------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        """Each prompt's encoder outputs exactly as the family's pipeline computes them (loading the text encoders
        on first use, counting ``text_encoder_forwards``), one ``TextEmbedding`` per prompt, float32 on the CPU."""

    def latent_cache_entries(self, pixels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """What the latent cache stores per sample for a batch of pixels: ``{"latents": ...}``, plus whatever a
        family conditions on that comes from the same pixels (Wan I2V: the first frame's latents and CLIP image
        embedding). Every key but ``latents`` reaches ``predict`` inside its ``text`` dict."""
        return [{"latents": latent} for latent in self.encode_images(pixels)]

    # ---- reference images (edit flavours) ---------------------------------------------------------------------
    @property
    def prompt_takes_reference(self) -> bool:
        """Whether a prompt's embedding depends on the reference image it edits (Qwen-Image-Edit's text encoder sees
        the image): then embeddings are encoded and cached per (prompt, reference image)."""
        return False

    def encode_text(self, prompts: list[str], references: list[torch.Tensor] | None = None, *,
                    negative: bool = False) -> list[TextEmbedding]:
        """The embeddings the text cache keeps: ``encode_prompts`` (``encode_negative_prompts`` with ``negative``),
        or, where ``prompt_takes_reference``, each prompt encoded with its reference image (``references``: one
        (3, H, W) pixel tensor in [-1, 1] per prompt, prepared as its training or validation image was)."""
        if self.prompt_takes_reference:
            if references is None or len(references) != len(prompts):
                raise ValueError(f"model_flavour {self.config.model_flavour!r} encodes each prompt with the reference "
                                 "image it edits; give one reference per prompt")
            return self.encode_prompts_with_references(prompts, references, negative=negative)
        return self.encode_negative_prompts(prompts) if negative else self.encode_prompts(prompts)

    def encode_prompts_with_references(self, prompts: list[str], references: list[torch.Tensor], *,
                                       negative: bool = False) -> list[TextEmbedding]:
        """``prompt_takes_reference`` families: each prompt encoded with its reference image, as the edit pipeline
        encodes them."""
        raise NotImplementedError(f"{type(self).__name__} does not encode prompts with reference images")

    def encode_references(self, pixels: torch.Tensor) -> torch.Tensor:
        """Reference images, pixels (B, 3, H, W) in [-1, 1] prepared exactly as their targets were, -> the
        ``reference_latents`` ``predict`` takes, as the edit pipeline encodes its ``image``: ``encode_images``
        unless the pipeline resizes its references itself."""
        return self.encode_images(pixels)

    def reference_cache_identity(self) -> str:
        """``vae_cache_identity`` for reference latents (it differs where ``encode_references`` resizes)."""
        return self.vae_cache_identity()

    def load_pipeline(self, path: str | Path | None = None):
        """The run's pipeline loaded from a model folder (the model's own by default) with its ``from_pretrained``,
        as its users load it; a family passes what the folder names but cannot be loaded on this machine."""
        return self.run_pipeline_class.from_pretrained(str(path or self.model_path()))

    def encode_negative_prompts(self, prompts: list[str]) -> list[TextEmbedding]:
        """Negative prompts (validation CFG) as the pipeline encodes its negative prompt; the same as
        ``encode_prompts`` unless the pipeline treats them differently (Sana drops its complex human instruction,
        Lumina 2 its system prompt)."""
        return self.encode_prompts(prompts)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], (B, 3, H, W) -> normalised latents (B, C, h, w) as the denoiser trains on (the VAE
        loaded on first use): the posterior mean, ``(z - shift_factor) * scaling_factor``, float32 on the CPU.
        Video families take (B, 3, frames, H, W) and return (B, C, F, h, w)."""
        if self.vae is None:
            self.load_vae()
        cfg = self.vae.config
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mean
        self.vae_forwards += 1
        self.offload_idle()
        return ((latents - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor).float().cpu()

    @cached_property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along each side (read from the VAE's config.json, without loading the VAE)."""
        if self.vae is not None:
            cfg = dict(self.vae.config)
        else:
            from diffusers import AutoencoderKL

            path = self.config.pretrained_vae_model_name_or_path or self.model_path()
            subfolder = "vae" if (not Path(path).exists() or (Path(path) / "vae").is_dir()) else None
            cfg = AutoencoderKL.load_config(path, subfolder=subfolder, revision=getattr(self.config, "revision", None))
        return 2 ** (len(cfg["block_out_channels"]) - 1)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``encode_images``: latents -> pixels in about [-1, 1]."""
        if self.vae is None:
            self.load_vae()
        cfg = self.vae.config
        latents = latents.to(self.device, self.vae.dtype) / cfg.scaling_factor + (getattr(cfg, "shift_factor", None)
                                                                                 or 0.0)
        return self.vae.decode(latents).sample

    def text_cache_identity(self) -> str:
        """A string that changes whenever a prompt would encode differently (encoders, tokenizers, lengths,
        precisions, dtype): part of every text-cache key. In stage 2, the identity stage 1 cached under."""
        if self._cached_identities is not None:
            return self._cached_identities[1]
        return "|".join(self.text_identity_parts())

    def text_identity_parts(self) -> list[str]:
        """``text_cache_identity`` part by part: each encoder and tokenizer folder's ``component_identity``, the
        family's extras, the precisions and the dtype (a split run's manifest compares them one by one)."""
        folders = [spec[0] for spec in self.text_encoder_specs] + [spec[2] for spec in self.text_encoder_specs]
        precisions = [getattr(self.config, f"text_encoder_{n}_precision", None) or "no_change"
                      for n in range(1, len(self.text_encoder_specs) + 1)]
        parts = [self.component_identity(f) for f in folders] + self.text_identity_extras()
        return parts + [f"precision={precisions}", str(self.weight_dtype)]

    def text_identity_extras(self) -> list[str]:
        """Family settings that change an embedding besides the weights (e.g. a sequence length)."""
        return []

    def vae_cache_identity(self) -> str:
        """Like ``text_cache_identity`` for latents (tiled encoding can change them, so it is part of it)."""
        if self._cached_identities is not None:
            return self._cached_identities[0]
        return "|".join(self.vae_identity_parts())

    def vae_identity_parts(self) -> list[str]:
        """``vae_cache_identity`` part by part."""
        return [self.component_identity("vae")] + (["tiled"] if getattr(self.config, "vae_enable_tiling", False)
                                                    else [])

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
        with explained(self._scheduler_weights()):
            return dict(DDPMScheduler.load_config(self.model_path(), subfolder="scheduler",
                                                  revision=getattr(self.config, "revision", None)))

    def sample_conditioning(self, samples) -> dict[str, torch.Tensor]:
        """Per-sample conditioning the family derives from how each training image was prepared (its
        ``simpletuner.data.discovery.Sample``: original size, bucket, crop), batched; merged into ``predict``'s
        conditioning beside the text embeddings. SDXL's micro-conditioning lives here; most families have none."""
        return {}

    @abstractmethod
    def predict(self, transformer, noisy_latents: torch.Tensor, t: torch.Tensor,
                text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The denoiser's prediction in the latent layout of ``noisy_latents`` ((B, C, h, w), or (B, C, F, h, w) for
        video), for timesteps ``t`` in the objective's units and a batch of cached conditioning: the text embeddings,
        plus the extra keys of ``latent_cache_entries`` and, in a run with references, ``reference_latents``
        (B, C, h', w'), the encoded reference images. Exactly what the pipeline hands its scheduler's ``step`` for
        the same inputs (with classifier-free guidance off)."""

    def image_token_mask(self, mask: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """A latent-resolution loss mask (B, 1, h, w) -> (B, N) bool over the image tokens a TREAD router sees
        (True where the mask is non-zero): the tokens a route must keep. Families with a TREAD layout implement
        it."""
        raise ValueError(f"tread_config: model_family {self.family!r} cannot route with a loss mask")

    @abstractmethod
    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """How many image tokens the transformer sees for latents of this shape ((B, C, h, w), or (B, C, F, h, w)
        for video); the resolution-dependent shift reads it."""

    def lora_target_modules(self, transformer, preset: str) -> list[str]:
        """PEFT target module names for the family's ``lora_target`` preset (declared in the family table): its
        ``lora_presets`` entry unless the family overrides this."""
        presets = self.lora_presets or {}
        if preset not in presets:
            raise ValueError(f"lora_target: {preset!r} is not one of {', '.join(presets)}")
        return list(presets[preset])

    #: lycoris_config.apply_preset used when the config names none (a key of lycoris_presets() or a lycoris preset)
    default_lycoris_preset: str = "full"

    def lycoris_presets(self) -> dict[str, dict]:
        """Named LyCORIS presets for this family's module classes (lycoris' ``apply_preset`` format)."""
        return {}

    def lycoris_module_aliases(self) -> dict[str, str]:
        """Generic module class names in SimpleTuner's LyCORIS examples -> this family's class names."""
        return {}

    def transformer_depth(self) -> int:
        """How many blocks a TREAD route can index (read from config, without loading weights)."""
        raise ValueError(f"tread_config: model_family {self.family!r} does not support TREAD routing")

    @classmethod
    def fsdp_block_classes(cls) -> list[str]:
        """Class names of the blocks FSDP shards one by one (``fsdp_transformer_layer_cls_to_wrap`` when the config
        names none): the denoiser's ``_no_split_modules``, where diffusers lists its transformer blocks. A family
        whose denoiser lists none names its blocks here."""
        return list(getattr(cls.denoiser_class, "_no_split_modules", None) or [])

    @abstractmethod
    def tread_layout(self, transformer) -> TreadLayout | None:
        """Where TREAD hooks in this family's blocks (and then ``transformer_depth`` counts them), or None when its
        token path does not allow routing (say why in the family's docstring)."""

    @property
    def run_pipeline_class(self):
        """The pipeline this run validates with: the edit pipeline when it trains on reference images."""
        return self.edit_pipeline_class if self.references else self.pipeline_class

    def save_lora(self, lora_state_dict: dict[str, torch.Tensor], output_dir: str | Path) -> Path:
        """Write a LoRA the family's diffusers pipeline loads with ``load_lora`` (its ``load_lora_weights``)."""
        self.run_pipeline_class.save_lora_weights(
            str(output_dir), **{self.lora_layers_argument: lora_state_dict}, safe_serialization=True
        )
        return Path(output_dir) / "pytorch_lora_weights.safetensors"

    def load_lora(self, pipeline, path: str | Path) -> None:
        """Load a LoRA written by ``save_lora`` into ``pipeline`` the way its users do."""
        pipeline.load_lora_weights(str(path))

    # ---- pipelines ---------------------------------------------------------------------------------------
    def _pipeline(self, transformer, text_components: dict[str, Any]):
        if self.vae is None:
            self.load_vae()
        with explained(WeightSource(self._base_field(), self.model_path(), None, need=("model_index.json",),
                                    weights=False, what="pipeline layout")):
            return self.run_pipeline_class.from_pretrained(
                self.model_path(), revision=self.config.revision,
                **{self.denoiser_subfolder: transformer, "vae": self.vae}, **text_components,
            )

    def build_pipeline(self, transformer):
        """The family's whole diffusers pipeline around ``transformer`` (no copy of its weights), with the text
        encoders and VAE this adapter loaded; other components (the scheduler) come from the model folder."""
        return self._pipeline(transformer, self.text_encoder_components())

    def build_validation_pipeline(self, transformer):
        """The pipeline around the training transformer that takes cached prompt embeddings (no text encoders)."""
        names = [spec[0] for spec in self.text_encoder_specs] + [spec[2] for spec in self.text_encoder_specs]
        return self._pipeline(transformer, dict.fromkeys(names))

    @abstractmethod
    def validation_pipeline_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None,
                                   *, guidance: float, guidance_real: float) -> dict:
        """Pipeline keyword arguments for one image from batched cached embeddings: ``guidance`` is the family's
        guidance scale, ``guidance_real`` > 1 with a ``negative`` embedding turns on true CFG where the family
        distinguishes the two. Non-tensor arguments (lengths, guidance) must also be right for a call with
        ``prompt=`` instead of the embeddings. In a run with references, ``text`` carries ``reference_latents``
        and the arguments hand them to the edit pipeline."""

    def reference_pipeline_kwargs(self, image) -> dict:
        """Edit-pipeline keyword arguments that hand it a reference ``image`` (PIL, already the output's size) the way
        its users call it, so it prepares and encodes the image itself exactly as training's references were."""
        raise ValueError(f"model_family {self.family!r} has no edit pipeline")

    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        """Whether validation at these guidance scales needs the negative prompt's embedding: true classifier-free
        guidance (``guidance_real`` > 1) by default; families whose ``guidance`` is classifier-free say so."""
        return guidance_real > 1

    def uses_negative_prompt(self, guidance: float, guidance_real: float) -> bool:
        """Whether validation at these scales runs classifier-free guidance against the negative prompt, so its
        embedding is cached and handed to ``validation_pipeline_kwargs``. The default is Flux's: only true CFG
        (``guidance_real`` > 1); a family whose pipeline runs CFG at ``guidance_scale`` > 1 says so here."""
        return guidance_real > 1

    def preview_callback_kwargs(self, on_latents) -> dict:
        """Pipeline keyword arguments that call ``on_latents(step_index, latents)`` after each denoising step with
        the pipeline's latents (diffusers' ``callback_on_step_end``; a pipeline with the older ``callback`` API
        overrides this)."""

        def callback(pipe, index, timestep, callback_kwargs):
            on_latents(index, callback_kwargs["latents"])
            return {}

        return {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents"]}
    def validation_attention_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None,
                                    width: int, height: int) -> dict:
        """Extra pipeline arguments that depend on the image size (e.g. an attention mask over text + image
        tokens); none by default."""
        return {}

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents in the training layout ((B, C, h, w) or (B, C, F, h, w)) -> the pipeline's ``latents=`` argument
        (and the layout of what it hands its scheduler)."""
        return latents

    def pipeline_call_kwargs(self, *, height: int, width: int, num_frames: int | None = None) -> dict:
        """Size arguments of one pipeline call: ``height``/``width``, and ``num_frames`` for a video family."""
        kwargs = {"height": height, "width": width}
        if self.is_video:
            kwargs["num_frames"] = num_frames or self.validation_num_frames()
        return kwargs

    def validation_conditioning(self, text: dict[str, torch.Tensor], height: int, width: int) -> dict:
        """Extra pipeline arguments a validation call needs besides the prompt (Wan I2V: the first frame)."""
        return {}

    def scheduler_input(self, prediction: torch.Tensor, noisy_latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the pipeline hands its scheduler's ``step`` when the denoiser predicts ``prediction`` (``predict``'s
        output) for ``noisy_latents`` at ``t``: the prediction in the pipeline's layout, unless the pipeline
        preconditions its model (Cosmos hands an EDM noise estimate built from the input and the velocity)."""
        return self.pipeline_latents(prediction)

    def preview_decoder_source(self) -> tuple[str, str | None] | None:
        """(path or hub id, subfolder) of the Tiny AutoEncoder that decodes live previews, or None if the family
        has none (``validation_preview`` is then refused before training starts)."""
        return None

    def load_preview_decoder(self):
        from diffusers import AutoencoderTiny

        source = self.preview_decoder_source()
        if source is None and self.is_video:  # no tiny video autoencoder in diffusers: the VAE decodes the poster frame
            return self.vae if self.vae is not None else self.load_vae()
        if source is None:
            raise ValueError(f"validation_preview: model_family {self.family!r} has no tiny autoencoder for previews")
        path, subfolder = source
        with explained(WeightSource("validation_preview", path, subfolder, what="preview decoder")):
            decoder = AutoencoderTiny.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32)
        return decoder.requires_grad_(False).eval().to(self.device)

    def preview_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's latents mid-denoise -> (B, C, h, w) in the VAE's raw latent space (what the preview
        decoder decodes)."""
        cfg = self.vae.config
        return latents / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
