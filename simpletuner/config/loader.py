"""Load config.json as SimpleTuner writes it, and write it back.

Normalisation, in order:
1. keys lose a leading ``--`` (``"--learning_rate"`` → ``learning_rate``);
2. ``TRAINER_EXTRA_ARGS`` (a string such as ``"--lora_rank=32 --gradient_checkpointing"``) is expanded into keys
   and wins over the same key given in the file, as it does on SimpleTuner's command line;
3. ``-`` in keys becomes ``_`` (``learning-rate`` → ``learning_rate``); the same key given twice with different
   values is an error;
4. ``overrides`` (e.g. from the command line) are applied;
5. older config versions are migrated (see :mod:`simpletuner.config.versions`);
6. SimpleTuner's documented keys that are not fields here are accepted, refused or warned about as
   :mod:`simpletuner.config.simpletuner_keys` says (its newer spellings, e.g. ``checkpoint_step_interval``, are
   read as our fields in step 3); other unknown keys are dropped with a warning that suggests the closest known key;
7. the rest is validated by :class:`~simpletuner.config.train.TrainConfig`.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from pydantic import ValidationError

from .errors import ConfigError, FieldError, errors_from_validation
from .files import write_text_atomic
from .simpletuner_keys import ALIASES, TRAIN_KEYS, apply_rules
from .train import TrainConfig
from .versions import migrate

Source = Union[str, os.PathLike, Mapping[str, Any]]

@dataclass
class LoadedConfig:
    """A validated config, the warnings found while loading it, and the file it came from (None for a mapping)."""

    config: TrainConfig
    warnings: list[str] = field(default_factory=list)
    source: str | None = None


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file; ConfigError naming the file (and line/column for bad JSON) otherwise."""
    name = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([FieldError("", "file not found")], source=name) from None
    except OSError as exc:
        raise ConfigError([FieldError("", f"cannot be read: {exc.strerror or exc}")], source=name) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [FieldError("", f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")], source=name
        ) from None


def parse_extra_args(text: str | list[str], warnings: list[str] | None = None) -> dict[str, Any]:
    """Parse ``TRAINER_EXTRA_ARGS``: ``--key=value``, ``--key value`` and bare ``--flag`` (= true)."""
    tokens = shlex.split(text) if isinstance(text, str) else [str(t) for t in text]
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            if warnings is not None:
                warnings.append(f"TRAINER_EXTRA_ARGS: {token!r} is not a --key or --key=value; ignored")
            continue
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            out[key] = value
        elif i < len(tokens) and not tokens[i].startswith("--"):
            out[key] = tokens[i]
            i += 1
        else:
            out[key] = True
    return out


def _normalise_keys(raw: Mapping[str, Any], warnings: list[str]) -> dict[str, Any]:
    stripped: dict[str, tuple[str, Any]] = {}  # normalised key -> (key as written, value)
    errors: list[FieldError] = []

    def put(written: str, value: Any, override: bool) -> None:
        key = written.lstrip("-").strip().replace("-", "_")
        key = ALIASES.get(key, key)
        if not key:
            warnings.append(f"{written!r}: empty key ignored")
            return
        if key in stripped and not override and stripped[key][1] != value:
            errors.append(
                FieldError(
                    key,
                    f"given twice with different values (as {stripped[key][0]!r}: {stripped[key][1]!r} "
                    f"and {written!r}: {value!r})",
                )
            )
            return
        stripped[key] = (written, value)

    extra = None
    for written, value in raw.items():
        if not isinstance(written, str):
            raise ConfigError([FieldError(str(written), "keys must be strings")])
        if written.lstrip("-") == "TRAINER_EXTRA_ARGS":
            extra = value
            continue
        put(written, value, override=False)
    if extra:
        if not isinstance(extra, (str, list)):
            errors.append(FieldError("TRAINER_EXTRA_ARGS", f"expected a string of --key=value arguments, got {extra!r}"))
        else:
            for key, value in parse_extra_args(extra, warnings).items():
                put(key, value, override=True)
    if errors:
        raise ConfigError(errors)
    return {key: value for key, (_, value) in stripped.items()}


def _drop_unknown(values: dict[str, Any], warnings: list[str]) -> tuple[dict[str, Any], list[FieldError]]:
    """(known keys, errors for refused SimpleTuner keys); warnings for the rest."""
    known = TrainConfig.model_fields
    values, refused, notes = apply_rules(values, TRAIN_KEYS)
    warnings.extend(notes)
    out = {}
    for key, value in values.items():
        if key in known:
            out[key] = value
            continue
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        warnings.append(f"{key}: unknown key, ignored{hint}")
    return out, refused


def prepare_train_config(
    source: Source, *, overrides: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[str], str | None]:
    """Steps 1-6 of loading: the normalised, migrated key/value mapping (unknown keys removed), the warnings,
    and the source file name. Raises ConfigError for unreadable files, conflicting keys and refused values."""
    values, warnings, name, refused = _prepare(source, overrides)
    if refused:
        raise ConfigError(refused, source=name)
    return values, warnings, name


def _prepare(source: Source, overrides: Mapping[str, Any] | None):
    warnings: list[str] = []
    name = None if isinstance(source, Mapping) else os.fspath(source)
    try:
        raw = source if isinstance(source, Mapping) else read_json(source)
        if not isinstance(raw, Mapping):
            raise ConfigError([FieldError("", f"expected a JSON object of settings, got {type(raw).__name__}")])
        values = _normalise_keys(raw, warnings)
        if overrides:
            values.update(_normalise_keys(overrides, warnings))
        values = migrate(values, warnings)
        values, refused = _drop_unknown(values, warnings)
    except ConfigError as exc:
        raise exc.with_source(exc.source or name) from None
    return values, warnings, name, refused


def load_train_config(source: Source, *, overrides: Mapping[str, Any] | None = None) -> LoadedConfig:
    """Load and validate a config.json (a path) or its contents (a mapping).

    ``overrides`` (same key spellings as the file) win over the file. Raises ConfigError listing every error
    as ``path: message``, attributed to the file when there is one.
    """
    values, warnings, name, refused = _prepare(source, overrides)
    try:
        config = TrainConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(refused + errors_from_validation(exc), source=name) from None
    if refused:
        raise ConfigError(refused, source=name)
    return LoadedConfig(config=config, warnings=warnings, source=name)


def dump_train_config(config: TrainConfig) -> dict[str, Any]:
    """A JSON-ready dict of every setting (defaults resolved); ``load_train_config`` reads it back unchanged."""
    return config.model_dump(mode="json")


def write_train_config(config: TrainConfig, path: str | os.PathLike[str]) -> None:
    """Write ``dump_train_config(config)`` to ``path`` as indented JSON, atomically (parent folders are created;
    a crash leaves the old file whole)."""
    write_text_atomic(path, json.dumps(dump_train_config(config), indent=2) + "\n")
