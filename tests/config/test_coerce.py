"""SimpleTuner's value spellings: integral strings, null spellings, case-insensitive choices, resolutions
(simpletuner/config/coerce.py), checked at the edges a wrong comparison would move."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import pytest

from simpletuner.config import ConfigError, load_train_config
from simpletuner.config.coerce import (
    MAX_EXACT_INT,
    MAX_PIXEL_EDGE,
    StrictModel,
    _unwrap,
    check_resolution,
    normalise_values,
    parse_resolution_list,
)


def errors_of(**values) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_train_config({"model_family": "flux", "model_flavour": "tiny", **values})
    return {e.path: e.message for e in info.value.errors}


def test_an_optional_integer_given_text_is_an_error_not_none():
    assert "expected an integer" in errors_of(seed="forty-two")["seed"]
    assert load_train_config({"model_family": "flux", "seed": " 42 "}).config.seed == 42


def test_a_boolean_is_not_a_number():
    from pydantic import TypeAdapter, ValidationError

    from simpletuner.config.coerce import Number

    with pytest.raises(ValidationError, match="expected a number, got True"):
        TypeAdapter(Number).validate_python(True)
    assert TypeAdapter(Number).validate_python(" 1.5 ") == 1.5 and TypeAdapter(Number).validate_python(3) == 3


def test_the_largest_exact_integer_is_the_limit():
    from pydantic import TypeAdapter, ValidationError

    from simpletuner.config.coerce import Int

    exact = TypeAdapter(Int)
    assert exact.validate_python(MAX_EXACT_INT) == MAX_EXACT_INT
    assert exact.validate_python(-MAX_EXACT_INT) == -MAX_EXACT_INT
    assert exact.validate_python("1e3") == 1000 and exact.validate_python(500.0) == 500
    for value in (MAX_EXACT_INT + 1, -MAX_EXACT_INT - 1):
        with pytest.raises(ValidationError, match=f"{value} is out of range \\(at most {MAX_EXACT_INT} in size\\)"):
            exact.validate_python(value)


class Choices(StrictModel):
    mode: Literal["none", "Fast", "slow"] = "none"
    plain: Optional[str] = None
    either: Union[Literal["a", "b"], None] = None
    count: Annotated[Optional[int], "meta"] = None
    required: int = 0
    caption_prompt: Optional[str] = None
    maybe_mode: Optional[Literal["none", "x"]] = None


def test_unwrap_reads_none_and_choices_through_optional_union_and_annotated():
    assert _unwrap(int) == (False, ())
    assert _unwrap(Optional[str]) == (True, ())
    assert _unwrap(Literal["a", "b", 3]) == (False, ("a", "b"))
    assert _unwrap(Union[Literal["a", "b"], None]) == (True, ("a", "b"))
    assert _unwrap(Literal["a"] | None) == (True, ("a",))
    assert _unwrap(Annotated[Optional[Literal["x"]], "meta"]) == (True, ("x",))
    assert _unwrap(Annotated[int, "meta"]) == (False, ())
    allows_none, choices = _unwrap(Optional[Union[Literal["p"], Literal["q"]]])
    assert allows_none and sorted(choices) == ["p", "q"]


def test_normalise_values_on_a_model():
    raw = {"unknown": "NULL", "mode": None, "plain": "None", "either": "B", "count": "null", "required": "none",
           "caption_prompt": "", "later": 1}
    assert normalise_values(Choices, raw) == {
        "unknown": "NULL", "mode": "none", "plain": None, "either": "b", "count": None, "required": "none",
        "caption_prompt": "", "later": 1}
    # order does not matter: every key after an unknown one or a None one is still normalised
    assert normalise_values(Choices, {"zzz": 1, "mode": "FAST"}) == {"zzz": 1, "mode": "Fast"}
    assert normalise_values(Choices, {"plain": None, "mode": "SLOW"}) == {"plain": None, "mode": "slow"}
    assert normalise_values(Choices, {"either": None}) == {"either": None}  # allows None: stays None
    assert normalise_values(Choices, {"maybe_mode": None}) == {"maybe_mode": None}  # null, not the choice "none"
    assert normalise_values(Choices, {"maybe_mode": "Null"}) == {"maybe_mode": "none"}  # a spelling: the choice
    assert normalise_values(Choices, {"required": 5, "mode": "FAST"}) == {"required": 5, "mode": "Fast"}
    assert normalise_values(Choices, {"mode": "fast ", "plain": " x "}) == {"mode": "Fast", "plain": " x "}
    assert normalise_values(Choices, ["not", "a", "dict"]) == ["not", "a", "dict"]
    assert Choices.model_validate({"mode": "SLOW", "either": "A"}).either == "a"


@pytest.mark.parametrize("resolution, kind, problem", [
    (0, "pixel", "must be > 0, got 0"),
    (-1.0, "area", "must be > 0, got -1.0"),
    (1, "pixel", None),
    (100, "area", None),
    (100.5, "area", "100.5 megapixels is too large"),
    (MAX_PIXEL_EDGE, "pixel", None),
    (MAX_PIXEL_EDGE + 1, "pixel_area", f"{MAX_PIXEL_EDGE + 1!r} pixels is too large (at most {MAX_PIXEL_EDGE})"),
    (512.5, "pixel", "512.5 is not a whole number of pixels"),
])
def test_check_resolution_edges(resolution, kind, problem):
    message = check_resolution(resolution, kind)
    if problem is None:
        assert message is None
    else:
        assert message.startswith(problem)
    if kind == "area" and problem and "megapixels" in problem:
        assert message == ("100.5 megapixels is too large; with resolution_type 'area' the resolution is in "
                           "megapixels (e.g. 1.0), use resolution_type 'pixel' or 'pixel_area' for pixel sizes")


def test_parse_resolution_list():
    assert parse_resolution_list("1024") == [(1024, 1024)]
    assert parse_resolution_list("1024x768, 512X256,1") == [(1024, 768), (512, 256), (1, 1)]
    for bad in ("0", "0x5", "5x0", "-1x5", "5x-1"):
        with pytest.raises(ValueError, match=f"{bad!r}: width and height must be > 0"):
            parse_resolution_list(bad)
    for bad in ("big", "1x2x3", ""):
        with pytest.raises(ValueError, match="is not a size; expected SIZE or WIDTHxHEIGHT"):
            parse_resolution_list(bad)
