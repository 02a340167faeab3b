"""Shared request helpers: the app's state objects and the 422 error shape."""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from .db import Database
from .queue import JobManager
from .settings import ServerSettings
from .validation import FieldProblem


def db(request: Request) -> Database:
    return request.app.state.db


def manager(request: Request) -> JobManager:
    return request.app.state.manager


def settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def not_found(what: str) -> HTTPException:
    return HTTPException(status_code=404, detail=f"{what} not found")


def invalid_response(errors: list[FieldProblem], detail: str = "invalid config") -> JSONResponse:
    return JSONResponse(
        status_code=422,
        content={"detail": detail, "errors": [{"path": e.path, "message": e.message} for e in errors]},
    )


def check(request: Request, train_config, data_backends, prompt_library, overrides=None):
    """``validation.check_config`` with this server's allowed roots; raises InvalidConfig (-> 422)."""
    from .validation import check_config

    s = settings(request)
    # a job's output folder is RUN_DIR/output; paths relative to it (logging_dir) are judged from a stand-in
    output_base = s.data_dir / "runs" / "job-0" / "output"
    return check_config(train_config, data_backends, prompt_library, s.resolved_allowed_roots(), s.workdir,
                        overrides=overrides, output_base=output_base)
