"""Dataset folders under the allowed roots: browse, scan, and check a data backend list."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request

from .. import deps
from ..schemas import ERRORS, DataBackendsBody, DatasetScan, DirEntry, DirListing, ValidateOut
from ..validation import FieldProblem, InvalidConfig, check_paths, within_roots

router = APIRouter(prefix="/api/datasets", tags=["datasets"], responses=ERRORS)
IMAGE_EXT = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jxl", ".avif"}
VIDEO_EXT = {".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif"}
PathQuery = Annotated[str | None, Query(max_length=4096, description="absolute, or relative to the server's working dir")]


def _resolve(request: Request, path: str | None) -> Path:
    s = deps.settings(request)
    roots = s.resolved_allowed_roots()
    if not path:
        return s.workdir
    if "\x00" in path or not within_roots(path, roots, s.workdir):
        raise InvalidConfig([FieldProblem("path", f"{path!r} is outside the allowed roots "
                                                  f"({', '.join(map(str, roots))})")])
    p = Path(os.path.expanduser(path))
    return Path(os.path.realpath(p if p.is_absolute() else s.workdir / p))


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # e.g. name too long
        return False


def _count_images(folder: Path, cap: int = 10_000) -> int:
    n = 0
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXT:
                    n += 1
                    if n >= cap:
                        break
    except OSError:
        return 0
    return n


@router.get("/browse", response_model=DirListing, summary="Sub-folders of a folder under the allowed roots")
def browse(request: Request, path: PathQuery = None) -> DirListing:
    folder = _resolve(request, path)
    roots = deps.settings(request).resolved_allowed_roots()
    entries: list[DirEntry] = []
    if _is_dir(folder):
        try:
            items = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            items = []
        for e in items[:2000]:
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir()
            except OSError:
                continue
            if is_dir:
                entries.append(DirEntry(name=e.name, path=e.path, is_dir=True, images=_count_images(Path(e.path))))
    parent = folder.parent if folder != folder.parent and any(
        folder.parent == r or r in folder.parent.parents for r in roots) else None
    return DirListing(path=str(folder), parent=str(parent) if parent else None, entries=entries)


@router.get("/scan", response_model=DatasetScan, summary="Count images, videos and caption files in a folder")
def scan(request: Request, path: Annotated[str, Query(min_length=1, max_length=4096)],
         recursive: bool = True) -> DatasetScan:
    folder = _resolve(request, path)
    out = DatasetScan(path=str(folder), exists=_is_dir(folder))
    if not out.exists:
        return out
    stems_with_caption: set[str] = set()
    media: list[Path] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        if not recursive:
            dirnames.clear()
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out.subdirs += len(dirnames)
        for name in filenames:
            seen += 1
            if seen > 200_000:
                break
            ext = os.path.splitext(name)[1].lower()
            p = Path(dirpath) / name
            if ext == ".txt":
                out.captions += 1
                stems_with_caption.add(str(p.with_suffix("")))
            elif ext in IMAGE_EXT:
                out.images += 1
                media.append(p)
            elif ext in VIDEO_EXT:
                out.videos += 1
                media.append(p)
    out.images_with_captions = sum(1 for p in media if str(p.with_suffix("")) in stems_with_caption)
    out.examples = [str(p.relative_to(folder)) for p in media[:8]]
    return out


@router.post("/validate", response_model=ValidateOut, summary="Check a multidatabackend.json list")
def validate(body: DataBackendsBody, request: Request) -> ValidateOut:
    from simpletuner.config import ConfigError, load_data_backends

    from ..validation import _config_errors

    s = deps.settings(request)
    problems = check_paths({}, body.data_backends, s.resolved_allowed_roots(), s.workdir)
    warnings: list[str] = []
    try:
        loaded = load_data_backends(list(body.data_backends))
        warnings = [str(w) for w in getattr(loaded, "warnings", []) or []]
    except ConfigError as exc:
        problems = _config_errors(exc, "data_backends") + problems
    return ValidateOut(valid=not problems, errors=[{"path": p.path, "message": p.message} for p in problems],
                       warnings=warnings)
