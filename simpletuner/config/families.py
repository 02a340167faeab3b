"""Model families and their flavours, without importing any model code.

``simpletuner.models.registry`` reads this table to pick an adapter; the config schema, the wizard and the web UI
read it to offer and check choices. A family's adapter module is imported only by the models layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import ConfigError, FieldError


@dataclass(frozen=True)
class ModelFamily:
    """What the config layer knows about one model family.

    ``flavours`` maps a flavour name to its default weights (a Hugging Face repo id), or None for ``tiny``,
    a random-initialised checkpoint the models layer generates locally.
    """

    name: str
    description: str
    flavours: Mapping[str, str | None]
    default_flavour: str
    lora_targets: tuple[str, ...]
    default_lora_target: str
    # The transformer takes a distilled guidance embedding (Flux dev) instead of real CFG.
    guidance_embeds: bool = False
    # Flavours whose transformer has no guidance embedding (distilled for few steps, or de-distilled).
    flavours_without_guidance_embeds: frozenset[str] = field(default_factory=frozenset)
    num_text_encoders: int = 1

    def default_weights(self, flavour: str | None) -> str | None:
        """Default ``pretrained_model_name_or_path`` for ``flavour`` (the family default when None)."""
        return self.flavours[flavour or self.default_flavour]


FLUX = ModelFamily(
    name="flux",
    description="Black Forest Labs FLUX.1 (12B MMDiT, flow matching, CLIP-L + T5-XXL text encoders)",
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
    flavours_without_guidance_embeds=frozenset({"schnell", "libreflux"}),
    num_text_encoders=2,
)

FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({FLUX.name: FLUX})

# SimpleTuner families that this rewrite plans to support; naming one gives "planned", not "unknown".
PLANNED_FAMILIES: tuple[str, ...] = (
    "sd3",
    "auraflow",
    "pixart_sigma",
    "wan",
    "sdxl",
    "sd1x",
    "sd2x",
    "kolors",
    "ltxvideo",
    "hidream",
    "chroma",
    "lumina2",
    "sana",
    "qwen_image",
    "cosmos2image",
    "hunyuanvideo",
    "omnigen",
)


def family_names() -> list[str]:
    """Names of the families that can be trained now, sorted."""
    return sorted(FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; ConfigError on ``model_family`` listing the available ones otherwise."""
    try:
        return FAMILIES[name]
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
