"""Trainer webhooks in, events out (JSON pages and Server-Sent Events with Last-Event-ID replay)."""

from __future__ import annotations

import re
import time
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from .. import deps, events
from ..auth import require_auth
from ..db import FINISHED, JobRow
from ..schemas import ERRORS, MAX_ID, NOT_FOUND, EventList, IngestOut, WebhookEvent
from ..events import IngestError

router = APIRouter(tags=["events"])
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]
After = Annotated[int, Query(ge=0, le=MAX_ID, description="only events with id > after")]
Limit = Annotated[int, Query(ge=1, le=5000)]
SSE_RESPONSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                      "description": "Server-Sent Events; each `id:` is the event's global id"}}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


@router.post(
    "/api/jobs/{job_id}/events",
    response_model=IngestOut,
    summary="Trainer webhook (HMAC-signed; no bearer token)",
    responses={401: {"description": "unsigned"}, 403: {"description": "wrong signature"}, **NOT_FOUND,
               422: {"description": "malformed event"}, 413: {"description": "too large"}},
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": WebhookEvent.model_json_schema(ref_template="#/components/schemas/{model}")}}}},
)
async def ingest_event(
    job_id: JobId,
    request: Request,
    x_simpletuner_signature: Annotated[str | None, Header()] = None,
) -> IngestOut:
    settings = deps.settings(request)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_event_bytes:
        raise HTTPException(413, "event too large")
    body = await request.body()
    if len(body) > settings.max_event_bytes:
        raise HTTPException(413, "event too large")
    try:
        stored, row_id = await run_in_threadpool(
            events.ingest, deps.db(request), job_id, body, x_simpletuner_signature, settings.data_dir)
    except IngestError as exc:
        headers = {"WWW-Authenticate": "HMAC-SHA256"} if exc.status == 401 else None
        raise HTTPException(exc.status, exc.detail, headers=headers) from None
    if stored:
        request.app.state.broker.notify()
    return IngestOut(accepted=True, duplicate=not stored, id=row_id)


def _job_exists(request: Request, job_id: int) -> JobRow:
    with deps.db(request).session() as s:
        job = s.get(JobRow, job_id)
    if job is None:
        raise deps.not_found(f"job {job_id}")
    return job


@router.get("/api/jobs/{job_id}/events", response_model=EventList, responses={**ERRORS, **NOT_FOUND},
            dependencies=[Depends(require_auth)], summary="A job's events as JSON, oldest first")
def job_events(job_id: JobId, request: Request, after: After = 0, limit: Limit = 500,
               type: Annotated[list[str] | None, Query(max_length=50)] = None) -> EventList:
    _job_exists(request, job_id)
    rows = events.fetch(deps.db(request), job_id=job_id, after=after, limit=limit, types=type)
    return EventList(events=[events.event_out(r) for r in rows], last_id=rows[-1].id if rows else after)


@router.get("/api/events", response_model=EventList, responses=ERRORS, dependencies=[Depends(require_auth)],
            summary="Events of all jobs as JSON, oldest first")
def all_events(request: Request, after: After = 0, limit: Limit = 500,
               type: Annotated[list[str] | None, Query(max_length=50)] = None) -> EventList:
    rows = events.fetch(deps.db(request), after=after, limit=limit, types=type)
    return EventList(events=[events.event_out(r) for r in rows], last_id=rows[-1].id if rows else after)


def _status_of(db, job_id: int) -> str | None:
    with db.session() as s:
        job = s.get(JobRow, job_id)
        return job.status if job is not None else None


def _start_id(last_event_id: str | None, after: int | None, default: int) -> int:
    # ASCII digits only: str.isdigit() also takes "²" or "١", which int() then refuses (a 500)
    if last_event_id and re.fullmatch(r"[0-9]{1,19}", last_event_id.strip()):
        return min(int(last_event_id.strip()), MAX_ID)
    if after is not None:
        return after
    return default


async def _stream(request: Request, job_id: int | None, start: int, until_done: bool) -> AsyncIterator[str]:
    db = deps.db(request)
    broker = request.app.state.broker
    keepalive = deps.settings(request).sse_keepalive
    last = start
    yield "retry: 2000\n\n"
    last_sent = time.monotonic()
    async with broker.subscribe() as sub:
        while True:
            sub.clear()
            rows = await run_in_threadpool(events.fetch, db, job_id=job_id, after=last, limit=500)
            for row in rows:
                yield events.sse_frame(row)
                last = row.id
            if rows:
                last_sent = time.monotonic()
                if len(rows) == 500:
                    continue
            if until_done and job_id is not None:
                job_status = await run_in_threadpool(_status_of, db, job_id)
                if job_status is None or job_status in FINISHED:
                    tail = await run_in_threadpool(events.fetch, db, job_id=job_id, after=last, limit=500)
                    for row in tail:
                        yield events.sse_frame(row)
                    yield "event: end\ndata: {}\n\n"
                    return
            if await request.is_disconnected():
                return
            await sub.wait(1.0)  # also polls: another server sharing the database may have stored events
            if time.monotonic() - last_sent >= keepalive:
                yield ": keepalive\n\n"
                last_sent = time.monotonic()


@router.get("/api/jobs/{job_id}/stream", response_class=StreamingResponse,
            responses={**SSE_RESPONSE, **ERRORS, **NOT_FOUND}, dependencies=[Depends(require_auth)],
            summary="A job's events as Server-Sent Events (replays from the start or Last-Event-ID)")
async def job_stream(
    job_id: JobId,
    request: Request,
    last_event_id: Annotated[str | None, Header(max_length=30)] = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    until_done: Annotated[bool, Query(description="close the stream once the job has finished")] = False,
) -> StreamingResponse:
    await run_in_threadpool(_job_exists, request, job_id)
    start = _start_id(last_event_id, after, 0)
    return StreamingResponse(_stream(request, job_id, start, until_done), media_type="text/event-stream",
                             headers=SSE_HEADERS)


@router.get("/api/stream", response_class=StreamingResponse, responses={**SSE_RESPONSE, **ERRORS},
            dependencies=[Depends(require_auth)],
            summary="Events of every job as Server-Sent Events (from now, or from Last-Event-ID / ?after=)")
async def queue_stream(
    request: Request,
    last_event_id: Annotated[str | None, Header(max_length=30)] = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
) -> StreamingResponse:
    default = await run_in_threadpool(events.last_event_id, deps.db(request))
    start = _start_id(last_event_id, after, default)
    return StreamingResponse(_stream(request, None, start, False), media_type="text/event-stream",
                             headers=SSE_HEADERS)
