"""Jobs: submit, list, inspect, reprioritise, cancel, logs and run-dir files: /api/jobs."""

from __future__ import annotations

import os
from pathlib import Path as FsPath
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, status
from fastapi.responses import FileResponse, PlainTextResponse
from sqlalchemy import delete, func, select

from .. import deps
from ..db import FINISHED, JobEventRow, JobRow
from ..pairs import check_dependency
from ..queue import RetryConflict
from ..schemas import (CONFLICT, ERRORS, MAX_ID, NOT_FOUND, FileOut, JobCreate, JobDetail, JobList, JobOut, JobPatch,
                       JobRetry)
from ..validation import FieldProblem, InvalidConfig
from .configs import load_version

router = APIRouter(prefix="/api/jobs", tags=["jobs"], responses=ERRORS)
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]
OUT_FIELDS = set(JobOut.model_fields) - {"queue_position", "warnings"}
DETAIL_FIELDS = OUT_FIELDS | {"train_config", "data_backends", "prompt_library"}


def _positions(session) -> dict[int, int]:
    ids = session.scalars(select(JobRow.id).where(JobRow.status == "queued")
                          .order_by(JobRow.priority.desc(), JobRow.submitted_at, JobRow.id))
    return {job_id: i + 1 for i, job_id in enumerate(ids)}


def job_out(job: JobRow, positions: dict[int, int] | None = None, detail: bool = False,
            warnings: list[str] | None = None) -> JobOut:
    fields = DETAIL_FIELDS if detail else OUT_FIELDS
    data = {f: getattr(job, f) for f in fields}
    data["queue_position"] = (positions or {}).get(job.id)
    data["warnings"] = warnings or []
    return (JobDetail if detail else JobOut)(**data)


def _get(session, job_id: int) -> JobRow:
    job = session.get(JobRow, job_id)
    if job is None:
        raise deps.not_found(f"job {job_id}")
    return job


@router.post("", response_model=JobOut, status_code=status.HTTP_201_CREATED, responses=NOT_FOUND,
             summary="Queue a training job")
def submit_job(body: JobCreate, request: Request) -> JobOut:
    mgr = deps.manager(request)
    if body.config_name is not None:
        with deps.db(request).session() as s:
            found = load_version(s, body.config_name, body.config_version)
        if found is None:
            version = f" version {body.config_version}" if body.config_version else ""
            raise deps.not_found(f"config {body.config_name!r}{version}")
        cfg, ver = found
        train_config, data_backends = dict(ver.train_config), list(ver.data_backends)
        prompt_library = body.prompt_library if body.prompt_library is not None else ver.prompt_library
        config_name, config_version = cfg.name, ver.version
    else:
        train_config, data_backends = dict(body.train_config or {}), list(body.data_backends or [])
        prompt_library, config_name, config_version = body.prompt_library, None, None
    problem = mgr.capacity_problem(body.num_processes, body.num_machines)
    if problem:
        raise InvalidConfig([FieldProblem("num_processes", problem)])
    # overrides win over every spelling of their key (--key, TRAINER_EXTRA_ARGS), as on the command line
    checked = deps.check(request, train_config, data_backends, prompt_library, overrides=body.overrides)
    with deps.db(request).session() as s:
        checked.warnings += check_dependency(s, kind=body.kind, depends_on=body.depends_on,
                                             frozen=checked.frozen or checked.train_config,
                                             data_backends=checked.data_backends, workdir=mgr.settings.workdir)
    job = mgr.submit(
        name=body.name or config_name or "",
        config_name=config_name,
        config_version=config_version,
        train_config=checked.frozen or checked.train_config,  # frozen: later default changes don't apply
        data_backends=checked.data_backends,
        prompt_library=checked.prompt_library,
        priority=body.priority,
        num_processes=body.num_processes,
        num_machines=body.num_machines,
        retry_on_restart=body.retry_on_restart,
        max_retries=body.max_retries,
        kind=body.kind,
        depends_on=body.depends_on,
        reason=f"waits for cache job {body.depends_on}" if body.depends_on else None,
    )
    with deps.db(request).session() as s:
        return job_out(_get(s, job.id), _positions(s), warnings=checked.warnings)


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    request: Request,
    status_: Annotated[list[Literal["queued", "running", "succeeded", "failed", "cancelled"]] | None,
                       Query(alias="status", description="filter; repeat for several")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> JobList:
    with deps.db(request).session() as s:
        q = select(JobRow)
        count = select(func.count(JobRow.id))
        if status_:
            q = q.where(JobRow.status.in_(status_))
            count = count.where(JobRow.status.in_(status_))
        rows = list(s.scalars(q.order_by(JobRow.id.desc()).limit(limit).offset(offset)))
        positions = _positions(s)
        total = s.scalar(count)
    return JobList(jobs=[job_out(j, positions) for j in rows], total=total)


@router.get("/{job_id}", response_model=JobDetail, responses=NOT_FOUND, summary="One job, with its frozen config")
def get_job(job_id: JobId, request: Request) -> JobDetail:
    with deps.db(request).session() as s:
        return job_out(_get(s, job_id), _positions(s), detail=True)


@router.patch("/{job_id}", response_model=JobOut, responses={**NOT_FOUND, **CONFLICT},
              summary="Change a queued job's priority or name")
def patch_job(job_id: JobId, body: JobPatch, request: Request) -> JobOut:
    with deps.db(request).session(write=True) as s:
        job = _get(s, job_id)
        if body.priority is not None:
            if job.status != "queued":
                raise HTTPException(409, f"job {job_id} is {job.status}; only queued jobs can be reprioritised")
            job.priority = body.priority
        if body.name is not None:
            job.name = body.name
        s.flush()
        out = job_out(job, _positions(s))
    deps.manager(request).wake()
    return out


@router.post("/{job_id}/cancel", response_model=JobOut, responses={**NOT_FOUND, **CONFLICT},
             summary="Cancel: a queued job at once, a running one with SIGTERM (then SIGKILL)")
def cancel_job(job_id: JobId, request: Request) -> JobOut:
    mgr = deps.manager(request)
    with deps.db(request).session() as s:
        job = _get(s, job_id)
    if job.status in FINISHED:
        raise HTTPException(409, f"job {job_id} already {job.status}")
    mgr.cancel(job_id)
    with deps.db(request).session() as s:
        return job_out(_get(s, job_id), _positions(s))


@router.post("/{job_id}/retry", response_model=JobOut, responses={**NOT_FOUND, **CONFLICT},
             summary="Retry a finished job: the same run continues from its newest valid checkpoint "
                     "(or starts over)")
def retry_job(job_id: JobId, request: Request, body: JobRetry | None = None) -> JobOut:
    try:
        job = deps.manager(request).retry(job_id, start_over=bool(body and body.start_over))
    except RetryConflict as exc:
        raise HTTPException(409, str(exc)) from None
    if job is None:
        raise deps.not_found(f"job {job_id}")
    with deps.db(request).session() as s:
        return job_out(job, _positions(s))  # as re-queued (the scheduler may have started it already)


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT},
               summary="Forget a finished job (its run dir stays on disk)")
