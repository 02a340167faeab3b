"""Check a submitted config (train config + data backends + prompt library) before it is stored or run:
the config layer's schema, then the server's own rule that every local path stays under the allowed roots."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger("simpletuner.server")

# Train-config keys holding local paths, besides any key ending in one of PATH_SUFFIXES.
PATH_KEYS = {
    "data_backend_config",
    "user_prompt_library",
    "webhook_config",
    "resume_from_checkpoint",
    "init_lora",
    "instance_data_dir",
    "cache_dir",
}
PATH_SUFFIXES = ("_dir", "_path", "_file", "_folder")
PATH_PREFIXES = ("cache_dir",)  # cache_dir_vae, cache_dir_text, ...
# Data backend types whose paths are not on this machine's disk.
REMOTE_BACKENDS = {"aws", "s3", "huggingface", "hf", "csv_url"}


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
    schema_version: int | None = None


class InvalidConfig(Exception):
    def __init__(self, errors: list[FieldProblem]):
        self.errors = errors
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in errors))


def _join(prefix: str, path: str) -> str:
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _canon(key: str) -> str:
    return key.lstrip("-").replace("-", "_") if key.startswith("--") else key


def _is_path_key(key: str) -> bool:
    key = _canon(key)
    return key in PATH_KEYS or key.endswith(PATH_SUFFIXES) or key.startswith(PATH_PREFIXES)


def _looks_like_url(value: str) -> bool:
    return "://" in value


def within_roots(value: str, roots: list[Path], base: Path) -> bool:
    """True when ``value`` (relative paths resolve against ``base``; symlinks are followed) is inside a root."""
    try:
        p = Path(os.path.expanduser(value))
        if not p.is_absolute():
            p = base / p
        real = Path(os.path.realpath(p))
    except (OSError, ValueError):  # NUL bytes, names too long: not a usable path, so not an allowed one
        return False
    return any(real == r or r in real.parents for r in roots)


def _scan(obj: Any, prefix: str, roots: list[Path], base: Path, out: list[FieldProblem], key: str = "") -> None:
    if isinstance(obj, Mapping):
        if str(obj.get("type", "local")).lower() in REMOTE_BACKENDS:
            return
        for k, v in obj.items():
            _scan(v, _join(prefix, _canon(str(k))), roots, base, out, key=str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _scan(v, f"{prefix}[{i}]", roots, base, out, key=key)
    elif isinstance(obj, str) and key and (_is_path_key(key) or _canon(key) == "path"):
        text = obj.strip()
        if not text or _looks_like_url(text) or text.startswith(("{", "[")):
            return
        if _canon(key) == "resume_from_checkpoint" and text == "latest":
            return
        if not within_roots(text, roots, base):
            out.append(FieldProblem(prefix, f"path {text!r} is outside the allowed roots ({', '.join(map(str, roots))})"))


def check_paths(train_config: Mapping, data_backends: list, roots: list[Path], base: Path) -> list[FieldProblem]:
    """Every local path field that escapes ``roots``, named by its field path."""
    out: list[FieldProblem] = []
    _scan(dict(train_config), "train_config", roots, base, out)
    for i, entry in enumerate(data_backends or []):
        label = f"data_backends[{entry.get('id', i)}]" if isinstance(entry, Mapping) else f"data_backends[{i}]"
        if isinstance(entry, Mapping):
            _scan(entry, label, roots, base, out)
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
    p = Path(os.path.expanduser(value))
    p = p if p.is_absolute() else base / p
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(FieldProblem(field_path, f"file {value!r} not found"))
    except (OSError, ValueError) as exc:
        problems.append(FieldProblem(field_path, f"file {value!r} could not be read: {exc}"))
    return None


def _get(mapping: Mapping, key: str) -> Any:
    for k, v in mapping.items():
        if _canon(str(k)) == key:
            return v
    return None


def check_config(
    train_config: Mapping,
    data_backends: list | None,
    prompt_library: Mapping | None,
    roots: list[Path],
    base: Path,
) -> Checked:
    """Validate everything and raise ``InvalidConfig`` listing every problem (not just the first).

    Empty ``data_backends`` / ``prompt_library`` are read from the files the train config names
    (``data_backend_config`` / ``user_prompt_library``), if those are inside the allowed roots."""
    from simpletuner.config import ConfigError, dump_train_config, load_data_backends, load_train_config

    if not isinstance(train_config, Mapping):
        raise InvalidConfig([FieldProblem("train_config", "expected an object")])
    if data_backends is None:
        data_backends = []
    if not isinstance(data_backends, list):
        raise InvalidConfig([FieldProblem("data_backends", "expected a list of datasets")])
    problems = check_paths(train_config, data_backends, roots, base)
    read_files = not problems  # never read files from outside the roots, not even to report on them
    warnings: list[str] = []

    backend_file = _get(train_config, "data_backend_config")
    if read_files and not data_backends and isinstance(backend_file, str) and backend_file.strip():
        data_backends = _read_json_file(backend_file, base, "train_config.data_backend_config", problems) or []
        if not isinstance(data_backends, list):
            problems.append(FieldProblem("train_config.data_backend_config", "file does not hold a JSON list"))
            data_backends = []
        else:
            problems.extend(check_paths({}, data_backends, roots, base))
    library_file = _get(train_config, "user_prompt_library")
    if read_files and prompt_library is None and isinstance(library_file, str) and library_file.strip():
        prompt_library = _read_json_file(library_file, base, "train_config.user_prompt_library", problems)
    problems.extend(check_prompt_library(prompt_library))

    # The server writes these files into the run dir itself.
    loadable = {k: v for k, v in train_config.items()
                if _canon(str(k)) not in ("data_backend_config", "user_prompt_library")}
    frozen = None
    resolution = resolution_type = None
    schema_version = None
    try:
        loaded = load_train_config(loadable)
        warnings.extend(str(w) for w in loaded.warnings or [])
        frozen = dump_train_config(loaded.config)
        resolution, resolution_type = loaded.config.resolution, loaded.config.resolution_type
        schema_version = getattr(loaded.config, "config_version", None)
    except ConfigError as exc:
        problems.extend(_config_errors(exc, "train_config"))
    except Exception as exc:  # a config-layer bug must not become a 500 for the user
        logger.exception("train config check crashed")
        problems.append(FieldProblem("train_config", f"could not be checked: {exc}"))
    try:
        backends = load_data_backends(list(data_backends), resolution=resolution, resolution_type=resolution_type)
        warnings.extend(str(w) for w in backends.warnings or [])
    except ConfigError as exc:
        problems.extend(_config_errors(exc, "data_backends"))
    except Exception as exc:
        logger.exception("data backend check crashed")
        problems.append(FieldProblem("data_backends", f"could not be checked: {exc}"))
    if problems:
        raise InvalidConfig(problems)
    return Checked(
        train_config=json.loads(json.dumps(dict(train_config))),
        data_backends=json.loads(json.dumps(list(data_backends))),
        prompt_library=dict(prompt_library) if prompt_library is not None else None,
        frozen=frozen,
        warnings=warnings,
        schema_version=schema_version if isinstance(schema_version, int) else None,
    )


def absolutize_backends(data_backends: list, base: Path) -> list:
    """Data backends with relative local paths made absolute against ``base`` (the job's working dir)."""
    out = []
    for entry in data_backends:
        if not isinstance(entry, Mapping) or str(entry.get("type", "local")).lower() in REMOTE_BACKENDS:
            out.append(entry)
            continue
        new = dict(entry)
        for k, v in entry.items():
            if isinstance(v, str) and v and _is_path_key(k) and not _looks_like_url(v):
                p = Path(os.path.expanduser(v))
                new[k] = str(p if p.is_absolute() else (base / p))
        out.append(new)
    return out
