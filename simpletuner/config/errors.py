"""Config errors that name the field path and what was expected.

Path convention (used by every error this package raises):

- top-level keys of config.json: ``learning_rate``
- nested keys and list items: ``tread_config.routes[1].end_layer_idx``
- entries of multidatabackend.json: ``datasets[<id>].<key>`` when the entry has an ``id``, otherwise
  ``datasets[<n>].<key>`` with ``n`` the 0-based position in the JSON list
- problems with a whole file or list: the bare section name (``datasets``) or an empty path
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError


class FieldError(NamedTuple):
    """One problem: the field path (see the module docstring) and a message saying what was expected."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """A config (or data backend list) is invalid; ``errors`` lists every problem found, not just the first.

    ``source`` is the file the config came from, or None for an in-memory mapping.
    """

    def __init__(self, errors: Iterable[FieldError | tuple[str, str]], source: str | None = None):
        self.errors: list[FieldError] = [FieldError(*e) for e in errors]
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        return "\n".join(prefix + str(e) for e in self.errors) or f"{prefix}invalid config"

    def __str__(self) -> str:
        return self._render()

    def with_source(self, source: str | None) -> ConfigError:
        """The same errors, attributed to ``source``."""
        return ConfigError(self.errors, source)

    def prefixed(self, prefix: str) -> ConfigError:
        """The same errors with ``prefix`` prepended to every path (``prefix.path``)."""
        return ConfigError([FieldError(join_path(prefix, e.path), e.message) for e in self.errors], self.source)


def join_path(prefix: str, path: str) -> str:
    """``join_path("a", "b") == "a.b"``, ``join_path("a", "[0].b") == "a[0].b"``; empty parts vanish."""
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def loc_to_path(loc: Sequence[Any]) -> str:
    """Turn a pydantic ``loc`` tuple into a field path: ``("routes", 1, "end_layer_idx")`` → ``routes[1].end_layer_idx``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = join_path(path, str(part))
    return path


def _expected_values(expected: str) -> str:
    # pydantic renders Literal choices as "'a', 'b' or 'c'"; we list them plainly: "a, b, c"
    values = re.findall(r"'((?:[^'\\]|\\.)*)'", expected)
    return ", ".join(values) if values else expected


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind == "literal_error":
        return f"{value!r} is not one of {_expected_values(str(ctx.get('expected', '')))}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"expected an integer, got {value!r}"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {value!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {value!r}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, got {value!r}"
    if kind in ("string_type",):
        return f"expected a string, got {value!r}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}, got {value!r}"
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}, got {value!r}"
    if kind == "less_than_equal":
        return f"must be <= {ctx.get('le')}, got {value!r}"
    if kind == "less_than":
        return f"must be < {ctx.get('lt')}, got {value!r}"
    if kind in ("list_type", "dict_type", "model_type", "model_attributes_type"):
        expected = "a list" if kind == "list_type" else "an object"
        return f"expected {expected}, got {value!r}"
    msg = err["msg"]
    if kind in ("value_error", "assertion_error"):
        msg = msg.split(", ", 1)[1] if ", " in msg else msg
    return msg


def errors_from_validation(exc: ValidationError, prefix: str = "") -> list[FieldError]:
    """Convert a pydantic ValidationError into FieldErrors with our path convention and rewritten messages.

    A ConfigError raised inside a validator (our cross-field checks) is expanded into its own errors.
    """
    out: list[FieldError] = []
    for err in exc.errors():
        path = join_path(prefix, loc_to_path(err["loc"]))
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            out.extend(FieldError(join_path(path, e.path), e.message) for e in inner.errors)
        else:
            out.append(FieldError(path, _message(err)))
    return out
