"""Storing trainer events (verified, idempotent on (job, attempt, seq)), folding them into the job record,
and reading them back for JSON and SSE."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import load_only

from simpletuner.config.events import verify

from .db import Database, JobEventRow, JobRow
from .schemas import EventOut, WebhookEvent

IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": ".png", b"\xff\xd8\xff": ".jpg", b"RIFF": ".webp", b"GIF8": ".gif"}
MAX_CHECKPOINTS = 50
FOLD_COLUMNS = (JobRow.id, JobRow.attempt, JobRow.webhook_secret, JobRow.run_dir, JobRow.progress,
                JobRow.results, JobRow.error)


class IngestError(Exception):
    def __init__(self, status: int, detail: str):
        self.status = status
        self.detail = detail
        super().__init__(detail)


def event_out(row: JobEventRow) -> EventOut:
    return EventOut(id=row.id, job_id=row.job_id, attempt=row.attempt, source=row.source, seq=row.seq,
                    type=row.type, time=row.time, data=row.data or {})


def sse_frame(row: JobEventRow) -> str:
    payload = event_out(row).model_dump_json()
    return f"id: {row.id}\nevent: {row.type}\ndata: {payload}\n\n"


def parse_event(body: bytes) -> WebhookEvent:
    try:
        return WebhookEvent.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "body"
        raise IngestError(422, f"{loc}: {first['msg']}") from None


def _save_image(job: JobRow, event: WebhookEvent, data: dict, data_dir: Path) -> None:
    encoded = data.pop("image_base64", None)
    if not encoded:
        return
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        data["image_error"] = "image_base64 is not valid base64"
        return
    ext = next((e for magic, e in IMAGE_MAGIC.items() if raw.startswith(magic)), None)
    if ext is None:
        data["image_error"] = "not a PNG/JPEG/WebP/GIF image"
        return
    run_dir = Path(job.run_dir) if job.run_dir else data_dir / "runs" / f"job-{job.id}"
    folder = run_dir / "events"
    folder.mkdir(parents=True, exist_ok=True)
    kind = "preview" if data.get("kind") == "preview" else "validation"
    name = f"a{job.attempt}-s{event.seq}-{kind}{ext}"
    (folder / name).write_bytes(raw)
    data["image_file"] = f"events/{name}"
    data["image_url"] = f"/api/jobs/{job.id}/files/events/{name}"


def _is_mp4(raw: bytes) -> bool:
    return len(raw) > 12 and raw[4:8] == b"ftyp"  # ISO base media: a size, then the 'ftyp' box


def _save_video(job: JobRow, event: WebhookEvent, data: dict, data_dir: Path) -> None:
    """A validation video (``video_base64``, an mp4) is stored beside its poster image."""
    encoded = data.pop("video_base64", None)
    if not encoded:
        return
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        data["video_error"] = "video_base64 is not valid base64"
        return
    if not _is_mp4(raw):
        data["video_error"] = "not an MP4 video"
        return
    run_dir = Path(job.run_dir) if job.run_dir else data_dir / "runs" / f"job-{job.id}"
    folder = run_dir / "events"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"a{job.attempt}-s{event.seq}-video.mp4"
    (folder / name).write_bytes(raw)
    data["video_file"] = f"events/{name}"
    data["video_url"] = f"/api/jobs/{job.id}/files/events/{name}"


def _fold(job: JobRow, event: WebhookEvent, data: dict) -> None:
    """Keep the job record's summary (progress, results, error) current."""
    results = dict(job.results or {})
    kind = event.type
    if kind == "progress":
        job.progress = {**data, "time": event.time}
    elif kind == "checkpoint":
        results["last_checkpoint"] = data.get("path")
        results["checkpoints"] = (list(results.get("checkpoints", [])) + [data.get("path")])[-MAX_CHECKPOINTS:]
    elif kind == "image":
        key = "preview_images" if data.get("kind") == "preview" else "validation_images"
        results[key] = int(results.get(key, 0)) + 1
        if data.get("image_url"):
            results[f"last_{key[:-1]}"] = data["image_url"]
        if data.get("video_url"):
            results["last_validation_video"] = data["video_url"]
    elif kind == "scores":
        metrics = data.get("metrics") or {}
        if isinstance(metrics, dict):
            results["scores"] = {**(results.get("scores") or {}), **metrics}
            results["scores_step"] = data.get("step")
    elif kind == "status" and data.get("status") == "starting":
        # start-up stages (loading, caching N/M) stand in for progress until the first step
        job.progress = {k: data[k] for k in ("stage", "done", "total") if k in data} | {"time": event.time}
    elif kind == "status":
        status = data.get("status")
        results["trainer_status"] = status
        for key, value in data.items():
            if key != "status":
                results[key] = value
    elif kind == "error":
        job.error = str(data.get("message", ""))[:10_000]
    job.results = results


