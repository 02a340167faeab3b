"""The model-family table: the one place that names every family, its flavours, its adapter and its options.

Everything that offers or checks a family reads this table: the config schema (``model_family``, ``model_flavour``,
``lora_target``, ``guidance_value``, ``prediction_type``, ``text_encoder_N_precision``), the wizard, the server's
``/api/system/model-families`` and the web UI. The models layer reads ``adapter`` to import a family's module only
when that family is used, so this file imports nothing but the standard library.

Adding a family: one file ``simpletuner/models/<name>.py`` with the adapter, one row here (see
docs/adding-a-family.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import ConfigError, FieldError

OBJECTIVES = ("flow_matching", "epsilon", "v_prediction")


@dataclass(frozen=True)
class ModelFamily:
    """What the rest of the program knows about one model family without importing its code.

    ``flavours`` maps a flavour name to its default weights (a Hugging Face repo id or a local folder), or None for
    ``tiny``, a random-initialised checkpoint the adapter writes locally.
    """

    name: str
    description: str
    # "module:Class" of the family's ModelAdapter; imported by simpletuner.models.registry on use only
    adapter: str
    flavours: Mapping[str, str | None]
    default_flavour: str
    # LoRA target presets (``lora_target``) the adapter knows, and the one used when the config names none
    lora_targets: tuple[str, ...]
    default_lora_target: str
    # training objectives the family's transformer can be trained with; the first is the default
    objectives: tuple[str, ...] = ("flow_matching",)
    # the transformer takes a distilled-guidance embedding (Flux dev); ``guidance_value`` feeds it during training
    guidance_embeds: bool = False
    default_guidance_value: float = 1.0
    # how many text encoders it has (text_encoder_N_precision beyond these is refused)
    num_text_encoders: int = 1
    # "image" or "video": what its datasets hold and what validation writes (images train as 1-frame videos)
    modality: str = "image"
    # pixel multiple a training image's bucket has (VAE downscale x patch size); the adapter uses the same
    resolution_multiple: int = 16
    # the longest prompt (in tokens) its main text encoder takes; ``tokenizer_max_length`` is checked against it
    max_text_length: int | None = None
    # its transformer can mask padded text tokens in attention (``attention_masked_training``)
    text_attention_mask: bool = False
    # per flavour, settings it trains with unless the config says otherwise (e.g. schnell's fast schedule)
    flavour_defaults: Mapping[str, Mapping[str, object]] = field(default_factory=lambda: MappingProxyType({}))
    # learning-rate multipliers for trainable parameters whose names match an fnmatch pattern (first match wins);
    # the optimizer gets one parameter group per multiplier
    lr_scale: tuple[tuple[str, float], ...] = ()
    # flavours that edit a reference image: their image datasets need ``conditioning_data`` (reference images),
    # packed in as the flavour's pipeline does; the family's ``tiny`` flavour takes references when they are paired
    reference_flavours: tuple[str, ...] = ()

    def __post_init__(self):
        if self.default_flavour not in self.flavours:
            raise ValueError(f"{self.name}: default_flavour {self.default_flavour!r} is not one of its flavours")
        if self.default_lora_target not in self.lora_targets:
            raise ValueError(f"{self.name}: default_lora_target {self.default_lora_target!r} is not a preset")
        unknown = set(self.objectives) - set(OBJECTIVES)
        if not self.objectives or unknown:
            raise ValueError(f"{self.name}: objectives must be some of {', '.join(OBJECTIVES)}")
        if self.modality not in ("image", "video"):
            raise ValueError(f"{self.name}: modality must be 'image' or 'video'")
        for flavour, defaults in self.flavour_defaults.items():
            if flavour not in self.flavours:
                raise ValueError(f"{self.name}: flavour_defaults names {flavour!r}, which is not one of its flavours")
            if "attention_masked_training" in defaults and not self.text_attention_mask:
                raise ValueError(f"{self.name}: flavour {flavour!r} defaults to attention masking it lacks")
        if ":" not in self.adapter:
            raise ValueError(f"{self.name}: adapter must be 'module:Class', got {self.adapter!r}")
        for flavour in self.reference_flavours:
            if flavour not in self.flavours:
                raise ValueError(f"{self.name}: reference_flavours names {flavour!r}, which is not one of its flavours")

    def default_weights(self, flavour: str | None) -> str | None:
        """Default ``pretrained_model_name_or_path`` for ``flavour`` (the family default when None)."""
        return self.flavours[flavour or self.default_flavour]

    @property
    def default_objective(self) -> str:
        return self.objectives[0]

    def takes_references(self, flavour: str | None) -> bool:
        """Whether ``flavour`` can be trained on (reference, target) pairs: an edit flavour, or ``tiny`` of a
        family that has one (the tiny model stands in for every flavour of its family)."""
        return bool(self.reference_flavours) and (flavour in self.reference_flavours or flavour == "tiny")


FLUX = ModelFamily(
    name="flux",
    description="Black Forest Labs FLUX.1 (12B MMDiT, flow matching, CLIP-L + T5-XXL text encoders)",
    adapter="simpletuner.models.flux:FluxAdapter",
    flavours=MappingProxyType(
        {
            "dev": "black-forest-labs/FLUX.1-dev",
            "krea": "black-forest-labs/FLUX.1-Krea-dev",
            "schnell": "black-forest-labs/FLUX.1-schnell",
            "kontext": "black-forest-labs/FLUX.1-Kontext-dev",
            "fluxbooru": "terminusresearch/FluxBooru-v0.3",
            "libreflux": "jimmycarter/LibreFlux-SimpleTuner",
            "tiny": None,
        }
    ),
    # SimpleTuner's default since FLUX.1-Krea-dev was released
    default_flavour="krea",
    lora_targets=("all", "mmdit", "context", "context+ffs", "all+ffs", "tiny", "nano"),
    default_lora_target="all",
    guidance_embeds=True,
    num_text_encoders=2,
    max_text_length=512,
    text_attention_mask=True,
    flavour_defaults=MappingProxyType(
        {
            # schnell is timestep-distilled: it trains on its few-step schedule (SimpleTuner's flux_fast_schedule)
            "schnell": MappingProxyType({"flow_fast_schedule": True}),
            # LibreFlux was de-distilled with padded T5 tokens masked out of attention
            "libreflux": MappingProxyType({"attention_masked_training": True}),
        }
    ),
    reference_flavours=("kontext",),
)

WAN = ModelFamily(
    name="wan",
    description="Wan 2.1 / 2.2 video DiT (T2V 1.3B/14B, I2V 14B, 2.2 A14B two-expert; flow matching, UMT5 text)",
    adapter="simpletuner.models.wan:WanAdapter",
    flavours=MappingProxyType(
        {
            "t2v-480p-1.3b-2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            "t2v-480p-14b-2.1": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
            "i2v-14b-2.1": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            "i2v-14b-2.1-720p": "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
            "t2v-14b-2.2-high": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "t2v-14b-2.2-low": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "i2v-14b-2.2-high": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
            "i2v-14b-2.2-low": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
            "tiny": None,
            "tiny-i2v": None,
            "tiny-2.2-high": None,
            "tiny-2.2-low": None,
        }
    ),
    default_flavour="t2v-480p-1.3b-2.1",
    lora_targets=("all", "self-attention", "all+ffs"),
    default_lora_target="all",
    modality="video",
)

LTXVIDEO = ModelFamily(
    name="ltxvideo",
    description="Lightricks LTX-Video 0.9.x (2B video DiT, flow matching, 32x/8x VAE, T5-XXL text)",
    adapter="simpletuner.models.ltxvideo:LTXVideoAdapter",
    flavours=MappingProxyType(
        {
            "0.9.5": "Lightricks/LTX-Video-0.9.5",
            "0.9.1": "Lightricks/LTX-Video-0.9.1",
            "0.9.0": "Lightricks/LTX-Video",
            "tiny": None,
        }
    ),
    default_flavour="0.9.5",
    lora_targets=("all", "all+ffs"),
    default_lora_target="all",
    modality="video",
    resolution_multiple=32,
)

LTXVIDEO2 = ModelFamily(
    name="ltxvideo2",
    description="Lightricks LTX-2 (19B audio+video DiT, flow matching, 32x/8x video VAE + audio VAE, Gemma 3 12B text)",
    adapter="simpletuner.models.ltxvideo2:LTX2Adapter",
    flavours=MappingProxyType({"2.0": "Lightricks/LTX-2", "tiny": None}),
    default_flavour="2.0",
    lora_targets=("video", "all", "all+ffs"),
    default_lora_target="video",
    max_text_length=1024,
    modality="video",
    resolution_multiple=32,
)

HUNYUANVIDEO = ModelFamily(
    name="hunyuanvideo",
    description="Tencent HunyuanVideo (13B guidance-distilled video DiT, flow matching, Llama-3 8B + CLIP-L text)",
    adapter="simpletuner.models.hunyuanvideo:HunyuanVideoAdapter",
    flavours=MappingProxyType({"t2v-720p": "hunyuanvideo-community/HunyuanVideo", "tiny": None}),
    default_flavour="t2v-720p",
    lora_targets=("all", "all+ffs"),
    default_lora_target="all",
    guidance_embeds=True,
    num_text_encoders=2,
    max_text_length=256,
    modality="video",
)

SD3 = ModelFamily(
    name="sd3",
    description="Stability AI Stable Diffusion 3 / 3.5 (MMDiT, flow matching, CLIP-L + CLIP-G + T5-XXL text encoders)",
    adapter="simpletuner.models.sd3:SD3Adapter",
    flavours=MappingProxyType(
        {
            "medium": "stabilityai/stable-diffusion-3.5-medium",
            "large": "stabilityai/stable-diffusion-3.5-large",
            "3.0-medium": "stabilityai/stable-diffusion-3-medium-diffusers",
            "tiny": None,
        }
    ),
    default_flavour="medium",
    lora_targets=("attention", "all", "context", "all+ffs"),
    default_lora_target="attention",
    num_text_encoders=3,
)

AURAFLOW = ModelFamily(
    name="auraflow",
    description="fal AuraFlow (6.8B MMDiT + single-stream DiT, flow matching, Pile-T5 text encoder)",
    adapter="simpletuner.models.auraflow:AuraFlowAdapter",
    flavours=MappingProxyType(
        {
            "v0.3": "terminusresearch/auraflow-v0.3",
            "v0.2": "fal/AuraFlow-v0.2",
            "v0.1": "fal/AuraFlow",
            "pony": "purplesmartai/pony-v7-base",
            "tiny": None,
        }
    ),
    default_flavour="v0.3",
    lora_targets=("all", "attention", "context", "all+ffs"),
    default_lora_target="all",
)

PIXART_SIGMA = ModelFamily(
    name="pixart_sigma",
    description="PixArt Sigma (0.6-0.9B DiT, DDPM epsilon with a learned variance, T5-XXL text encoder)",
    adapter="simpletuner.models.pixart_sigma:PixArtSigmaAdapter",
    flavours=MappingProxyType(
        {
            "900M-1024-v0.6": "terminusresearch/pixart-900m-1024-ft-v0.6",
            "600M-512": "PixArt-alpha/PixArt-Sigma-XL-2-512-MS",
            "600M-1024": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
            "600M-2048": "PixArt-alpha/PixArt-Sigma-XL-2-2K-MS",
            "tiny": None,
        }
    ),
    default_flavour="900M-1024-v0.6",
    lora_targets=("attention", "self-attention", "all+ffs"),
    default_lora_target="attention",
    objectives=("epsilon",),
)

SANA = ModelFamily(
    name="sana",
    description="NVIDIA Sana (0.6-4.8B linear-attention DiT on a 32x DC-AE, flow matching, Gemma 2 text encoder)",
    adapter="simpletuner.models.sana:SanaAdapter",
    flavours=MappingProxyType(
        {
            "sana1.5-4.8b-1024": "Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers",
            "sana1.5-1.6b-1024": "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers",
            "sana1.0-1.6b-2048": "Efficient-Large-Model/Sana_1600M_2Kpx_BF16_diffusers",
            "sana1.0-1.6b-1024": "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
            "sana1.0-600m-1024": "Efficient-Large-Model/Sana_600M_1024px_diffusers",
            "sana1.0-600m-512": "Efficient-Large-Model/Sana_600M_512px_diffusers",
            "tiny": None,
        }
    ),
    default_flavour="sana1.5-4.8b-1024",
    lora_targets=("attention", "self-attention", "all+ffs"),
    default_lora_target="attention",
    resolution_multiple=32,
)

LUMINA2 = ModelFamily(
    name="lumina2",
    description="Alpha-VLLM Lumina-Image 2.0 (2.6B unified next-DiT, flow matching, Gemma 2 text encoder)",
    adapter="simpletuner.models.lumina2:Lumina2Adapter",
    flavours=MappingProxyType(
        {
            "2.0": "Alpha-VLLM/Lumina-Image-2.0",
            "neta-lumina": "terminusresearch/neta-lumina-v1",
            "tiny": None,
        }
    ),
    default_flavour="2.0",
    lora_targets=("attention", "joint", "all+ffs"),
    default_lora_target="attention",
)

CHROMA = ModelFamily(
    name="chroma",
    description="lodestones Chroma1 (8.9B pruned Flux.1-schnell MMDiT, flow matching, T5-XXL text encoder, real CFG)",
    adapter="simpletuner.models.chroma:ChromaAdapter",
    flavours=MappingProxyType(
        {
            "base": "lodestones/Chroma1-Base",
            "hd": "lodestones/Chroma1-HD",
            "flash": "lodestones/Chroma1-Flash",
            "tiny": None,
        }
    ),
    default_flavour="base",
    lora_targets=("all", "context", "context+ffs", "all+ffs"),
    default_lora_target="all",
)


QWEN_IMAGE = ModelFamily(
    name="qwen_image",
    description="Qwen-Image (20B MMDiT, flow matching, Qwen2.5-VL-7B text encoder; Qwen-Image-Edit)",
    adapter="simpletuner.models.qwen_image:QwenImageAdapter",
    flavours=MappingProxyType({"v1.0": "Qwen/Qwen-Image", "v2.0": "Qwen/Qwen-Image-2512",
                               "edit-v1": "Qwen/Qwen-Image-Edit", "tiny": None}),
    default_flavour="v1.0",
    lora_targets=("attention", "all", "context", "context+ffs", "all+ffs"),
    default_lora_target="attention",
    reference_flavours=("edit-v1",),
)


HIDREAM = ModelFamily(
    name="hidream",
    description="HiDream-I1 (17B sparse MoE DiT, flow matching, CLIP-L + CLIP-G + T5-XXL + Llama-3.1-8B text encoders)",
    adapter="simpletuner.models.hidream:HiDreamAdapter",
    flavours=MappingProxyType({"full": "HiDream-ai/HiDream-I1-Full", "dev": "HiDream-ai/HiDream-I1-Dev",
                               "fast": "HiDream-ai/HiDream-I1-Fast", "tiny": None}),
    default_flavour="full",
    lora_targets=("attention", "all", "context", "all+ffs"),
    default_lora_target="attention",
    num_text_encoders=4,
)


Z_IMAGE = ModelFamily(
    name="z_image",
    description="Z-Image (6B single-stream DiT, flow matching, Qwen3-4B text encoder)",
    adapter="simpletuner.models.z_image:ZImageAdapter",
    flavours=MappingProxyType({"base": "Tongyi-MAI/Z-Image", "turbo": "Tongyi-MAI/Z-Image-Turbo", "tiny": None}),
    default_flavour="base",
    lora_targets=("attention", "all+ffs"),
    default_lora_target="attention",
)


COSMOS2IMAGE = ModelFamily(
    name="cosmos2image",
    description="NVIDIA Cosmos-Predict2 text-to-image (2B / 14B DiT, EDM trained as weighted flow matching, T5-XXL)",
    adapter="simpletuner.models.cosmos2image:Cosmos2ImageAdapter",
    flavours=MappingProxyType({"2b": "nvidia/Cosmos-Predict2-2B-Text2Image",
                               "14b": "nvidia/Cosmos-Predict2-14B-Text2Image", "tiny": None}),
    default_flavour="2b",
    lora_targets=("attention", "self-attention", "all+ffs"),
    default_lora_target="attention",
)


FLUX2 = ModelFamily(
    name="flux2",
    description="Black Forest Labs FLUX.2 (dev: 32B MMDiT with Mistral-Small-3.1; Klein 4B / 9B with Qwen3; flow matching)",
    adapter="simpletuner.models.flux2:Flux2Adapter",
    flavours=MappingProxyType({"dev": "black-forest-labs/FLUX.2-dev", "klein-4b": "black-forest-labs/FLUX.2-klein-base-4B",
                               "klein-9b": "black-forest-labs/FLUX.2-klein-base-9B", "tiny": None}),
    default_flavour="klein-9b",
    lora_targets=("attention", "all", "context", "all+ffs"),
    default_lora_target="attention",
    guidance_embeds=True,  # dev's distilled guidance; Klein has none and ignores guidance_value
)

# UNet families: LoRA on the attention projections, or on every linear and conv layer of the UNet's blocks
_UNET_LORA_TARGETS = ("attention", "all")

SDXL = ModelFamily(
    name="sdxl",
    description="Stability AI Stable Diffusion XL (2.6B UNet, epsilon or v-prediction, CLIP-L + OpenCLIP-bigG)",
    adapter="simpletuner.models.sdxl:SDXLAdapter",
    flavours=MappingProxyType(
        {
            "base-1.0": "stabilityai/stable-diffusion-xl-base-1.0",
            "base-0.9": "stabilityai/stable-diffusion-xl-base-0.9",
            "noobai-vpred-1.0": "Laxhar/noobai-XL-Vpred-1.0",
            "terminus-xl-velocity-v2": "ptx0/terminus-xl-velocity-v2",
            "tiny": None,
        }
    ),
    default_flavour="base-1.0",
    lora_targets=_UNET_LORA_TARGETS,
    default_lora_target="attention",
    objectives=("epsilon", "v_prediction"),
    num_text_encoders=2,
    # v-prediction fine-tunes of SDXL, trained on a zero-terminal-SNR schedule
    flavour_defaults=MappingProxyType({
        flavour: MappingProxyType({"prediction_type": "v_prediction", "rescale_betas_zero_snr": True})
        for flavour in ("noobai-vpred-1.0", "terminus-xl-velocity-v2")
    }),
    resolution_multiple=32,
)

KOLORS = ModelFamily(
    name="kolors",
    description="Kuaishou Kolors (SDXL-style UNet, epsilon, ChatGLM3-6B text encoder)",
    adapter="simpletuner.models.kolors:KolorsAdapter",
    flavours=MappingProxyType({"1.0": "Kwai-Kolors/Kolors-diffusers", "tiny": None}),
    default_flavour="1.0",
    lora_targets=_UNET_LORA_TARGETS,
    default_lora_target="attention",
    objectives=("epsilon", "v_prediction"),
    num_text_encoders=1,
    resolution_multiple=32,
)

_FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (FLUX, SD3, AURAFLOW, PIXART_SIGMA, SANA, LUMINA2, CHROMA, HIDREAM, QWEN_IMAGE, COSMOS2IMAGE,
                        FLUX2, Z_IMAGE, SDXL, KOLORS, WAN, LTXVIDEO, LTXVIDEO2, HUNYUANVIDEO)
}
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(_FAMILIES)

# SimpleTuner families that this rewrite plans to support; naming one gives "planned", not "unknown".
PLANNED_FAMILIES: tuple[str, ...] = (
    "sd1x",
    "sd2x",
    "omnigen",
)


@contextmanager
def registered(family: ModelFamily) -> Iterator[ModelFamily]:
    """Add ``family`` to the table for the duration (tests and plugins building a family outside this file)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    try:
        yield family
    finally:
        _FAMILIES.pop(family.name, None)


