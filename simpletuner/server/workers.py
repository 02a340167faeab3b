"""Workers on other machines (``simpletuner worker``): tokens, registration, leases, claims and gangs.

A worker shows a worker token (separate from the API token, revocable), registers its devices and heartbeats;
each heartbeat renews its lease. It claims queued jobs that fit with the same atomic
``UPDATE jobs ... WHERE status='queued'`` the server's own scheduler uses, so a job runs once however many workers
and servers share the database. A job on ``num_machines`` > 1 machines is gang-scheduled: the claiming worker
becomes machine rank 0 (its address and a port it checked free are the rendezvous) and ``num_machines - 1`` other
live workers with room get ranks 1.. in the same transaction, all or nothing; they pick their share up on their next
claim. A worker whose lease runs out is marked lost and its jobs go back to the queue (every machine of a gang is
told to stop); the next attempt resumes from the newest checkpoint in the run dir, which lives on storage every
machine reaches (``ServerSettings.runs_dir``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, UniqueConstraint, func, select, update
from sqlalchemy.orm import Mapped, mapped_column

from . import rundir
from .db import Base, JobRow, now
from .pairs import dependency_state, waiting_for_cache_job

logger = logging.getLogger("simpletuner.server.workers")

ACTIVE = ("assigned", "running")  # an assignment holding its worker's capacity
WORKER_PREFIX = "worker:"  # jobs.owner of a job that workers run (the server's reconcile leaves it alone)


class WorkerTokenRow(Base):
    __tablename__ = "worker_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class WorkerRow(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    token_id: Mapped[int] = mapped_column(ForeignKey("worker_tokens.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(200))
    address: Mapped[str] = mapped_column(String(200))  # where rank 0's rendezvous listens when it leads a gang
    devices: Mapped[list] = mapped_column(JSON)  # accelerator ids; empty on a CPU machine
    slots: Mapped[int] = mapped_column(Integer)  # jobs at once on the CPU, or accelerators
    reserved: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    status: Mapped[str] = mapped_column(String(16), index=True)  # online | lost | replaced | revoked
    registered_at: Mapped[float] = mapped_column(Float, default=now)
    heartbeat_at: Mapped[float] = mapped_column(Float, default=now)
    lease_expires_at: Mapped[float] = mapped_column(Float)
    info: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class AssignmentRow(Base):
    """One machine's share of one attempt of a job."""

    __tablename__ = "job_assignments"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "machine_rank", name="uq_assignment_rank"),
                      Index("ix_job_assignments_worker_status", "worker_id", "status"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    machine_rank: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    # assigned -> running -> finished; stopping: told to stop (gang torn down, cancelled); lost: its worker died
    status: Mapped[str] = mapped_column(String(16))
    cost: Mapped[int] = mapped_column(Integer)
    devices: Mapped[str | None] = mapped_column(String(200), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    assigned_at: Mapped[float] = mapped_column(Float, default=now)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class WorkerGone(Exception):
    """The worker is unknown, lost its lease, or its token was revoked: it must stop its jobs and register again."""


class NotYours(Exception):
    """An assignment that is not this worker's."""


@dataclass
class Claim:
    """What a worker needs to run its share of a job (JSON in the claim response)."""

    assignment_id: int
    job_id: int
    attempt: int
    machine_rank: int
    num_machines: int
    num_processes: int
    main_process_ip: str | None
    main_process_port: int | None
    run_dir: str
    config: str
    module: str  # what the launcher runs: simpletuner.train, or simpletuner.cache for a cache job
    webhook_secret: str | None
    allowed_roots: list[str]
    resume_step: int | None


class Fleet:
    """The server's side of the workers. Every method is one or a few short transactions; several servers sharing
    one database may call them concurrently."""

    def __init__(self, settings, db, manager):
        self.settings = settings
        self.db = db
        self.manager = manager

    # ---- tokens ---------------------------------------------------------------------------------------------
    def create_token(self, name: str) -> tuple[WorkerTokenRow, str]:
        token = "stw_" + secrets.token_urlsafe(32)
        with self.db.session(write=True) as s:
            row = WorkerTokenRow(name=name, token_hash=hash_token(token), created_at=now())
            s.add(row)
            s.flush()
        return row, token

    def tokens(self) -> list[WorkerTokenRow]:
        with self.db.session() as s:
            return list(s.scalars(select(WorkerTokenRow).order_by(WorkerTokenRow.id)))

    def revoke_token(self, token_id: int) -> WorkerTokenRow | None:
        """Revoke a worker token: its workers are refused from now on and their jobs go back to the queue."""
        with self.db.session(write=True) as s:
            row = s.get(WorkerTokenRow, token_id)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = now()
            ids = list(s.scalars(select(WorkerRow.id).where(WorkerRow.token_id == token_id,
                                                            WorkerRow.status == "online")))
        for worker_id in ids:
            self._drop_worker(worker_id, "revoked", "its worker token was revoked")
        return row

    def authenticate(self, token: str | None) -> WorkerTokenRow | None:
        if not token:
            return None
        with self.db.session() as s:
            row = s.scalar(select(WorkerTokenRow).where(WorkerTokenRow.token_hash == hash_token(token)))
        if row is None or row.revoked_at is not None:
            return None
        return row

    # ---- registration and leases ----------------------------------------------------------------------------
    def register(self, token: WorkerTokenRow, *, name: str, host: str, address: str, devices: list[str],
                 slots: int, replaces: str | None = None, info: dict | None = None) -> WorkerRow:
        """A worker (re)starting. ``replaces``: the id it had before a restart; that worker's jobs are re-queued
        at once instead of when its lease runs out."""
        if replaces:
            with self.db.session() as s:
                old = s.get(WorkerRow, replaces)
            if old is not None and old.token_id == token.id and old.status == "online":
                self._drop_worker(replaces, "replaced", "its worker restarted")
        t = now()
        with self.db.session(write=True) as s:
            row = WorkerRow(id=uuid.uuid4().hex, name=name, token_id=token.id, host=host, address=address,
                            devices=list(devices), slots=max(1, slots), reserved=0, status="online",
                            registered_at=t, heartbeat_at=t, lease_expires_at=t + self.settings.worker_lease,
                            info=info or {})
            s.add(row)
            s.get(WorkerTokenRow, token.id).last_used_at = t
        logger.info("worker %s (%s) registered from %s: %s", row.name, row.id[:8], host,
                    f"devices {','.join(devices)}" if devices else f"{row.slots} CPU slot(s)")
        return row

    def _online(self, worker_id: str, token: WorkerTokenRow) -> WorkerRow:
        with self.db.session() as s:
            row = s.get(WorkerRow, worker_id)
        if row is None or row.token_id != token.id:
            raise WorkerGone(f"worker {worker_id} is not registered")
        if row.status != "online":
            raise WorkerGone(f"worker {worker_id} is {row.status}; register again")
        return row

    def heartbeat(self, worker_id: str, token: WorkerTokenRow) -> dict:
        """Renew the lease; returns the assignments this worker must stop (cancelled jobs, torn-down gangs)."""
        self._online(worker_id, token)
        t = now()
        with self.db.session(write=True) as s:
            renewed = s.execute(update(WorkerRow).where(WorkerRow.id == worker_id, WorkerRow.status == "online")
                                .values(heartbeat_at=t, lease_expires_at=t + self.settings.worker_lease)).rowcount
            if renewed != 1:
                raise WorkerGone(f"worker {worker_id} lost its lease; register again")
            mine = s.execute(select(AssignmentRow.id, AssignmentRow.job_id, AssignmentRow.status,
                                    AssignmentRow.attempt, JobRow.cancel_requested, JobRow.status, JobRow.attempt)
                             .join(JobRow, JobRow.id == AssignmentRow.job_id)
                             .where(AssignmentRow.worker_id == worker_id,
                                    AssignmentRow.status.in_((*ACTIVE, "stopping")))).all()
            running_jobs = [r[1] for r in mine if r[2] == "running" and r[0]]
            if running_jobs:
                s.execute(update(JobRow).where(JobRow.id.in_(running_jobs), JobRow.status == "running")
                          .values(heartbeat_at=t))
        stop = [{"assignment_id": a, "job_id": j, "reason": "cancelled" if cancel else "stopped"}
                for a, j, status, attempt, cancel, job_status, job_attempt in mine
                if status == "stopping" or cancel or job_status != "running" or attempt != job_attempt]
        return {"lease_expires_at": t + self.settings.worker_lease, "stop": stop}

    def expire(self) -> list[str]:
        """Mark workers whose lease ran out as lost and re-queue their jobs; tear down gangs that never all
        started. Returns the ids of the workers dropped (called from the scheduler's tick)."""
        t = now()
        with self.db.session() as s:
            stale = list(s.scalars(select(WorkerRow.id).where(WorkerRow.status == "online",
                                                              WorkerRow.lease_expires_at < t)))
            slow = s.execute(select(AssignmentRow.job_id, AssignmentRow.attempt).where(
                AssignmentRow.status == "assigned",
                AssignmentRow.assigned_at < t - self.settings.gang_start_timeout)).all()
        for worker_id in stale:
            self._drop_worker(worker_id, "lost", "its worker stopped heart-beating (lease expired)")
        for job_id, attempt in set(slow):
            self._requeue(job_id, attempt, "a machine of its gang did not start in time")
        return stale

    def _drop_worker(self, worker_id: str, status: str, why: str) -> None:
        with self.db.session(write=True) as s:
            took = s.execute(update(WorkerRow).where(WorkerRow.id == worker_id, WorkerRow.status == "online")
                             .values(status=status, reserved=0, lease_expires_at=now())).rowcount
            if took != 1:
                return
            row = s.get(WorkerRow, worker_id)
            jobs = s.execute(select(AssignmentRow.job_id, AssignmentRow.attempt).where(
                AssignmentRow.worker_id == worker_id, AssignmentRow.status.in_((*ACTIVE, "stopping")))).all()
            s.execute(update(AssignmentRow).where(AssignmentRow.worker_id == worker_id,
                                                  AssignmentRow.status.in_((*ACTIVE, "stopping")))
                      .values(status="lost", finished_at=now()))
        logger.warning("worker %s (%s) %s: %s", row.name, worker_id[:8], status, why)
        for job_id, attempt in jobs:
            self._requeue(job_id, attempt, f"worker {row.name} {status}: {why}")

    def _requeue(self, job_id: int, attempt: int, why: str) -> bool:
        """Put a running job back in the queue (whatever its retries: a lost machine is no trainer crash); every
        machine of it is told to stop. The next attempt resumes from the newest checkpoint."""
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            if job is None or job.status != "running" or job.attempt != attempt:
                return False
            newest = rundir.newest_checkpoint(rundir.output_of(job.run_dir)) if job.run_dir else None
            where = f"resumes from step {newest[0]}" if newest else "starts from step 0 (no checkpoint yet)"
            if job.cancel_requested:
                values: dict[str, Any] = dict(status="cancelled", finished_at=now(), reason=f"cancelled ({why})")
            else:
                values = dict(status="queued", started_at=None, reason=f"re-queued: {why}; {where}")
            res = s.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "running",
                                                 JobRow.attempt == attempt)
                            .values(pid=None, pgid=None, owner=None, owner_host=None, owner_pid=None,
                                    webhook_secret=None, main_process_ip=None, main_process_port=None, **values))
            if res.rowcount != 1:
                return False
            self._release(s, job_id, attempt, "stopping")
            s.refresh(job)
            self.manager.job_event(s, job, requeued_from_attempt=attempt)
        self.manager.broker.notify()
        self.manager.wake()
        logger.info("job %s: %s", job_id, job.reason)
        return True

    def _release(self, s, job_id: int, attempt: int, status: str) -> None:
        """Give back the capacity of a job attempt's active assignments (marked ``status``)."""
        held = s.execute(select(AssignmentRow.id, AssignmentRow.worker_id, AssignmentRow.cost).where(
            AssignmentRow.job_id == job_id, AssignmentRow.attempt == attempt,
            AssignmentRow.status.in_(ACTIVE))).all()
        for assignment_id, worker_id, cost in held:
            s.execute(update(AssignmentRow).where(AssignmentRow.id == assignment_id)
                      .values(status=status))
            s.execute(update(WorkerRow).where(WorkerRow.id == worker_id, WorkerRow.reserved >= cost)
                      .values(reserved=WorkerRow.reserved - cost))

    # ---- claiming -------------------------------------------------------------------------------------------
    def _cost(self, worker: WorkerRow, job_processes: int, num_machines: int) -> int:
        here = max(1, job_processes // max(1, num_machines))
        return here if worker.devices else 1

    def claim(self, worker_id: str, token: WorkerTokenRow, port: int | None) -> Claim | None:
        """The next share of a job for this worker: one a gang already assigned it, else a queued job that fits
        (strict priority: a job it could run later holds the ones behind it). None when there is nothing."""
        worker = self._online(worker_id, token)
        pending = self._pending(worker_id)
        if pending is not None:
            return pending
        with self.db.session() as s:
            candidates = s.execute(
                select(JobRow.id, JobRow.num_processes, JobRow.num_machines, JobRow.depends_on)
                .where(JobRow.status == "queued", ~waiting_for_cache_job())  # the whole queue: see _start_next
                .order_by(JobRow.priority.desc(), JobRow.submitted_at, JobRow.id)).all()
            others = list(s.scalars(select(WorkerRow).where(
                WorkerRow.status == "online", WorkerRow.lease_expires_at > now(), WorkerRow.id != worker_id)))
        for job_id, processes, machines, depends_on in candidates:
            with self.db.session() as s:
                state, why = dependency_state(s, job_id, depends_on)
            if state == "waiting":
                continue  # its cache job has not finished
            if state == "failed":
                self.manager._fail_queued(job_id, why)
                continue
            machines = max(1, machines or 1)
            cost = self._cost(worker, processes, machines)
            if cost > worker.slots:
                continue  # never fits this worker; another may take it
            if machines > 1:
                if port is None:
                    continue
                able = [w for w in others if self._cost(w, processes, machines) <= w.slots]
                if len(able) < machines - 1:
                    continue  # not enough machines registered for this gang
                free = sorted((w for w in able if w.slots - w.reserved >= self._cost(w, processes, machines)),
                              key=lambda w: (w.reserved, w.id))
                if worker.slots - worker.reserved < cost or len(free) < machines - 1:
                    return None  # strict priority: wait until the gang can form
                gang = [worker, *free[:machines - 1]]
            else:
                if worker.slots - worker.reserved < cost:
                    return None
                gang = [worker]
            made = self._claim_gang(job_id, gang, processes, machines, port)
            if made is not None:
                return made
        return None

    def _claim_gang(self, job_id: int, gang: list[WorkerRow], processes: int, machines: int,
                    port: int | None) -> Claim | None:
        """Assign ``job_id`` to ``gang`` (rank = position) in one transaction, all or nothing."""
        leader = gang[0]
        secret = secrets.token_hex(32)
        run_dir = str(self.manager.run_dir_for(job_id))
        t = now()
        with self.db.session(write=True) as s:
            # reserve capacity first, in id order: two claims that overlap lock the same rows in the same order
            costs = {w.id: self._cost(w, processes, machines) for w in gang}
            for w in sorted(gang, key=lambda w: w.id):
                ok = s.execute(update(WorkerRow).where(
                    WorkerRow.id == w.id, WorkerRow.status == "online",
                    WorkerRow.reserved + costs[w.id] <= WorkerRow.slots)
                    .values(reserved=WorkerRow.reserved + costs[w.id])).rowcount
                if ok != 1:
                    s.rollback()  # someone filled that worker meanwhile: nothing of this claim stays
                    return None
            claimed = s.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "queued").values(
                status="running", started_at=t, heartbeat_at=t, owner=f"{WORKER_PREFIX}{leader.id}",
                owner_host=leader.host, owner_pid=None, attempt=JobRow.attempt + 1, webhook_secret=secret,
                run_dir=run_dir, pid=None, pgid=None, exit_code=None, finished_at=None, reason=None, error=None,
                log_tail=None, progress=None, devices=None,
                main_process_ip=leader.address if machines > 1 else None,
                main_process_port=port if machines > 1 else None)).rowcount
            if claimed != 1:
                s.rollback()  # another worker or server took it
                return None
            job = s.get(JobRow, job_id, populate_existing=True)
            for rank, w in enumerate(gang):
                s.add(AssignmentRow(job_id=job_id, attempt=job.attempt, machine_rank=rank, worker_id=w.id,
                                    status="assigned", cost=costs[w.id], assigned_at=t))
            # the run dir is written before anyone can see the assignments (a gang's other machines read it)
            self.manager.prepare_run(job, write=True)
            self.manager.job_event(s, job, workers=[w.name for w in gang],
                                   **({"main_process": f"{leader.address}:{port}"} if machines > 1 else {}))
        self.manager.broker.notify()
        return self._pending(leader.id, job_id=job_id)

    def _pending(self, worker_id: str, job_id: int | None = None) -> Claim | None:
        """This worker's oldest assignment not yet started, prepared for it (run dir written)."""
        with self.db.session() as s:
            q = select(AssignmentRow).where(AssignmentRow.worker_id == worker_id, AssignmentRow.status == "assigned")
            if job_id is not None:
                q = q.where(AssignmentRow.job_id == job_id)
            a = s.scalar(q.order_by(AssignmentRow.id).limit(1))
            if a is None:
                return None
            job = s.get(JobRow, a.job_id)
        if job.status != "running" or job.attempt != a.attempt:
            return None
        prepared = self.manager.prepare_run(job, write=False)
        return Claim(assignment_id=a.id, job_id=job.id, attempt=job.attempt, machine_rank=a.machine_rank,
                     num_machines=max(1, job.num_machines or 1), num_processes=max(1, job.num_processes or 1),
                     main_process_ip=job.main_process_ip, main_process_port=job.main_process_port,
                     run_dir=str(prepared.run_dir), config=str(prepared.config_path),
                     module="simpletuner.cache" if job.kind == "cache" else "simpletuner.train",
                     webhook_secret=job.webhook_secret if a.machine_rank == 0 else None,
                     allowed_roots=[str(p) for p in self.settings.resolved_allowed_roots()],
                     resume_step=prepared.resume_step)

    # ---- a machine's share starts and ends -----------------------------------------------------------------
    def _assignment(self, s, worker_id: str, assignment_id: int) -> AssignmentRow:
        a = s.get(AssignmentRow, assignment_id)
        if a is None or a.worker_id != worker_id:
            raise NotYours(f"assignment {assignment_id} is not worker {worker_id}'s")
        return a

    def started(self, worker_id: str, token: WorkerTokenRow, assignment_id: int, pid: int | None,
                devices: list[str]) -> bool:
        """The worker launched its share. False when the job moved on meanwhile (the worker stops it)."""
        self._online(worker_id, token)
        with self.db.session(write=True) as s:
            a = self._assignment(s, worker_id, assignment_id)
            if a.status != "assigned":
                return False
            a.status, a.pid, a.started_at, a.devices = "running", pid, now(), ",".join(devices) or None
            job = s.get(JobRow, a.job_id)
            if job.status != "running" or job.attempt != a.attempt:
                return False
            if a.machine_rank == 0:
                job.pid, job.devices = pid, ",".join(devices) or None
            worker = s.get(WorkerRow, worker_id)
            self.manager.record(s, job, "job", {"status": "running", "attempt": job.attempt, "worker": worker.name,
                                                "machine_rank": a.machine_rank, "pid": pid, "run_dir": job.run_dir})
        self.manager.broker.notify()
        return True

    def finished(self, worker_id: str, token: WorkerTokenRow, assignment_id: int, exit_code: int | None,
                 log_tail: str | None = None) -> None:
        """The worker's share ended. The job ends when its last machine has: succeeded when every machine exited
        0; otherwise failed (or re-queued by ``max_retries``); a failing machine stops the rest of its gang."""
        with self.db.session(write=True) as s:
            a = self._assignment(s, worker_id, assignment_id)
            if a.status in ("finished", "lost"):
                return  # a repeat of a report already taken
            was = a.status
            a.status, a.exit_code, a.finished_at = "finished", exit_code, now()
            if was in ACTIVE:
                s.execute(update(WorkerRow).where(WorkerRow.id == worker_id, WorkerRow.reserved >= a.cost)
                          .values(reserved=WorkerRow.reserved - a.cost))
            job = s.get(JobRow, a.job_id)
            current = job.status == "running" and job.attempt == a.attempt
            if current and exit_code != 0:  # the rest of the gang cannot go on without this machine
                self._release(s, a.job_id, a.attempt, "stopping")
            left = s.scalar(select(func.count(AssignmentRow.id)).where(
                AssignmentRow.job_id == a.job_id, AssignmentRow.attempt == a.attempt,
                AssignmentRow.status.in_((*ACTIVE, "stopping"))))
            codes = list(s.scalars(select(AssignmentRow.exit_code).where(
                AssignmentRow.job_id == a.job_id, AssignmentRow.attempt == a.attempt,
                AssignmentRow.status == "finished").order_by(AssignmentRow.finished_at, AssignmentRow.id)))
            worker = s.get(WorkerRow, worker_id)
            if current:
                self.manager.record(s, job, "job", {"status": "running", "attempt": job.attempt,
                                                    "worker": worker.name, "machine_rank": a.machine_rank,
                                                    "machine_exit_code": exit_code})
            job_id, attempt = a.job_id, a.attempt
        self.manager.broker.notify()
        if not current or left:
            return
        failed = [c for c in codes if c != 0]
        code = failed[0] if failed else 0
        self.manager.complete_remote(job_id, attempt, code, log_tail=log_tail)

    # ---- listing --------------------------------------------------------------------------------------------
    def workers(self) -> list[dict]:
        with self.db.session() as s:
            rows = list(s.scalars(select(WorkerRow).order_by(WorkerRow.registered_at.desc()).limit(500)))
            busy = s.execute(select(AssignmentRow.worker_id, AssignmentRow.job_id, AssignmentRow.machine_rank)
                             .where(AssignmentRow.status.in_(ACTIVE))).all()
        jobs: dict[str, list[dict]] = {}
        for worker_id, job_id, rank in busy:
            jobs.setdefault(worker_id, []).append({"job_id": job_id, "machine_rank": rank})
        return [{"id": w.id, "name": w.name, "host": w.host, "address": w.address, "devices": w.devices,
                 "slots": w.slots, "reserved": w.reserved, "status": w.status, "registered_at": w.registered_at,
                 "heartbeat_at": w.heartbeat_at, "lease_expires_at": w.lease_expires_at, "jobs": jobs.get(w.id, []),
                 "local": False} for w in rows]

    def online_count(self) -> int:
        with self.db.session() as s:
            return int(s.scalar(select(func.count(WorkerRow.id)).where(WorkerRow.status == "online",
                                                                      WorkerRow.lease_expires_at > now())))
