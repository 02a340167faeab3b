"""Check a submitted config (train config + data backends + prompt library) before it is stored or run:
the config layer's schema, then the server's own rule that every path field resolves inside the allowed roots
(see ``simpletuner.config.paths``; the trainer checks again when it opens them)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from simpletuner.config import paths
from simpletuner.config.scan import scan_data

logger = logging.getLogger("simpletuner.server")


@dataclass
class FieldProblem:
    path: str
    message: str


@dataclass
class Checked:
    """A config that passed: the normalised pieces to store and the frozen train config to run."""

    train_config: dict
    data_backends: list
    prompt_library: dict | None
    frozen: dict | None = None  # every setting, defaults resolved (what the trainer will read)
    warnings: list[str] = field(default_factory=list)
    data: dict | None = None  # what the dataset folders hold (simpletuner.config.scan.DataScan.to_dict())
    schema_version: int | None = None


class InvalidConfig(Exception):
    def __init__(self, errors: list[FieldProblem], data: dict | None = None):
        self.errors = errors
        self.data = data  # the data scan, when the config got that far
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in errors))


def _join(prefix: str, path: str) -> str:
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _canon(key: str) -> str:
    """A config key as the loader reads it (``--output-dir``, ``output-dir`` and ``output_dir`` are one key)."""
    return str(key).lstrip("-").strip().replace("-", "_")


def within_roots(value: str, roots: list[Path], base: Path) -> bool:
    """True when ``value`` (relative paths resolve against ``base``; symlinks are followed) is inside a root."""
    return paths.problem(value, roots, base, "dir") is None


def _entry_label(index: int, entry: Any) -> str:
    ident = entry.get("id") if isinstance(entry, Mapping) else None
    return f"data_backends[{ident}]" if isinstance(ident, str) and ident and "[" not in ident and "]" not in ident \
        else f"data_backends[{index}]"


def _backend_path_fields() -> dict[str, paths.PathField]:
    from simpletuner.config import DatasetBackend, TextEmbedsBackend

    return {**paths.path_fields(DatasetBackend), **paths.path_fields(TextEmbedsBackend)}


def _train_config_class():
    from simpletuner.config import TrainConfig

    return TrainConfig


def _train_path_fields() -> dict[str, paths.PathField]:
    return paths.path_fields(_train_config_class())


def _check_value(field_path: str, value: Any, spec: paths.PathField, roots: list[Path], base: Path,
                 output_base: Path | None, out: list[FieldProblem]) -> bool:
    """Add a problem for ``value`` (read from ``base``, or from ``output_base`` where the trainer reads it from
    its output folder); True when it passed."""
    message = paths.field_problem(spec, value, roots, base, output_base)
    if message:
        out.append(FieldProblem(field_path, message))
    return message is None


def check_paths(train_config: Mapping, data_backends: list, roots: list[Path], base: Path,
                output_base: Path | None = None) -> list[FieldProblem]:
    """Every path field (as marked in the schemas; keys in any SimpleTuner spelling) that escapes ``roots``,
    named by its field path. Values are judged by what they resolve to, never by how they look."""
    out: list[FieldProblem] = []
    fields = _train_path_fields()
    nested = paths.nested_path_fields(_train_config_class())
    for key, value in train_config.items():
        name = _canon(str(key))
        if name in fields:
            _check_value(f"train_config.{name}", value, fields[name], roots, base, output_base, out)
        elif name in nested and isinstance(value, Mapping):  # a block's own paths (distillation.prompt_file)
            for sub, spec in nested[name].items():
                if sub in value:
                    _check_value(f"train_config.{spec.name}", value[sub], spec, roots, base, output_base, out)
    fields = _backend_path_fields()
    for i, entry in enumerate(data_backends or []):
        if not isinstance(entry, Mapping):
            continue
        label = _entry_label(i, entry)
        for key, value in entry.items():
            name = str(key).lstrip("-")
            if name in fields:
                _check_value(f"{label}.{name}", value, fields[name], roots, base, output_base, out)
    return out


def _config_errors(exc: Exception, section: str) -> list[FieldProblem]:
    problems = []
    for err in getattr(exc, "errors", None) or []:
        path, message = (err.path, err.message) if hasattr(err, "path") else (str(err[0]), str(err[1]))
        if section == "data_backends" and path.startswith("datasets"):
            path = "data_backends" + path[len("datasets") :]
        else:
            path = _join(section, path)
        problems.append(FieldProblem(path, message))
    if not problems:
        problems.append(FieldProblem(section, str(exc)))
    return problems


def check_prompt_library(library: Any) -> list[FieldProblem]:
    if library is None:
        return []
    if not isinstance(library, Mapping):
        return [FieldProblem("prompt_library", "expected an object mapping nicknames to prompts")]
    return [
        FieldProblem(f"prompt_library.{k}", f"expected a prompt string, got {v!r}")
        for k, v in library.items()
        if not isinstance(v, str) or not v.strip()
    ]


def _read_json_file(value: str, base: Path, field_path: str, problems: list[FieldProblem]) -> Any:
    """A JSON file named by a path field that already passed the roots check (read from where it resolves)."""
    try:
        return json.loads(Path(paths.resolve(value, base)).read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(FieldProblem(field_path, f"file {value!r} not found"))
    except (OSError, ValueError) as exc:
        problems.append(FieldProblem(field_path, f"file {value!r} could not be read: {exc}"))
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def check_config(
    train_config: Mapping,
    data_backends: list | None,
    prompt_library: Mapping | None,
    roots: list[Path],
    base: Path,
    *,
    overrides: Mapping | None = None,
    output_base: Path | None = None,
) -> Checked:
    """Validate everything and raise ``InvalidConfig`` listing every problem (not just the first).

    Keys are read as the trainer reads them (``--key`` spellings, ``TRAINER_EXTRA_ARGS``, then ``overrides``),
    and every path field of both configs must resolve inside ``roots`` (relative paths from ``base``; fields
    relative to the output folder also from ``output_base``). No file outside the roots is ever read, not even
    to report on it. Empty ``data_backends`` / ``prompt_library`` are read from the files the train config names
    (``data_backend_config`` / ``user_prompt_library``)."""
    from simpletuner.config import ConfigError, dump_train_config, load_data_backends, load_train_config
    from simpletuner.config.loader import prepare_train_config

    if not isinstance(train_config, Mapping):
        raise InvalidConfig([FieldProblem("train_config", "expected an object")])
    if data_backends is None:
        data_backends = []
    if not isinstance(data_backends, list):
        raise InvalidConfig([FieldProblem("data_backends", "expected a list of datasets")])
    try:
        values, warnings, _ = prepare_train_config(train_config, overrides=overrides)
    except ConfigError as exc:
        raise InvalidConfig(_config_errors(exc, "train_config")) from None
    problems: list[FieldProblem] = []
    fields = _train_path_fields()
    for name, spec in fields.items():
        if name in values and not _check_value(f"train_config.{name}", values[name], spec, roots, base,
                                               output_base, problems):
            del values[name]  # refused: never read, not even by the schema
    for block, specs in paths.nested_path_fields(_train_config_class()).items():
        inner = values.get(block)
        if isinstance(inner, Mapping):
            for sub, spec in specs.items():
                if sub in inner and not _check_value(f"train_config.{spec.name}", inner[sub], spec, roots, base,
                                                     output_base, problems):
                    values[block] = {k: v for k, v in inner.items() if k != sub}
                    inner = values[block]

    # Files named by the config are read here, from where they resolve, so the schema never opens a file.
    hooks = _text(values.get("webhook_config"))
    if hooks and not hooks.lstrip().startswith(("{", "[")):
        values["webhook_config"] = _read_json_file(hooks, base, "train_config.webhook_config", problems)
    backend_file = _text(values.get("data_backend_config"))
    if not data_backends and backend_file:
        data_backends = _read_json_file(backend_file, base, "train_config.data_backend_config", problems) or []
        if not isinstance(data_backends, list):
            problems.append(FieldProblem("train_config.data_backend_config", "file does not hold a JSON list"))
            data_backends = []
    library_file = _text(values.get("user_prompt_library"))
    if prompt_library is None and library_file:
        prompt_library = _read_json_file(library_file, base, "train_config.user_prompt_library", problems)
    problems.extend(check_prompt_library(prompt_library))
    problems.extend(check_paths({}, data_backends, roots, base, output_base))

    # The server writes these files into the run dir itself.
    loadable = {k: v for k, v in values.items() if k not in ("data_backend_config", "user_prompt_library")}
    frozen = None
    config = backends = None
    resolution = resolution_type = None
    schema_version = None
    distills = False
    seen = {p.path for p in problems}
    try:
        loaded = load_train_config(loadable)
        config = loaded.config
        warnings.extend(str(w) for w in loaded.warnings or [])
        frozen = dump_train_config(loaded.config)
        resolution, resolution_type = loaded.config.resolution, loaded.config.resolution_type
        distills = loaded.config.distillation is not None  # learns from prompts: no image dataset needed
        schema_version = getattr(loaded.config, "config_version", None)
        for name, value, spec in paths.config_paths(loaded.config):  # defaults are paths too
            # output_dir is the server's own choice for a job (RUN_DIR/output); the others, defaults included, count
            if name not in values and f"train_config.{name}" not in seen and name not in (
                    "output_dir", "data_backend_config", "user_prompt_library"):
                _check_value(f"train_config.{name}", value, spec, roots, base, output_base, problems)
    except ConfigError as exc:
        problems.extend(_config_errors(exc, "train_config"))
    except Exception as exc:  # a config-layer bug must not become a 500 for the user
        logger.exception("train config check crashed")
        problems.append(FieldProblem("train_config", f"could not be checked: {exc}"))
    try:
        backends = load_data_backends(list(data_backends), resolution=resolution, resolution_type=resolution_type,
                                      require_images=not distills)
        warnings.extend(str(w) for w in backends.warnings or [])
        for name, value, spec in paths.config_paths(None, backends):  # e.g. cache_dir_vae from the id
            label = "data_backends" + name[len("datasets"):]
            if label not in seen:
                _check_value(label, value, spec, roots, base, output_base, problems)
    except ConfigError as exc:
        problems.extend(_config_errors(exc, "data_backends"))
    except Exception as exc:
        logger.exception("data backend check crashed")
        problems.append(FieldProblem("data_backends", f"could not be checked: {exc}"))
    data = None
    if not problems and config is not None and backends is not None:
        # every path passed the roots check above, so the scan reads nothing outside them
        found = scan_data(config, backends, base=base, roots=roots)
        data = found.to_dict()
        problems.extend(FieldProblem(_scan_path(e.path), e.message) for e in found.errors)
        warnings.extend(_scan_warning(w) for w in found.warnings)
    if problems:
        raise InvalidConfig(_unique(problems), data)
    return Checked(
        train_config=json.loads(json.dumps(dict(train_config))),
        data_backends=json.loads(json.dumps(list(data_backends))),
        prompt_library=dict(prompt_library) if prompt_library is not None else None,
        frozen=frozen,
        warnings=warnings,
        schema_version=schema_version if isinstance(schema_version, int) else None,
        data=data,
    )


def _scan_path(path: str) -> str:
    """A scan's field path as the server names it: datasets[x].y -> data_backends[x].y, key -> train_config.key."""
    return "data_backends" + path[len("datasets"):] if path.startswith("datasets") else _join("train_config", path)


def _scan_warning(text: str) -> str:
    return "data_backends" + text[len("datasets"):] if text.startswith("datasets") else f"train_config.{text}"


def _unique(problems: list[FieldProblem]) -> list[FieldProblem]:
    seen, out = set(), []
    for p in problems:
        if (p.path, p.message) not in seen:
            seen.add((p.path, p.message))
            out.append(p)
    return out


def absolutize_backends(data_backends: list, base: Path) -> list:
    """Data backends with relative path fields made absolute against ``base`` (the job's working dir)."""
    fields = _backend_path_fields()
    out = []
    for entry in data_backends:
        if not isinstance(entry, Mapping):
            out.append(entry)
            continue
        new = dict(entry)
        for k, v in entry.items():
            if isinstance(v, str) and v and str(k).lstrip("-") in fields:
                p = Path(os.path.expanduser(v))
                new[k] = str(p if p.is_absolute() else (base / p))
        out.append(new)
    return out
