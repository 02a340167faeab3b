"""Named configs with a version history: /api/configs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path as FsPath
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from sqlalchemy import delete, func, select

from .. import deps
from ..db import ConfigRow, ConfigVersionRow, now
from ..schemas import (
    CONFLICT,
    ERRORS,
    NAME_PATTERN,
    NOT_FOUND,
    ConfigBody,
    ConfigCreate,
    ConfigFileOut,
    ConfigImport,
    ConfigOut,
    ConfigSummary,
    ConfigUpdate,
    ConfigVersionOut,
    ConfigVersionSummary,
    ValidateOut,
)
from ..validation import FieldProblem, InvalidConfig

router = APIRouter(prefix="/api/configs", tags=["configs"], responses=ERRORS)
Name = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]
Version = Annotated[int, Path(ge=1, le=2**31)]


def _family(train_config: dict) -> str | None:
    for key in ("model_family", "--model_family"):
        if isinstance(train_config.get(key), str):
            return train_config[key]
    return None


def _version_out(v: ConfigVersionRow) -> ConfigVersionOut:
    return ConfigVersionOut(version=v.version, schema_version=v.schema_version, comment=v.comment,
                            created_at=v.created_at, train_config=v.train_config,
                            data_backends=v.data_backends, prompt_library=v.prompt_library)


def _config_out(c: ConfigRow, v: ConfigVersionRow, warnings: list[str] | None = None) -> ConfigOut:
    return ConfigOut(name=c.name, description=c.description, current_version=c.current_version,
                     created_at=c.created_at, updated_at=c.updated_at, model_family=_family(v.train_config),
                     latest=_version_out(v), warnings=warnings or [])


def load_version(session, name: str, version: int | None = None) -> tuple[ConfigRow, ConfigVersionRow] | None:
    cfg = session.scalar(select(ConfigRow).where(ConfigRow.name == name))
    if cfg is None:
        return None
    ver = session.scalar(select(ConfigVersionRow).where(
        ConfigVersionRow.config_id == cfg.id, ConfigVersionRow.version == (version or cfg.current_version)))
    return (cfg, ver) if ver is not None else None


@router.get("", response_model=list[ConfigSummary], summary="List stored configs")
def list_configs(request: Request) -> list[ConfigSummary]:
    with deps.db(request).session() as s:
        rows = s.execute(
            select(ConfigRow, ConfigVersionRow)
            .join(ConfigVersionRow, (ConfigVersionRow.config_id == ConfigRow.id)
                  & (ConfigVersionRow.version == ConfigRow.current_version))
            .order_by(ConfigRow.name)
        ).all()
    return [ConfigSummary(name=c.name, description=c.description, current_version=c.current_version,
                          created_at=c.created_at, updated_at=c.updated_at, model_family=_family(v.train_config))
            for c, v in rows]


@router.post("/validate", response_model=ValidateOut, summary="Check a config without storing it")
def validate_config(body: ConfigBody, request: Request) -> ValidateOut:
    try:
        checked = deps.check(request, body.train_config, body.data_backends, body.prompt_library)
    except InvalidConfig as exc:
        return ValidateOut(valid=False, errors=[{"path": e.path, "message": e.message} for e in exc.errors],
                           data=exc.data)
    return ValidateOut(valid=True, warnings=checked.warnings, data=checked.data)


def _store_new(request: Request, name: str, description: str, comment: str, checked) -> ConfigOut:
    with deps.db(request).session(write=True) as s:
        if s.scalar(select(ConfigRow.id).where(ConfigRow.name == name)) is not None:
            raise HTTPException(409, f"config {name!r} already exists (PUT /api/configs/{name} adds a version)")
        cfg = ConfigRow(name=name, description=description, current_version=1)
        s.add(cfg)
        s.flush()
        ver = ConfigVersionRow(config_id=cfg.id, version=1, schema_version=checked.schema_version,
                               train_config=checked.train_config, data_backends=checked.data_backends,
                               prompt_library=checked.prompt_library, comment=comment)
        s.add(ver)
        s.flush()
        return _config_out(cfg, ver, checked.warnings)


@router.post("", response_model=ConfigOut, status_code=status.HTTP_201_CREATED, responses=CONFLICT,
             summary="Store a new named config (version 1)")
def create_config(body: ConfigCreate, request: Request) -> ConfigOut:
    checked = deps.check(request, body.train_config, body.data_backends, body.prompt_library)
    return _store_new(request, body.name, body.description, body.comment, checked)


_SKIP_DIRS = {"output", "cache", "runs", "node_modules", "__pycache__", "site-packages"}


@router.get("/files", response_model=list[ConfigFileOut],
            summary="config.json files in the server's working dir (e.g. written by simpletuner configure)")
def config_files(request: Request) -> list[ConfigFileOut]:
    root = deps.settings(request).workdir
    found: list[ConfigFileOut] = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(FsPath(dirpath).relative_to(root).parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS and depth < 3)
        if "config.json" in filenames:
            path = FsPath(dirpath) / "config.json"
            rel = path.relative_to(root)
            suggested = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(rel.parts[:-1]) or root.name).strip("-.") or "imported"
            found.append(ConfigFileOut(path=str(rel), suggested_name=suggested[:200], modified=path.stat().st_mtime))
        if len(found) >= 200:
            break
    return found


@router.post("/import", response_model=ConfigOut, status_code=status.HTTP_201_CREATED, responses=CONFLICT,
             summary="Store a config.json from the server's disk as it is (its datasets from its "
                     "data_backend_config, or a multidatabackend.json beside it)")
def import_config(body: ConfigImport, request: Request) -> ConfigOut:
    from simpletuner.config import data_backend_beside, paths

    s = deps.settings(request)
    problem = paths.problem(body.path, s.resolved_allowed_roots(), s.workdir, "file")
    if problem:
        raise InvalidConfig([FieldProblem("path", problem)])
    real = FsPath(paths.resolve(body.path, s.workdir))
    try:
        train_config = json.loads(real.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidConfig([FieldProblem("path", f"file {body.path!r} not found")]) from None
    except (OSError, ValueError) as exc:
        raise InvalidConfig([FieldProblem("path", f"file {body.path!r} could not be read: {exc}")]) from None
    if not isinstance(train_config, dict):
        raise InvalidConfig([FieldProblem("path", f"file {body.path!r} does not hold a JSON object")])
    named = any(k.lstrip("-") == "data_backend_config" for k in train_config)
    beside = None if named else data_backend_beside(real)
    if beside:
        train_config = {**train_config, "data_backend_config": beside}
    checked = deps.check(request, train_config, [], None)
    return _store_new(request, body.name, body.description, f"imported from {body.path}", checked)


@router.get("/{name}", response_model=ConfigOut, responses=NOT_FOUND, summary="A config's newest version")
def get_config(name: Name, request: Request) -> ConfigOut:
    with deps.db(request).session() as s:
        found = load_version(s, name)
    if found is None:
        raise deps.not_found(f"config {name!r}")
    return _config_out(*found)


@router.put("/{name}", response_model=ConfigOut, summary="Store a new version (creates the config if new)",
            responses={201: {"model": ConfigOut, "description": "created"}})
def update_config(name: Name, body: ConfigUpdate, request: Request, response: Response) -> ConfigOut:
    checked = deps.check(request, body.train_config, body.data_backends, body.prompt_library)
    with deps.db(request).session(write=True) as s:
        cfg = s.scalar(select(ConfigRow).where(ConfigRow.name == name))
        if cfg is None:
            cfg = ConfigRow(name=name, description=body.description or "", current_version=0)
            s.add(cfg)
            s.flush()
            response.status_code = status.HTTP_201_CREATED
        latest = s.scalar(select(func.coalesce(func.max(ConfigVersionRow.version), 0))
                          .where(ConfigVersionRow.config_id == cfg.id))
        ver = ConfigVersionRow(config_id=cfg.id, version=latest + 1, schema_version=checked.schema_version,
                               train_config=checked.train_config, data_backends=checked.data_backends,
                               prompt_library=checked.prompt_library, comment=body.comment)
        s.add(ver)
        cfg.current_version = latest + 1
        cfg.updated_at = now()
        if body.description is not None:
            cfg.description = body.description
        s.flush()
        return _config_out(cfg, ver, checked.warnings)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND,
               summary="Delete a config and its versions (jobs keep their frozen copy)")
def delete_config(name: Name, request: Request) -> Response:
    with deps.db(request).session(write=True) as s:
        cfg = s.scalar(select(ConfigRow).where(ConfigRow.name == name))
        if cfg is None:
            raise deps.not_found(f"config {name!r}")
        s.execute(delete(ConfigVersionRow).where(ConfigVersionRow.config_id == cfg.id))
        s.delete(cfg)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{name}/versions", response_model=list[ConfigVersionSummary], responses=NOT_FOUND,
            summary="A config's version history, newest first")
def list_versions(name: Name, request: Request) -> list[ConfigVersionSummary]:
    with deps.db(request).session() as s:
        cfg = s.scalar(select(ConfigRow).where(ConfigRow.name == name))
        if cfg is None:
            raise deps.not_found(f"config {name!r}")
        rows = s.scalars(select(ConfigVersionRow).where(ConfigVersionRow.config_id == cfg.id)
                         .order_by(ConfigVersionRow.version.desc()))
        return [ConfigVersionSummary(version=v.version, schema_version=v.schema_version, comment=v.comment,
                                     created_at=v.created_at) for v in rows]


@router.get("/{name}/versions/{version}", response_model=ConfigVersionOut, responses=NOT_FOUND,
            summary="One version of a config")
def get_version(name: Name, version: Version, request: Request) -> ConfigVersionOut:
    with deps.db(request).session() as s:
        found = load_version(s, name, version)
    if found is None:
        raise deps.not_found(f"config {name!r} version {version}")
    return _version_out(found[1])