def ingest(db: Database, job_id: int, body: bytes, signature: str | None, data_dir: Path) -> tuple[bool, int | None]:
    """Verify and store one trainer event. Returns (stored, row id); a repeat of a stored seq is not stored
    again. Raises IngestError(401/403/404/409/422)."""
    with db.session() as s:
        found = s.execute(select(JobRow.id, JobRow.webhook_secret).where(JobRow.id == job_id)).first()
    secret = found.webhook_secret if found is not None else None
    if found is None:
        raise IngestError(404, f"job {job_id} not found")
    if not signature:
        raise IngestError(401, "missing X-SimpleTuner-Signature header")
    if not secret or not verify(secret, body, signature):
        raise IngestError(403, "signature does not match this job's webhook secret")
    event = parse_event(body)
    if event.job_id is not None and str(event.job_id) != str(job_id):
        raise IngestError(422, f"job_id: event is for job {event.job_id}, posted to job {job_id}")
    data = json.loads(json.dumps(event.data))  # plain JSON types only
    try:
        return _store(db, job_id, secret, event, data, data_dir)
    except IntegrityError:  # the same seq stored concurrently (non-SQLite databases)
        with db.session() as s:
            existing = s.scalar(select(JobEventRow.id).where(
                JobEventRow.job_id == job_id, JobEventRow.source == "trainer", JobEventRow.seq == event.seq
            ).order_by(JobEventRow.id.desc()))
        return False, existing


def _store(db: Database, job_id: int, secret: str, event: WebhookEvent, data: dict,
           data_dir: Path) -> tuple[bool, int | None]:
    with db.session(write=True) as s:
        # Only the columns an event touches: the frozen config is large and never needed here.
        job = s.get(JobRow, job_id, options=[load_only(*FOLD_COLUMNS)])
        if job.webhook_secret != secret:  # rotated by a new attempt meanwhile
            raise IngestError(403, "signature does not match this job's webhook secret")
        existing = s.scalar(select(JobEventRow.id).where(
            JobEventRow.job_id == job_id, JobEventRow.attempt == job.attempt,
            JobEventRow.source == "trainer", JobEventRow.seq == event.seq))
        if existing is not None:
            return False, existing
        if event.type == "image":
            _save_image(job, event, data, data_dir)
            _save_video(job, event, data, data_dir)
        _fold(job, event, data)
        row = JobEventRow(job_id=job_id, attempt=job.attempt, source="trainer", seq=event.seq,
                          type=event.type, time=event.time, data=data)
        s.add(row)
        s.flush()
        return True, row.id


def fetch(db: Database, *, job_id: int | None = None, after: int = 0, limit: int = 500,
          types: list[str] | None = None) -> list[JobEventRow]:
    with db.session() as s:
        q = select(JobEventRow).where(JobEventRow.id > after)
        if job_id is not None:
            q = q.where(JobEventRow.job_id == job_id)
        if types:
            q = q.where(JobEventRow.type.in_(types))
        return list(s.scalars(q.order_by(JobEventRow.id).limit(limit)))


def last_event_id(db: Database) -> int:
    from sqlalchemy import func

    with db.session() as s:
        return int(s.scalar(select(func.coalesce(func.max(JobEventRow.id), 0))))


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
