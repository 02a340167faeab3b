"""Config errors: paths joined the same way everywhere, rendered with their source file."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from simpletuner.config.errors import ConfigError, FieldError, _expected_values, errors_from_validation, join_path


def test_prefixed_joins_every_path_and_keeps_the_source():
    error = ConfigError([("lora_rank", "must be >= 1"), ("[0].id", "missing"), ("", "not a list")], "c.json")
    moved = error.prefixed("datasets")
    assert moved.errors == [FieldError("datasets.lora_rank", "must be >= 1"), FieldError("datasets[0].id", "missing"),
                            FieldError("datasets", "not a list")]
    assert moved.source == "c.json" and error.errors[0].path == "lora_rank"  # the original is left as it was
    assert str(moved).splitlines() == ["c.json: datasets.lora_rank: must be >= 1", "c.json: datasets[0].id: missing",
                                       "c.json: datasets: not a list"]
    assert ConfigError([("a", "b")]).prefixed("").errors == [FieldError("a", "b")]


def test_rendering_with_and_without_a_source():
    assert str(ConfigError([("seed", "expected an integer")])) == "seed: expected an integer"
    assert str(ConfigError([("", "not valid JSON")], "x.json")) == "x.json: not valid JSON"
    assert str(ConfigError([], "x.json")) == "x.json: invalid config"
    assert str(ConfigError([])) == "invalid config"
    moved = ConfigError([("seed", "bad")]).with_source("y.json")
    assert moved.source == "y.json" and str(moved) == "y.json: seed: bad"


def test_join_path():
    assert join_path("a", "b") == "a.b" and join_path("a", "[0].b") == "a[0].b"
    assert join_path("", "b") == "b" and join_path("a", "") == "a"


class _Inner(BaseModel):
    x: int = 0


class _Every(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)

    count: int = 0
    rate: float = 1.0
    flag: bool = False
    name: str = ""
    sizes: list[int] = []
    extra_args: dict = {}
    inner: _Inner = _Inner()
    mode: Literal["a", "b"] = "a"
    needed: int
    low: int = Field(1, ge=1, le=9)
    high: float = Field(0.5, gt=0, lt=1)


@pytest.mark.parametrize("values, path, message", [
    ({"count": [1]}, "count", "expected an integer, got [1]"),
    ({"count": "x"}, "count", "expected an integer, got 'x'"),
    ({"count": 1.5}, "count", "expected an integer, got 1.5"),
    ({"rate": [1]}, "rate", "expected a number, got [1]"),
    ({"rate": "fast"}, "rate", "expected a number, got 'fast'"),
    ({"rate": float("inf")}, "rate", "must be a finite number, got inf"),
    ({"flag": [1]}, "flag", "expected true or false, got [1]"),
    ({"flag": "maybe"}, "flag", "expected true or false, got 'maybe'"),
    ({"name": 5}, "name", "expected a string, got 5"),
    ({"sizes": "1024"}, "sizes", "expected a list, got '1024'"),
    ({"extra_args": "a=1"}, "extra_args", "expected an object, got 'a=1'"),
    ({"inner": 3}, "inner", "expected an object, got 3"),
    ({"mode": "c"}, "mode", "'c' is not one of a, b"),
    ({}, "needed", "is required"),
    ({"typo": 1}, "typo", "unknown key"),
    ({"low": 0}, "low", "must be >= 1, got 0"),
    ({"low": 10}, "low", "must be <= 9, got 10"),
    ({"high": 0}, "high", "must be > 0.0, got 0"),
    ({"high": 1}, "high", "must be < 1.0, got 1"),
])
def test_pydantic_errors_are_rewritten_per_kind(values, path, message):
    values = {"needed": 1, **values} if path != "needed" else values
    try:
        _Every.model_validate(values)
    except ValidationError as exc:
        assert errors_from_validation(exc) == [FieldError(path, message)]
        assert errors_from_validation(exc, "datasets[d]") == [FieldError(join_path("datasets[d]", path), message)]
    else:
        raise AssertionError("no error")


def test_expected_values_lists_choices_plainly():
    assert _expected_values("'a', 'b' or 'c'") == "a, b, c"
    assert _expected_values("a number") == "a number"  # nothing quoted: as it was


class _Checked(BaseModel):
    even: int = 0

    @field_validator("even")
    @classmethod
    def _even(cls, value):
        if value % 2:
            raise ValueError("must be even, like 2, 4 or 6")
        return value


def test_validator_messages_lose_pydantics_prefix_only():
    try:
        _Checked.model_validate({"even": 3})
    except ValidationError as exc:
        assert exc.errors()[0]["msg"] == "Value error, must be even, like 2, 4 or 6"
        assert errors_from_validation(exc) == [FieldError("even", "must be even, like 2, 4 or 6")]
    else:
        raise AssertionError("no error")
    # any other kind keeps pydantic's own message
    try:
        _Every.model_validate({"needed": 1, "sizes": [1, "x"]})
    except ValidationError as exc:
        assert errors_from_validation(exc) == [FieldError("sizes[1]", "expected an integer, got 'x'")]