def family_names() -> list[str]:
    """Names of the families that can be trained now, sorted."""
    return sorted(_FAMILIES)


def tiny_flavours(family: ModelFamily) -> list[str]:
    """The family's locally written flavours: ``tiny``, and ``tiny-<variant>`` where it has several architectures."""
    return [f for f, weights in family.flavours.items() if weights is None and f.split("-")[0] == "tiny"]


def all_flavours() -> list[str]:
    """Every flavour name of every family, sorted (the schema's choices; each family checks its own)."""
    return sorted({f for fam in _FAMILIES.values() for f in fam.flavours})


def all_lora_targets() -> list[str]:
    return sorted({t for fam in _FAMILIES.values() for t in fam.lora_targets})


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; ConfigError on ``model_family`` listing the available ones otherwise."""
    try:
        return _FAMILIES[name]
    except KeyError:
        pass
    available = ", ".join(family_names())
    if name in PLANNED_FAMILIES:
        msg = f"{name!r} is a SimpleTuner family that is planned but not supported yet; available: {available}"
    else:
        msg = f"{name!r} is not a known model family; available: {available}"
    raise ConfigError([FieldError("model_family", msg)])


def check_flavour(family: ModelFamily, flavour: str) -> None:
    """ConfigError on ``model_flavour`` unless ``flavour`` belongs to ``family``."""
    if flavour not in family.flavours:
        raise ConfigError(
            [
                FieldError(
                    "model_flavour",
                    f"{flavour!r} is not a {family.name} flavour; one of {', '.join(family.flavours)}",
                )
            ]
        )


def family_option_errors(family: ModelFamily, values: Mapping[str, object]) -> list[FieldError]:
    """Errors for per-family options in ``values`` (a TrainConfig's fields) that ``family`` does not declare."""
    errors: list[FieldError] = []
    target = values.get("lora_target")
    if target is not None and target not in family.lora_targets:
        errors.append(FieldError("lora_target", f"{target!r} is not a {family.name} LoRA preset; "
                                                f"one of {', '.join(family.lora_targets)}"))
    objective = values.get("prediction_type")
    if objective is not None and objective not in family.objectives:
        errors.append(FieldError("prediction_type", f"{objective!r} is not how {family.name} is trained; "
                                                    f"one of {', '.join(family.objectives)}"))
    if values.get("guidance_value") is not None and not family.guidance_embeds:
        errors.append(FieldError("guidance_value", f"{family.name} has no guidance embedding to feed during "
                                                   "training; remove it (validation_guidance sets inference CFG)"))
    length = values.get("tokenizer_max_length")
    if length is not None and family.max_text_length is not None and length > family.max_text_length:
        errors.append(FieldError("tokenizer_max_length", f"{length} is longer than {family.name}'s text encoder takes "
                                                         f"({family.max_text_length} tokens)"))
    if values.get("attention_masked_training") and not family.text_attention_mask:
        errors.append(FieldError("attention_masked_training", f"{family.name}'s transformer cannot mask text tokens "
                                                              "in attention; remove it"))
    for n in range(family.num_text_encoders + 1, 5):
        key = f"text_encoder_{n}_precision"
        if values.get(key) not in (None, "no_change"):
            errors.append(FieldError(key, f"{family.name} has {family.num_text_encoders} text encoder(s); "
                                          f"there is no text encoder {n} to quantize"))
    return errors
