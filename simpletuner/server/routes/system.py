"""Health, server facts, and the model families the config layer knows."""

from __future__ import annotations

import sys
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import func, select

from simpletuner import __version__

from .. import deps
from ..auth import SESSION_COOKIE, require_auth, session_value
from ..db import JobRow
from ..schemas import ERRORS, HealthOut, SystemOut

router = APIRouter(tags=["system"])


@router.get("/api/health", response_model=HealthOut, responses={503: {"model": HealthOut}},
            summary="Health: the server answers and its database reads (no token needed)")
def health(request: Request):
    db = deps.db(request)
    try:
        db.probe()
        if request.app.state.db_error is not None:  # a request met a database error: look at the whole file
            db.check_integrity()
            request.app.state.db_error = None
    except Exception as exc:  # the driver's errors, DatabaseDamaged
        detail = str(getattr(exc, "orig", None) or exc)
        return JSONResponse(status_code=503, content=HealthOut(status="error", detail=detail).model_dump())
    return HealthOut()


@router.post("/api/session", status_code=204, responses=ERRORS, dependencies=[Depends(require_auth)],
             summary="Start a web UI session: a cookie (HttpOnly, SameSite=Strict) that stands for the token")
def start_session(request: Request) -> Response:
    response = Response(status_code=204)
    token = request.app.state.token
    if token:  # EventSource and <img> cannot send the Authorization header; they send this cookie instead
        response.set_cookie(SESSION_COOKIE, session_value(token), httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
    return response


@router.delete("/api/session", status_code=204, summary="End the web UI session (drop its cookie)")
def end_session() -> Response:
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


@router.get("/api/system", response_model=SystemOut, responses=ERRORS, dependencies=[Depends(require_auth)],
            summary="Server facts: slots, accelerators, queue counts")
def system(request: Request) -> SystemOut:
    mgr = deps.manager(request)
    s = deps.settings(request)
    with deps.db(request).session() as session:
        counts = dict(session.execute(select(JobRow.status, func.count(JobRow.id)).group_by(JobRow.status)).all())
    return SystemOut(
        version=__version__,
        server_id=mgr.server_id,
        host=mgr.host,
        data_dir=str(s.data_dir),
        database=_redact(s.resolved_db_url()),
        max_concurrent=mgr.max_concurrent,
        accelerators=mgr.accelerators,
        running=counts.get("running", 0),
        queued=counts.get("queued", 0),
        running_here=sorted(mgr.procs),
        uptime_s=time.time() - mgr.started_at,
        allowed_roots=[str(r) for r in s.resolved_allowed_roots()],
        torch_imported="torch" in sys.modules,
    )


@router.get("/api/system/model-families", response_model=dict[str, Any], responses=ERRORS,
            dependencies=[Depends(require_auth)], summary="Model families, their flavours and options")
def model_families() -> dict[str, Any]:
    """The family table as the config checks it: each family's flavours (with default weights), LoRA presets,
    objectives, whether it takes a training guidance value, and its text-encoder count."""
    from simpletuner.config.families import FAMILIES

    return {
        name: {
            "description": fam.description,
            "flavours": list(fam.flavours),
            "default_weights": dict(fam.flavours),
            "default_flavour": fam.default_flavour,
            "lora_targets": list(fam.lora_targets),
            "default_lora_target": fam.default_lora_target,
            "objectives": list(fam.objectives),
            "guidance_embeds": fam.guidance_embeds,
            "num_text_encoders": fam.num_text_encoders,
        }
        for name, fam in sorted(FAMILIES.items())
    }
