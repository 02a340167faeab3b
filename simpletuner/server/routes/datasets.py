"""Datasets: folders of uploads under the server's data dir and folders the user allowed; their files,
captions and scan; plus browsing and scanning folders under the allowed roots, and checking a data backend list.
"""

from __future__ import annotations

import mimetypes
import os
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Path as PathParam, Query, Request, Response, UploadFile, status
from fastapi.responses import FileResponse
from sqlalchemy import select

from simpletuner.config.buckets import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from simpletuner.config.scan import check_dataset, image_size, media_files

from .. import deps, library
from ..db import DatasetRow
from ..schemas import (CONFLICT, ERRORS, NAME_PATTERN, NOT_FOUND, CaptionBody, DataBackendsBody, DatasetCreate,
                       DatasetDetail, DatasetFile, DatasetOut, DatasetScan, DirEntry, DirListing, UploadOut,
                       ValidateOut)
from ..validation import FieldProblem, InvalidConfig, check_paths, within_roots

router = APIRouter(prefix="/api/datasets", tags=["datasets"], responses=ERRORS)
PathQuery = Annotated[str | None, Query(max_length=4096, description="absolute, or relative to the server's working dir")]
Name = Annotated[str, PathParam(pattern=NAME_PATTERN, max_length=200)]
MEDIA = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
RESERVED = {"browse", "scan", "validate"}


def _resolve(request: Request, path: str | None) -> Path:
    s = deps.settings(request)
    roots = s.resolved_allowed_roots()
    if not path:
        return s.workdir
    if "\x00" in path or not within_roots(path, roots, s.workdir):
        raise InvalidConfig([FieldProblem("path", outside_roots_message(path, roots))])
    p = Path(os.path.expanduser(path))
    return Path(os.path.realpath(p if p.is_absolute() else s.workdir / p))


def outside_roots_message(path: str, roots: list[Path]) -> str:
    return (f"{path!r} is outside the allowed roots ({', '.join(map(str, roots))}); to use it, start the server with "
            f"--allowed-root {path} (repeat --allowed-root for each folder)")


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
                if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS:
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
    files = media_files(folder, video=True) if recursive else sorted(
        p for p in folder.iterdir() if p.suffix.lower() in MEDIA and p.is_file())
    out.subdirs = sum(1 for _ in folder.rglob("*") if _.is_dir()) if recursive else 0
    out.images = sum(1 for p in files if p.suffix.lower() in IMAGE_EXTENSIONS)
    out.videos = len(files) - out.images
    out.images_with_captions = sum(1 for p in files if p.with_suffix(".txt").is_file())
    out.captions = sum(1 for _ in folder.rglob("*.txt")) if recursive else sum(1 for _ in folder.glob("*.txt"))
    out.examples = [str(p.relative_to(folder)) for p in files[:8]]
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


# ---- datasets the UI manages ------------------------------------------------------------------------------------
def uploads_dir(request: Request) -> Path:
    return deps.settings(request).data_dir / "datasets"


def _dataset_out(row: DatasetRow) -> DatasetOut:
    folder = Path(row.path)
    exists = _is_dir(folder)
    files = media_files(folder, video=True) if exists else []
    return DatasetOut(name=row.name, path=row.path, uploaded=row.uploaded, exists=exists, created_at=row.created_at,
                      files=len(files), captioned=sum(1 for p in files if p.with_suffix(".txt").is_file()))


def _row(request: Request, name: str) -> DatasetRow:
    with deps.db(request).session() as s:
        row = s.scalar(select(DatasetRow).where(DatasetRow.name == name))
    if row is None:
        raise deps.not_found(f"dataset {name!r}")
    return row


def _folder(request: Request, row: DatasetRow) -> Path:
    """The dataset's folder, checked against the allowed roots where it is used (the roots may have changed)."""
    s = deps.settings(request)
    if not within_roots(row.path, s.resolved_allowed_roots(), s.workdir):
        raise InvalidConfig([FieldProblem("path", outside_roots_message(row.path, s.resolved_allowed_roots()))])
    return Path(os.path.realpath(row.path))


@router.get("", response_model=list[DatasetOut], summary="Datasets: uploaded folders and allowed folders")
def list_datasets(request: Request) -> list[DatasetOut]:
    with deps.db(request).session() as s:
        rows = list(s.scalars(select(DatasetRow).order_by(DatasetRow.name)))
    return [_dataset_out(r) for r in rows]


@router.post("", response_model=DatasetOut, status_code=status.HTTP_201_CREATED, responses=CONFLICT,
             summary="Create a dataset: an empty folder for uploads, or (with path) a folder under the allowed roots")
def create_dataset(body: DatasetCreate, request: Request) -> DatasetOut:
    s = deps.settings(request)
    if body.name in RESERVED:
        raise InvalidConfig([FieldProblem("name", f"{body.name!r} names an API route; choose another name")])
    if body.path:
        roots = s.resolved_allowed_roots()
        if "\x00" in body.path or not within_roots(body.path, roots, s.workdir):
            raise InvalidConfig([FieldProblem("path", outside_roots_message(body.path, roots))])
        folder = _resolve(request, body.path)
        if not _is_dir(folder):
            raise InvalidConfig([FieldProblem("path", f"folder {body.path!r} does not exist")])
        uploaded = False
    else:
        folder = uploads_dir(request) / body.name
        uploaded = True
    with deps.db(request).session(write=True) as session:
        if session.scalar(select(DatasetRow.id).where(DatasetRow.name == body.name)) is not None:
            raise HTTPException(409, f"dataset {body.name!r} already exists")
        if uploaded:
            folder.mkdir(parents=True, exist_ok=True)
        row = DatasetRow(name=body.name, path=str(folder), uploaded=uploaded)
        session.add(row)
        session.flush()
        return _dataset_out(row)


