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
    # flavours that edit a reference image: their image datasets need ``conditioning_data`` (reference images),
    # packed in as the flavour's pipeline does; the family's ``tiny`` flavour takes references when they are paired
    reference_flavours: tuple[str, ...] = ()
    # config values a flavour implies unless the config sets them (a v-prediction fine-tune's prediction_type)
    flavour_defaults: Mapping[str, Mapping[str, object]] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self):
        if self.default_flavour not in self.flavours:
            raise ValueError(f"{self.name}: default_flavour {self.default_flavour!r} is not one of its flavours")
        if self.default_lora_target not in self.lora_targets:
            raise ValueError(f"{self.name}: default_lora_target {self.default_lora_target!r} is not a preset")
        unknown = set(self.objectives) - set(OBJECTIVES)
        if not self.objectives or unknown:
            raise ValueError(f"{self.name}: objectives must be some of {', '.join(OBJECTIVES)}")
        if ":" not in self.adapter:
            raise ValueError(f"{self.name}: adapter must be 'module:Class', got {self.adapter!r}")
        for flavour in (*self.reference_flavours, *self.flavour_defaults):
            if flavour not in self.flavours:
                raise ValueError(f"{self.name}: {flavour!r} (reference_flavours / flavour_defaults) is not a flavour")

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
    default_flavour="dev",
    lora_targets=("all", "mmdit", "context", "context+ffs", "all+ffs", "tiny", "nano"),
    default_lora_target="all",
    guidance_embeds=True,
    num_text_encoders=2,
    reference_flavours=("kontext",),
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
)

_FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (FLUX, SDXL, KOLORS)}
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(_FAMILIES)

# SimpleTuner families that this rewrite plans to support; naming one gives "planned", not "unknown".
PLANNED_FAMILIES: tuple[str, ...] = (
    "sd3",
    "auraflow",
    "pixart_sigma",
    "wan",
    "sd1x",
    "sd2x",
    "ltxvideo",
    "hidream",
    "chroma",
    "lumina2",
    "sana",
    "qwen_image",
    "cosmos2image",
    "hunyuanvideo",
    "omnigen",
    "flux2",
    "z_image",
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
    for n in range(family.num_text_encoders + 1, 4):
        key = f"text_encoder_{n}_precision"
        if values.get(key) not in (None, "no_change"):
            errors.append(FieldError(key, f"{family.name} has {family.num_text_encoders} text encoder(s); "
                                          f"there is no text encoder {n} to quantize"))
    return errors
