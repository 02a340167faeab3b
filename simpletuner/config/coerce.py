"""Lenient value parsing for SimpleTuner's JSON, where numbers and booleans are often strings.

pydantic already reads ``"1e-4"`` as a float and ``"true"``/``"no"``/``"1"`` as booleans; this adds what it
does not: integral strings such as ``"1e3"`` or ``"500.0"`` for integer fields, ``"None"``/``"null"`` for
optional fields, and case-insensitive choices (``"BF16"`` → ``"bf16"``).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, model_validator

_NULL_STRINGS = frozenset({"", "none", "null"})
# Integers past this cannot be represented exactly in JSON readers such as the web UI's JavaScript.
MAX_EXACT_INT = 2**53 - 1
MAX_PIXEL_EDGE = 16_384


def _parse_number(text: str) -> int | float | None:
    """``"500"`` -> 500, ``"1e-4"`` -> 0.0001, anything else -> None."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _int_like(value: Any) -> Any:
    number = _parse_number(value) if isinstance(value, str) else value
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number if isinstance(number, int) else value  # anything else: let pydantic report it


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, str):
        number = _parse_number(value)
        if number is None:
            raise ValueError(f"expected a number, got {value!r}")
        value = number
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


def _exact_int(value: int) -> int:
    if abs(value) > MAX_EXACT_INT:
        raise ValueError(f"{value} is out of range (at most {MAX_EXACT_INT} in size)")
    return value


# An integer that also accepts "500", "1e3" and 500.0; absurdly large values (2**63) are refused.
Int = Annotated[int, BeforeValidator(_int_like), AfterValidator(_exact_int)]
# An int or a float, kept as given: 1024 stays int, 0.5 stays float, "1.5" becomes 1.5; never inf or NaN.
Number = Annotated[Union[int, float], BeforeValidator(_number)]


def _unwrap(annotation: Any) -> tuple[bool, tuple[str, ...]]:
    """(allows None, literal string choices) of a field annotation."""
    allows_none = False
    choices: list[str] = []
    stack = [annotation]
    while stack:
        ann = stack.pop()
        if ann is type(None) or ann is None:
            allows_none = True
            continue
        origin = typing.get_origin(ann)
        if origin is Annotated:
            stack.append(typing.get_args(ann)[0])
        elif origin is Union or origin is types.UnionType:
            stack.extend(typing.get_args(ann))
        elif origin is Literal:
            choices.extend(a for a in typing.get_args(ann) if isinstance(a, str))
    return allows_none, tuple(choices)


_FIELD_INFO: dict[type, dict[str, tuple[bool, tuple[str, ...]]]] = {}


def normalise_values(model: type[BaseModel], data: Any) -> Any:
    """Map SimpleTuner's spellings of null and of choices onto ``model``'s field types (a before-validator).

    ``"None"``/``"null"``/``""`` become the choice ``"none"`` where that is one of the field's choices, else None
    where the field allows None (except ``""`` for ``*_prompt`` fields: an empty prompt is a real value);
    choices match case-insensitively.
    """
    if not isinstance(data, dict):
        return data
    info = _FIELD_INFO.get(model)
    if info is None:
        info = {name: _unwrap(f.annotation) for name, f in model.model_fields.items()}
        _FIELD_INFO[model] = info
    out = dict(data)
    for key, value in data.items():
        if key not in info:
            continue
        allows_none, choices = info[key]
        if value is None:
            if not allows_none and "none" in choices:
                out[key] = "none"
            continue
        if not isinstance(value, str):
            continue
        text = value.strip()
        if text.lower() in _NULL_STRINGS:
            if "none" in choices:
                out[key] = "none"
            elif allows_none and not (text == "" and key.endswith("_prompt")):  # an empty prompt is a prompt
                out[key] = None
            continue
        if choices:
            matches = [c for c in choices if c.lower() == text.lower()]
            if len(matches) == 1:
                out[key] = matches[0]
    return out


def check_resolution(resolution: float, resolution_type: str) -> str | None:
    """A message if ``resolution`` does not fit ``resolution_type`` (pixels vs megapixels), else None."""
    if resolution <= 0:
        return f"must be > 0, got {resolution!r}"
    if resolution_type == "area":
        if resolution > 100:
            return (
                f"{resolution!r} megapixels is too large; with resolution_type 'area' the resolution is in "
                "megapixels (e.g. 1.0), use resolution_type 'pixel' or 'pixel_area' for pixel sizes"
            )
    elif not float(resolution).is_integer():
        return (
            f"{resolution!r} is not a whole number of pixels; use resolution_type 'area' for megapixels"
        )
    elif resolution > MAX_PIXEL_EDGE:
        return f"{resolution!r} pixels is too large (at most {MAX_PIXEL_EDGE})"
    return None


def parse_resolution_list(text: str) -> list[tuple[int, int]]:
    """Parse ``"1024"``, ``"1024x768"`` or a comma-separated list of them into (width, height) pairs.

    Raises ValueError naming the bad item.
    """
    sizes: list[tuple[int, int]] = []
    items = [item.strip() for item in str(text).split(",")]
    for item in items:
        parts = item.lower().split("x")
        try:
            if len(parts) == 1:
                width = height = int(parts[0])
            elif len(parts) == 2:
                width, height = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{item!r} is not a size; expected SIZE or WIDTHxHEIGHT, comma-separated (e.g. '1024' or '1024x768,512')"
            ) from None
        if width <= 0 or height <= 0:
            raise ValueError(f"{item!r}: width and height must be > 0")
        sizes.append((width, height))
    return sizes


class StrictModel(BaseModel):
    """Base for config entries: unknown keys are errors, SimpleTuner's value spellings are accepted, and no
    number field takes inf or NaN."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        return normalise_values(cls, data)