def delete_job(job_id: JobId, request: Request) -> Response:
    with deps.db(request).session(write=True) as s:
        job = _get(s, job_id)
        if job.status not in FINISHED:
            raise HTTPException(409, f"job {job_id} is {job.status}; cancel it first")
        s.execute(delete(JobEventRow).where(JobEventRow.job_id == job_id))
        s.delete(job)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{job_id}/log", response_class=PlainTextResponse, responses={
    **NOT_FOUND, 200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                       "description": "log text; X-Log-Offset is the offset to ask for next"}},
    summary="The job's train.log (the tail, or from a byte offset)")
def job_log(
    job_id: JobId,
    request: Request,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="last N lines")] = None,
    offset: Annotated[int | None, Query(ge=0, le=MAX_ID, description="bytes from this offset on")] = None,
) -> PlainTextResponse:
    with deps.db(request).session() as s:
        job = _get(s, job_id)
    path = FsPath(job.run_dir) / "train.log" if job.run_dir else None
    if path is None or not path.exists():
        return PlainTextResponse("", headers={"X-Log-Offset": "0"})
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if offset is not None:
            fh.seek(min(offset, size))
            data = fh.read(8 * 1024 * 1024)
            next_offset = min(offset, size) + len(data)
        else:
            fh.seek(max(0, size - 4 * 1024 * 1024))
            data = fh.read()
            next_offset = size
    text = data.decode("utf-8", errors="replace")
    if tail is not None and offset is None:
        text = "\n".join(text.splitlines()[-tail:]) + ("\n" if text else "")
    return PlainTextResponse(text, headers={"X-Log-Offset": str(next_offset)})


def _run_dir(request: Request, job_id: int) -> FsPath:
    with deps.db(request).session() as s:
        job = _get(s, job_id)
    if not job.run_dir:
        raise deps.not_found(f"run dir of job {job_id}")
    return FsPath(job.run_dir)


@router.get("/{job_id}/files", response_model=list[FileOut], responses=NOT_FOUND,
            summary="Files in the job's run dir (config, log, outputs, images)")
def list_files(job_id: JobId, request: Request,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 2000) -> list[FileOut]:
    root = _run_dir(request, job_id)
    out: list[FileOut] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = FsPath(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            out.append(FileOut(path=str(p.relative_to(root)), size=st.st_size, modified=st.st_mtime))
            if len(out) >= limit:
                return out
    return out


@router.get("/{job_id}/files/{path:path}", response_class=FileResponse, responses={
    **NOT_FOUND, 200: {"content": {"application/octet-stream": {}}, "description": "the file"}},
    summary="Download one file from the job's run dir")
def get_file(job_id: JobId, path: str, request: Request) -> FileResponse:
    root = _run_dir(request, job_id).resolve()
    try:
        target = (root / path).resolve()
        ok = root in target.parents and target.is_file()
    except (OSError, ValueError):  # name too long, NUL byte
        ok = False
    if not ok:
        raise deps.not_found(f"file {path!r} of job {job_id}")
    return FileResponse(target)