@router.get("/{name}", response_model=DatasetDetail, responses=NOT_FOUND,
            summary="A dataset's files with their captions and sizes, and what training will make of them")
def get_dataset(
    name: Name, request: Request,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    resolution: Annotated[float, Query(gt=0, le=100_000)] = 1024,
    resolution_type: Annotated[str, Query(pattern="^(pixel|area|pixel_area)$")] = "pixel_area",
    minimum_image_size: Annotated[float | None, Query(gt=0, le=100_000)] = None,
    train_batch_size: Annotated[int, Query(ge=1, le=65_536)] = 1,
    model_family: Annotated[str, Query(max_length=100)] = "flux",
) -> DatasetDetail:
    from pydantic import ValidationError

    from simpletuner.config import ConfigError, DatasetBackend, get_family
    from simpletuner.config.errors import errors_from_validation

    row = _row(request, name)
    folder = _folder(request, row)
    try:
        family = get_family(model_family)
        dataset = DatasetBackend.model_validate({
            "id": name, "instance_data_dir": str(folder), "resolution": resolution,
            "resolution_type": resolution_type, "minimum_image_size": minimum_image_size})
    except ConfigError as exc:
        raise InvalidConfig([FieldProblem(e.path, e.message) for e in exc.errors]) from None
    except ValidationError as exc:  # e.g. a resolution past the largest the schema takes
        raise InvalidConfig([FieldProblem(e.path, e.message) for e in errors_from_validation(exc)]) from None
    found = check_dataset(dataset, dataset, family=family, batch_size=train_batch_size, base=folder,
                          roots=deps.settings(request).resolved_allowed_roots())
    files = media_files(folder, video=True) if folder.is_dir() else []
    items = []
    for p in files[offset:offset + limit]:
        size = image_size(p) if p.suffix.lower() in IMAGE_EXTENSIONS else None
        items.append(DatasetFile(path=p.relative_to(folder).as_posix(), caption=library.read_caption(p),
                                 kind="image" if p.suffix.lower() in IMAGE_EXTENSIONS else "video",
                                 width=size[0] if size else None, height=size[1] if size else None,
                                 bytes=p.stat().st_size))
    return DatasetDetail(**_dataset_out(row).model_dump(), items=items, total=len(files), offset=offset,
                         scan=found.to_dict())


@router.post("/{name}/files", response_model=UploadOut, responses={**NOT_FOUND, 413: {"description": "too large"}},
             summary="Upload images, videos, caption .txt files or zips of them into the dataset's folder")
def upload(name: Name, request: Request, files: Annotated[list[UploadFile], File(description="the files")]
           ) -> UploadOut:
    row = _row(request, name)
    folder = _folder(request, row)
    if not _is_dir(folder):
        raise InvalidConfig([FieldProblem("path", f"the dataset's folder {row.path} does not exist")])
    s = deps.settings(request)
    result = library.UploadResult()
    for f in files:
        library.save_upload(folder, f.filename or "", f.file, max_bytes=s.max_upload_bytes,
                            max_zip_bytes=4 * s.max_upload_bytes, result=result)
    return UploadOut(saved=result.saved, skipped=result.skipped)


@router.get("/{name}/files/{path:path}", response_class=FileResponse, responses={
    **NOT_FOUND, 200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}, "description": "the file"}},
    summary="One image or video of the dataset (the UI's thumbnails)")
def get_file(name: Name, path: str, request: Request) -> FileResponse:
    folder = _folder(request, _row(request, name))
    try:
        target = library.inside(folder, library.safe_relpath(path))
    except library.UploadRefused:
        raise deps.not_found(f"file {path!r} of dataset {name!r}") from None
    if not target.is_file() or target.suffix.lower() not in MEDIA:
        raise deps.not_found(f"file {path!r} of dataset {name!r}")
    media_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    return FileResponse(target, media_type=media_type, headers={"X-Content-Type-Options": "nosniff"})


@router.put("/{name}/captions/{path:path}", response_model=DatasetFile, responses=NOT_FOUND,
            summary="Set the caption (.txt beside it) of one image")
def put_caption(name: Name, path: str, body: CaptionBody, request: Request) -> DatasetFile:
    folder = _folder(request, _row(request, name))
    try:
        library.inside(folder, library.safe_relpath(path))
    except library.UploadRefused:
        raise deps.not_found(f"file {path!r} of dataset {name!r}") from None
    try:
        library.write_caption(folder, path, body.caption)
        target = library.inside(folder, library.safe_relpath(path))
    except FileNotFoundError:
        raise deps.not_found(f"file {path!r} of dataset {name!r}") from None
    except library.UploadRefused as exc:
        raise InvalidConfig([FieldProblem("caption", str(exc))]) from None
    size = image_size(target)
    return DatasetFile(path=target.relative_to(folder).as_posix(), caption=library.read_caption(target),
                       kind="image" if target.suffix.lower() in IMAGE_EXTENSIONS else "video",
                       width=size[0] if size else None, height=size[1] if size else None,
                       bytes=target.stat().st_size)


@router.delete("/{name}/files/{path:path}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND,
               summary="Remove one image (and its caption file) from the dataset's folder")
def delete_file(name: Name, path: str, request: Request) -> Response:
    folder = _folder(request, _row(request, name))
    try:
        library.remove_file(folder, path)
    except (FileNotFoundError, library.UploadRefused):
        raise deps.not_found(f"file {path!r} of dataset {name!r}") from None
    return Response(status_code=status.HTTP_204_NO_CONTENT)
