"""The FastAPI app factory. Everything stateful (engine, token, scheduler) is built in ``create_app`` so each
test gets its own database; importing this module imports no torch/diffusers/transformers."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from simpletuner import __version__

from .auth import require_auth
from .broker import EventBroker
from .db import Database, DatabaseDamaged
from .guards import RequestGuard
from .queue import JobManager
from .settings import ServerSettings
from .validation import InvalidConfig

logger = logging.getLogger("simpletuner.server")

DESCRIPTION = """Queue and watch SimpleTuner training jobs.

Loopback clients (that also name a loopback host) need no token unless the server runs with `--require-token`;
everyone else sends `Authorization: Bearer <token>` (a token in the URL is refused). State-changing requests from
another origin are refused. Trainer webhooks (`POST /api/jobs/{id}/events`) are signed with the job's HMAC secret
instead."""


def _loc_to_path(loc) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """Build the server: database (tables created if missing), token, job manager, routes."""
    from fastapi.staticfiles import StaticFiles

    from .routes import configs, datasets, docs, events, jobs, presets, schema, system, ui, workers

    settings = settings or ServerSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.resolved_db_url(), busy_timeout=settings.db_busy_timeout)
    try:
        db.check_integrity()  # a damaged file is named now, not found by a request later
        db.create_all()
    except DBAPIError as exc:
        raise DatabaseDamaged(f"database {settings.resolved_db_url()} cannot be used: {exc.orig}") from None
    token, generated = settings.resolve_token()
    broker = EventBroker()
    manager = JobManager(settings, db, broker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start()
        try:
            yield
        finally:
            manager.stop()
            db.dispose()

    # the docs page is ours (routes/docs.py): FastAPI's own loads Swagger UI and ReDoc from a CDN
    app = FastAPI(title="SimpleTuner server", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.db = db
    app.state.broker = broker
    app.state.manager = manager
    app.state.token = token
    app.state.token_generated = generated
    app.state.db_error = None  # the last database failure a request met (the health check confirms or clears it)

    @app.exception_handler(DBAPIError)
    async def _database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        message = str(exc.orig) if exc.orig is not None else str(exc)
        if isinstance(exc, OperationalError) and "locked" in message:
            return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                                content={"detail": "the database is busy (locked by another writer); retry shortly"})
        logger.error("database error on %s %s: %s", request.method, request.url.path, message)
        app.state.db_error = message
        return JSONResponse(status_code=503, headers={"Retry-After": "30"},
                            content={"detail": f"database error: {message}"})

    @app.exception_handler(InvalidConfig)
    async def _invalid_config(_request: Request, exc: InvalidConfig) -> JSONResponse:
        return JSONResponse(status_code=422, content={
            "detail": "invalid config", "errors": [{"path": e.path, "message": e.message} for e in exc.errors]})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404 and ui.wants_html(request):
            return ui.not_found(request, f"Nothing lives at {request.url.path}.")
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = list(err.get("loc", ()))
            if loc and loc[0] == "body":
                loc = loc[1:]
            msg = str(err.get("msg", "invalid"))
            errors.append({"path": _loc_to_path(loc) or "body", "message": msg})
        return JSONResponse(status_code=422, content={"detail": "invalid request", "errors": errors})

    auth = [Depends(require_auth)]
    app.include_router(system.router)
    app.include_router(events.router)  # per-route auth: the webhook is HMAC-signed instead
    app.include_router(configs.router, dependencies=auth)
    app.include_router(jobs.router, dependencies=auth)
    app.include_router(datasets.router, dependencies=auth)
    app.include_router(schema.router, dependencies=auth)
    app.include_router(workers.router)  # per-route auth: API token for tokens, worker tokens for workers
    app.include_router(presets.router, dependencies=auth)
    app.include_router(docs.router)
    app.include_router(ui.router)  # the web UI's pages, "/" included
    app.mount(docs.ASSETS, StaticFiles(directory=docs.assets_dir()), name="swagger")  # before /static: it wins
    app.mount("/static", StaticFiles(directory=ui.STATIC), name="static")
    app.add_middleware(RequestGuard, settings=settings)
    return app
