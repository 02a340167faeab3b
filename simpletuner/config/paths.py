"""Which config fields are local paths, and whether a path stays inside the allowed roots.

A path is judged by what it resolves to (``~`` expanded, relative to its base, ``..`` and every symlink followed
with ``os.path.realpath``), never by how it is spelled. The server checks every path field of both configs when
a config is submitted; a job carries its allowed roots (``SIMPLETUNER_ALLOWED_ROOTS``) and the trainer checks
again when it opens them, so a symlink swapped in after the submit cannot lead outside either.

Path fields are marked in the schemas (``json_schema_extra={"path": kind}``): ``dir`` and ``file`` are local
paths; ``model`` is a local folder or a Hugging Face repo id; ``webhook`` and ``json`` are JSON text or a JSON file
(``json`` also the parsed object);
``subfolder`` is a name joined onto another folder (no ``..``, never absolute).
Standard library only: the server, the trainer and the data layer all use it.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOTS_ENV = "SIMPLETUNER_ALLOWED_ROOTS"
KINDS = ("dir", "file", "model", "webhook", "json", "subfolder")
# huggingface_hub's repo id rule: "name" or "org/name", no "--" or ".." and no leading/trailing "-" or ".".
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?$")


class PathOutsideRoots(ValueError):
    """A path field that resolves outside the allowed roots (or is no usable path); names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class PathField:
    name: str
    kind: str  # "dir" | "file" | "model" | "webhook" | "json" | "subfolder"
    # what a relative path is read from: "workdir" (the working dir), "output_dir" (logging_dir), or "either"
    # (resume_from_checkpoint: the working dir if it exists there, else output_dir; both readings are checked)
    base: str = "workdir"

    def __post_init__(self):
        _check_kind(self.kind)
        if self.base not in ("workdir", "output_dir", "either"):
            raise ValueError(f"{self.name}: unknown path base {self.base!r}; one of workdir, output_dir, either")


def _check_kind(kind: str) -> None:
    """A kind nobody handles would be checked as a plain folder; a misspelt one is a programming error."""
    if kind not in KINDS:
        raise ValueError(f"unknown path kind {kind!r}; one of {', '.join(KINDS)}")


def path_fields(model: Any) -> dict[str, PathField]:
    """The path-typed fields of a pydantic model class, by field name."""
    out = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, Mapping) else {}
        kind = extra.get("path")
        if kind:
            out[name] = PathField(name, kind, extra.get("path_base", "workdir"))
    return out


def nested_path_fields(model: Any) -> dict[str, dict[str, PathField]]:
    """Path fields of the nested blocks of a model class (``distillation.prompt_file``): block name -> the path
    fields of the block's model, named ``<block>.<field>``."""
    out = {}
    for name, info in model.model_fields.items():
        for inner in _annotation_classes(info.annotation):
            fields = path_fields(inner)
            if fields:
                out[name] = {sub: PathField(f"{name}.{sub}", spec.kind, spec.base) for sub, spec in fields.items()}
    return out


def _annotation_classes(annotation: Any) -> list[type]:
    """The model classes (anything with ``model_fields``) an annotation such as ``Optional[Block]`` holds."""
    found, stack = [], [annotation]
    while stack:
        ann = stack.pop()
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            found.append(ann)
        stack.extend(getattr(ann, "__args__", ()) or ())
    return found


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and ".." not in value and "--" not in value


def resolve(value: str, base: str | os.PathLike[str]) -> str:
    """What ``value`` names on disk: ``~`` expanded, relative to ``base``, symlinks and ``..`` resolved.
    ValueError for a value that cannot be a path (a NUL byte)."""
    if "\x00" in value:
        raise ValueError("contains a NUL byte")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        path = os.path.join(os.fspath(base), path)
    return os.path.realpath(path)


def within(real: str, roots: list[Path]) -> bool:
    """True when the resolved path ``real`` is one of ``roots`` or inside one."""
    return any(real == str(r) or real.startswith(str(r).rstrip(os.sep) + os.sep) for r in roots)


