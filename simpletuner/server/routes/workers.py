"""Workers: tokens (API token holders manage them) and the worker protocol (worker tokens only).

    POST   /api/worker-tokens            create (the token is shown once)      API token
    GET    /api/worker-tokens            list                                   API token
    DELETE /api/worker-tokens/{id}       revoke: its workers' jobs re-queue     API token
    GET    /api/workers                  workers, the server's own machine too  API token
    POST   /api/workers                  register                               worker token
    POST   /api/workers/{id}/heartbeat   renew the lease; what to stop          worker token
    POST   /api/workers/{id}/claim       the next share of a job, or 204        worker token
    POST   /api/workers/{id}/assignments/{a}/started | finished                 worker token

The API token is refused on the worker routes and a worker token everywhere else: a stolen worker token can run
only what the queue hands out, never submit, read configs or manage tokens.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response, status

from .. import deps
from ..auth import presented_token, require_auth
from ..schemas import (CONFLICT, ERRORS, MAX_ID, NOT_FOUND, AssignmentFinished, AssignmentStarted, ClaimOut,
                       ClaimRequest, HeartbeatOut, WorkerOut, WorkerRegister, WorkerRegistered, WorkerTokenCreate,
                       WorkerTokenCreated, WorkerTokenOut)
from ..workers import NotYours, WorkerGone, WorkerTokenRow

router = APIRouter(tags=["workers"])
WorkerId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]
AssignmentId = Annotated[int, Path(ge=1, le=MAX_ID)]
GONE = {410: {"description": "the worker is not registered (lease lost, token revoked): register again"}}


def worker_token(request: Request) -> WorkerTokenRow:
    """Dependency of the worker routes: a valid, unrevoked worker token (never the API token)."""
    row = deps.manager(request).fleet.authenticate(presented_token(request))
    if row is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing, unknown or revoked worker token (send "
                                                          "'Authorization: Bearer <worker token>')",
                            headers={"WWW-Authenticate": "Bearer"})
    return row


Token = Annotated[WorkerTokenRow, Depends(worker_token)]


def _gone(exc: Exception) -> HTTPException:
    return HTTPException(status.HTTP_410_GONE, str(exc))


def _token_out(row: WorkerTokenRow) -> WorkerTokenOut:
    return WorkerTokenOut(id=row.id, name=row.name, created_at=row.created_at, revoked_at=row.revoked_at,
                          last_used_at=row.last_used_at)


# ---- managed with the API token -------------------------------------------------------------------------------
@router.post("/api/worker-tokens", response_model=WorkerTokenCreated, status_code=201, responses=ERRORS,
             dependencies=[Depends(require_auth)], summary="Create a worker token (shown once)")
def create_worker_token(body: WorkerTokenCreate, request: Request) -> WorkerTokenCreated:
    row, token = deps.manager(request).fleet.create_token(body.name)
    return WorkerTokenCreated(**_token_out(row).model_dump(), token=token)


@router.get("/api/worker-tokens", response_model=list[WorkerTokenOut], responses=ERRORS,
            dependencies=[Depends(require_auth)], summary="Worker tokens (never the tokens themselves)")
def list_worker_tokens(request: Request) -> list[WorkerTokenOut]:
    return [_token_out(r) for r in deps.manager(request).fleet.tokens()]


@router.delete("/api/worker-tokens/{token_id}", response_model=WorkerTokenOut, responses={**ERRORS, **NOT_FOUND},
               dependencies=[Depends(require_auth)],
               summary="Revoke a worker token: its workers are refused and their jobs go back to the queue")
def revoke_worker_token(token_id: Annotated[int, Path(ge=1, le=MAX_ID)], request: Request) -> WorkerTokenOut:
    row = deps.manager(request).fleet.revoke_token(token_id)
    if row is None:
        raise deps.not_found(f"worker token {token_id}")
    return _token_out(row)


@router.get("/api/workers", response_model=list[WorkerOut], responses=ERRORS, dependencies=[Depends(require_auth)],
            summary="Workers: the server's own machine and every registered one")
def list_workers(request: Request) -> list[WorkerOut]:
    mgr = deps.manager(request)
    local = WorkerOut(id="local", name=f"{mgr.host} (this server)", host=mgr.host, address="127.0.0.1",
                      devices=mgr.accelerators, slots=mgr.max_concurrent, reserved=len(mgr.procs),
                      status="online" if mgr.settings.local_worker else "off", local=True,
                      jobs=[{"job_id": j, "machine_rank": 0} for j in sorted(mgr.procs)])
    return [local, *[WorkerOut(**w) for w in mgr.fleet.workers()]]


# ---- the worker protocol (worker token) --------------------------------------------------------------------------
@router.post("/api/workers", response_model=WorkerRegistered, status_code=201, responses=ERRORS,
             summary="Register a worker and its devices")
def register_worker(body: WorkerRegister, request: Request, token: Token) -> WorkerRegistered:
    settings = deps.settings(request)
    seen = request.client.host if request.client else "127.0.0.1"
    row = deps.manager(request).fleet.register(
        token, name=body.name, host=body.host, address=body.address or seen, devices=body.devices,
        slots=body.slots if body.slots is not None else max(1, len(body.devices)), replaces=body.replaces,
        info=body.info)
    return WorkerRegistered(id=row.id, lease_seconds=settings.worker_lease,
                            heartbeat_interval=max(0.2, settings.worker_lease / 3), address=row.address)


@router.post("/api/workers/{worker_id}/heartbeat", response_model=HeartbeatOut, responses={**ERRORS, **GONE},
             summary="Renew the lease; answers which of its jobs the worker must stop")
def heartbeat(worker_id: WorkerId, request: Request, token: Token) -> HeartbeatOut:
    try:
        return HeartbeatOut(**deps.manager(request).fleet.heartbeat(worker_id, token))
    except WorkerGone as exc:
        raise _gone(exc) from None


@router.post("/api/workers/{worker_id}/claim", response_model=ClaimOut, responses={**ERRORS, **GONE, 204: {
    "description": "nothing to run now"}}, summary="Claim the next share of a job that fits this worker")
def claim(worker_id: WorkerId, body: ClaimRequest, request: Request, token: Token):
    try:
        found = deps.manager(request).fleet.claim(worker_id, token, body.port)
    except WorkerGone as exc:
        raise _gone(exc) from None
    if found is None:
        return Response(status_code=204)
    return ClaimOut(**asdict(found))


@router.post("/api/workers/{worker_id}/assignments/{assignment_id}/started", status_code=204,
             responses={**ERRORS, **GONE, **CONFLICT}, summary="The worker launched its share")
def started(worker_id: WorkerId, assignment_id: AssignmentId, body: AssignmentStarted, request: Request,
            token: Token) -> Response:
    try:
        ok = deps.manager(request).fleet.started(worker_id, token, assignment_id, body.pid, body.devices)
    except WorkerGone as exc:
        raise _gone(exc) from None
    except NotYours as exc:
        raise HTTPException(404, str(exc)) from None
    if not ok:
        raise HTTPException(409, f"assignment {assignment_id} is no longer current: stop it")
    return Response(status_code=204)


@router.post("/api/workers/{worker_id}/assignments/{assignment_id}/finished", status_code=204,
             responses={**ERRORS, **NOT_FOUND}, summary="The worker's share ended (its exit code)")
def finished(worker_id: WorkerId, assignment_id: AssignmentId, body: AssignmentFinished, request: Request,
             token: Token) -> Response:
    try:
        deps.manager(request).fleet.finished(worker_id, token, assignment_id, body.exit_code, body.log_tail)
    except NotYours as exc:
        raise HTTPException(404, str(exc)) from None
    return Response(status_code=204)
