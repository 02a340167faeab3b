"""Config schema versions and the migrations between them.

A config records ``config_version``; one without it is SimpleTuner's own format, version 0. Loading runs one
small migration per step (0 → 1 → ... → ``CURRENT_CONFIG_VERSION``), so a config written long ago still loads.
Each migration takes the raw key/value mapping (keys already stripped of ``--`` and folded to underscores),
returns the migrated mapping, and appends a line to ``warnings`` for anything a user should know about.

To change the schema: bump ``CURRENT_CONFIG_VERSION``, add ``_vN_to_vN+1`` to ``MIGRATIONS`` and a test for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ConfigError, FieldError

CURRENT_CONFIG_VERSION = 3

Migration = Callable[[dict[str, Any], list[str]], dict[str, Any]]

# SimpleTuner renamed its flow-matching options from flux_* to flow_* when other flow models arrived.
_V0_RENAMES = {
    "flux_schedule_shift": "flow_schedule_shift",
    "flux_schedule_auto_shift": "flow_schedule_auto_shift",
    "flux_use_uniform_schedule": "flow_use_uniform_schedule",
    "flux_sigmoid_scale": "flow_sigmoid_scale",
    "flow_matching_sigmoid_scale": "flow_sigmoid_scale",
}


def _v0_to_v1(raw: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """SimpleTuner format → v1: rename legacy flux_* flow options; old ``lora_type`` spellings."""
    out = dict(raw)
    for old, new in _V0_RENAMES.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out:
            warnings.append(f"{old}: renamed to {new}, which is also set; using {new}={out[new]!r}")
        else:
            out[new] = value
            warnings.append(f"{old}: renamed to {new}")
    # SimpleTuner spelled the peft LoRA as "standard"; older configs said "lora" or "Standard".
    if isinstance(out.get("lora_type"), str) and out["lora_type"].strip().lower() in ("lora", "standard"):
        out["lora_type"] = "standard"
    return out


# Per-family option fields became family-checked values: SimpleTuner's ``flux_*`` spellings -> generic names.
_V1_FAMILY_OPTIONS = {
    "flux_lora_target": "lora_target",
    "flux_guidance_value": "guidance_value",
}


def _v1_to_v2(raw: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """v1 → v2: ``flux_lora_target`` / ``flux_guidance_value`` become ``lora_target`` / ``guidance_value``, values
    checked against the chosen family. They stay valid spellings (SimpleTuner's), so the rename is silent; on
    another family SimpleTuner ignores them, and so do we, with a warning."""
    out = dict(raw)
    family = out.get("model_family")
    for old, new in _V1_FAMILY_OPTIONS.items():
        if old not in out:
            continue
        value = out.pop(old)
        if family not in (None, "flux"):
            warnings.append(f"{old}: only applies to model_family flux, not {family!r}; ignored")
        elif new in out:
            warnings.append(f"{old}: renamed to {new}, which is also set; using {new}={out[new]!r}")
        else:
            out[new] = value  # SimpleTuner's own spelling, so no warning
    return out


# More of SimpleTuner's flux_* options became family-checked values.
_V2_FAMILY_OPTIONS = {
    "flux_fast_schedule": "flow_fast_schedule",
    "flux_attention_masked_training": "attention_masked_training",
}


def _v2_to_v3(raw: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """v2 → v3: ``flux_fast_schedule`` / ``flux_attention_masked_training`` become ``flow_fast_schedule`` /
    ``attention_masked_training`` (the family table says which flavours default to them and which families can
    mask attention); as in v1 → v2, silent on flux and dropped with a warning on other families."""
    out = dict(raw)
    family = out.get("model_family")
    for old, new in _V2_FAMILY_OPTIONS.items():
        if old not in out:
            continue
        value = out.pop(old)
        if family not in (None, "flux"):
            warnings.append(f"{old}: only applies to model_family flux, not {family!r}; ignored")
        elif new in out:
            warnings.append(f"{old}: renamed to {new}, which is also set; using {new}={out[new]!r}")
        else:
            out[new] = value
    return out


# from-version → migration to from-version + 1
MIGRATIONS: dict[int, Migration] = {
    0: _v0_to_v1,
    1: _v1_to_v2,
    2: _v2_to_v3,
}


def config_version_of(raw: dict[str, Any]) -> int:
    """The ``config_version`` recorded in ``raw`` (0 when absent); ConfigError when it is not a whole number."""
    value = raw.get("config_version")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return 0
    try:
        version = int(str(value).strip())
    except ValueError:
        raise ConfigError([FieldError("config_version", f"expected an integer, got {value!r}")]) from None
    if version < 0:
        raise ConfigError([FieldError("config_version", f"must be >= 0, got {version}")])
    return version


def migrate(raw: dict[str, Any], warnings: list[str] | None = None) -> dict[str, Any]:
    """Migrate ``raw`` step by step to ``CURRENT_CONFIG_VERSION``; the result records that version.

    Raises ConfigError when the config is newer than this code understands.
    """
    warnings = warnings if warnings is not None else []
    version = config_version_of(raw)
    if version > CURRENT_CONFIG_VERSION:
        raise ConfigError(
            [
                FieldError(
                    "config_version",
                    f"{version} is newer than this SimpleTuner understands ({CURRENT_CONFIG_VERSION}); upgrade it",
                )
            ]
        )
    out = dict(raw)
    while version < CURRENT_CONFIG_VERSION:
        out = MIGRATIONS[version](out, warnings)
        version += 1
        out["config_version"] = version
    out["config_version"] = version
    return out
