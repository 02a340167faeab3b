"""Config errors: paths joined the same way everywhere, rendered with their source file."""

from __future__ import annotations

from simpletuner.config.errors import ConfigError, FieldError, join_path


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