def problem(value: Any, roots: list[Path], base: str | os.PathLike[str], kind: str = "dir") -> str | None:
    """Why ``value`` may not be used as a path of this ``kind`` under ``roots``, or None when it may."""
    _check_kind(kind)
    if value is None or value == "":
        return None
    if kind == "json" and isinstance(value, (dict, list)):
        return None  # the object itself, not a file
    if not isinstance(value, str):
        return f"expected a path string, got {type(value).__name__}"
    if kind in ("webhook", "json") and value.lstrip().startswith(("{", "[")):
        return None  # inline JSON, not a file
    if kind == "subfolder":  # a name inside another folder: never absolute, never climbing out
        parts = value.replace("\\", "/").split("/")
        folded = unicodedata.normalize("NFKC", value)
        if "\x00" in value or value.startswith(("/", "~")) or ".." in parts or folded != value and ".." in folded:
            return f"{value!r} must be a plain relative name (no '..', no leading '/' or '~')"
        return None
    if kind == "model" and is_hub_id(value) and not os.path.lexists(os.path.join(os.fspath(base), value)):
        return None  # a Hugging Face repo id (no local folder of that name)
    shown = ", ".join(map(str, roots))
    try:
        real = resolve(value, base)
    except (ValueError, OSError) as exc:
        return f"{value!r} is not a usable path ({exc})"
    if not within(real, roots):
        return f"{value!r} resolves to {real}, outside the allowed roots ({shown})"
    folded = unicodedata.normalize("NFKC", value)
    if folded != value:  # a lookalike of "..", "/" or "~" that some tool might fold into the real thing
        try:
            folded_real = resolve(folded, base)
        except (ValueError, OSError):
            folded_real = None
        if folded_real is None or not within(folded_real, roots):
            return f"{value!r} looks like {folded!r}, which is outside the allowed roots ({shown})"
    return None


def field_problem(spec: PathField, value: Any, roots: list[Path], workdir: str | os.PathLike[str],
                  output_dir: str | os.PathLike[str] | None) -> str | None:
    """``problem`` for a path field, read from every base the trainer may read it from."""
    if spec.name == "resume_from_checkpoint" and value == "latest":
        return None
    bases = {"workdir": [workdir], "output_dir": [output_dir], "either": [workdir, output_dir]}[spec.base]
    for base in bases:
        if base is not None:
            message = problem(value, roots, base, spec.kind)
            if message:
                return message
    return None


def check(field: str, value: Any, roots: list[Path], base: str | os.PathLike[str], kind: str = "dir") -> None:
    """Raise PathOutsideRoots naming ``field`` unless ``value`` is allowed (see ``problem``)."""
    message = problem(value, roots, base, kind)
    if message:
        raise PathOutsideRoots(field, message)


def config_paths(config: Any = None, backends: Any = None) -> Iterator[tuple[str, Any, PathField]]:
    """(field path, value, PathField) for every path field of a validated TrainConfig and its DataBackends."""
    for name, spec in (path_fields(type(config)) if config is not None else {}).items():
        value = getattr(config, name)
        if spec.kind in ("webhook", "json") and not isinstance(value, str):
            continue  # already parsed into objects; nothing to open
        if spec.name == "resume_from_checkpoint" and value == "latest":
            continue
        yield name, value, spec
    for block, fields in (nested_path_fields(type(config)) if config is not None else {}).items():
        inner = getattr(config, block)
        if inner is not None:
            for name, spec in fields.items():
                yield spec.name, getattr(inner, name), spec
    if backends is not None:
        for entry in [*backends.datasets, backends.text_embeds]:
            for name, spec in path_fields(type(entry)).items():
                yield f"datasets[{entry.id}].{name}", getattr(entry, name), spec


def roots_from_env(environ: Mapping[str, str] | None = None) -> list[Path] | None:
    """The allowed roots a server gave its job (``SIMPLETUNER_ALLOWED_ROOTS``: a JSON list), or None when the
    trainer runs on its own (``simpletuner train``: the user's own files, no roots)."""
    raw = (environ if environ is not None else os.environ).get(ROOTS_ENV)
    if not raw:
        return None
    roots = json.loads(raw)
    if not isinstance(roots, list) or not all(isinstance(r, str) for r in roots):
        raise ValueError(f"{ROOTS_ENV} must be a JSON list of folders")
    return [Path(os.path.realpath(r)) for r in roots]


def roots_env_value(roots: list[Path]) -> str:
    return json.dumps([str(r) for r in roots])


def guard_open(field: str, path: str | os.PathLike[str], kind: str = "dir") -> None:
    """At open time, in a server's job: PathOutsideRoots unless ``path`` resolves inside the job's roots.
    Does nothing outside a server job."""
    roots = roots_from_env()
    if roots is not None:
        check(field, os.fspath(path), roots, os.getcwd(), kind)
