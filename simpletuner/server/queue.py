"""The job queue: submit, claim, launch, watch, cancel, and reconcile after a restart.

One scheduler thread per server owns the child processes. A job is claimed with an atomic
``UPDATE jobs SET status='running' ... WHERE id=? AND status='queued'`` (rowcount 1 wins), so two servers
sharing one database never both run a job. Each job runs as ``accelerate launch ... -m simpletuner.train``
in its own process group (``start_new_session``), with stdout/stderr in ``RUN_DIR/train.log``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from simpletuner.config import paths
from simpletuner.config.launch import LaunchSpec, accelerate_command

from . import rundir
from .broker import EventBroker
from .db import FINISHED, Database, JobEventRow, JobRow, now
from .pairs import dependency_state, waiting_for_cache_job
from .settings import ServerSettings, hostname
from .validation import _canon, absolutize_backends
from .workers import WORKER_PREFIX, Fleet

logger = logging.getLogger("simpletuner.server.queue")

SERVER_RESTARTED = "server restarted"
LORA_NAMES = rundir.LORA_NAMES


@dataclass
class Running:
    job_id: int
    pid: int
    pgid: int
    devices: list[str]
    cost: int
    proc: subprocess.Popen | None = None  # None for a job adopted from a previous server
    term_sent_at: float | None = None
    killed: bool = False
    log_file: Any = None
    waiter: threading.Thread | None = None


@dataclass
class PreparedRun:
    """A job attempt's run dir, written: the frozen config, data backends and prompt library."""

    run_dir: Path
    config_path: Path
    resume_step: int | None = None  # a retry continues from this checkpoint
    archived: str | None = None  # a retry that starts over moved the previous output here


@dataclass
class LaunchPlan:
    cmd: list[str]
    env: dict[str, str]
    cwd: Path
    run_dir: Path
    devices: list[str] = field(default_factory=list)
    resume_step: int | None = None  # a retry continues from this checkpoint
    archived: str | None = None  # a retry that starts over moved the previous output here


def pid_alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int | None) -> bool:
    if not pgid or pgid <= 0:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose members are all zombies still "exists"; treat that as gone.
    return any(_proc_state(pid) not in ("Z", "X", None) for pid in _group_members(pgid)) if _HAS_PROC else True


_HAS_PROC = Path("/proc/self/stat").exists()


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def read_log_tail(path: Path | str | None, lines: int = 60, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log file (reads at most ``max_bytes`` from its end)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _checkpoint_step(relative: Path) -> int:
    """The step of the ``checkpoint-<step>`` folder a run-relative path lies in (-1: none)."""
    steps = [int(part[len("checkpoint-"):]) for part in relative.parts
             if part.startswith("checkpoint-") and part[len("checkpoint-"):].isdigit()]
    return steps[0] if steps else -1


def _exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal N exits with 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class RetryConflict(Exception):
    """A retry of a job that is not finished."""


class JobManager:
    """Owns this server's job processes. All process handling happens on the scheduler thread."""

    def __init__(self, settings: ServerSettings, db: Database, broker: EventBroker):
        self.settings = settings
        self.db = db
        self.broker = broker
        self.host = hostname()
        self.pid = os.getpid()
        self.server_id = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self.accelerators = list(settings.resolved_accelerators())
        self.max_concurrent = settings.resolved_max_concurrent()
        self.procs: dict[int, Running] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_heartbeat = 0.0
        self._last_orphan_check = 0.0
        self.started_at = time.time()
        self.launch_latency: dict[int, float] = {}
        self.fleet = Fleet(settings, db, self)
        self._last_lease_check = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.reconcile()
        if self.settings.run_scheduler:
            self._thread = threading.Thread(target=self._loop, name="simpletuner-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.settings.stop_jobs_on_shutdown:
            self._terminate_all("server shut down")
        else:
            for run in self.procs.values():
                if run.log_file is not None:
                    run.log_file.close()
            if self.procs:
                logger.info("%d job(s) keep running; the next server start adopts them", len(self.procs))

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # keep scheduling whatever one bad job does
                logger.exception("scheduler tick failed")
            self._wake.wait(self.settings.poll_interval)

    def tick(self) -> None:
        """One scheduler pass: reap, cancel, heartbeat, adopt orphans, start queued jobs."""
        self._reap()
        self._handle_cancels()
        t = time.time()
        if t - self._last_heartbeat >= self.settings.heartbeat_interval:
            self._heartbeat()
        if t - self._last_orphan_check >= max(2 * self.settings.heartbeat_interval, 5.0):
            self.reconcile()
        if t - self._last_lease_check >= min(1.0, self.settings.worker_lease / 4):
            self._last_lease_check = t
            self.fleet.expire()  # workers that stopped heart-beating: their jobs go back to the queue
        while not self._stop.is_set() and self._start_next():
            pass

    # ---- events -----------------------------------------------------------------------------------
    def record(self, session, job: JobRow, type_: str, data: dict) -> JobEventRow:
        """Store a server-side event for ``job`` (call inside a write session)."""
        seq = session.scalar(
            select(func.coalesce(func.max(JobEventRow.seq), 0)).where(
                JobEventRow.job_id == job.id, JobEventRow.attempt == job.attempt, JobEventRow.source == "server"
            )
        )
        row = JobEventRow(
            job_id=job.id, attempt=job.attempt, source="server", seq=seq + 1, type=type_, time=now(), data=data
        )
        session.add(row)
        return row

    def job_event(self, session, job: JobRow, **extra: Any) -> None:
        data = {"status": job.status, "attempt": job.attempt}
        for key in ("reason", "exit_code", "pid"):
            if getattr(job, key) is not None:
                data[key] = getattr(job, key)
        data.update(extra)
        self.record(session, job, "job", data)

    # ---- submit / cancel (called from request threads) ----------------------------------------------
    def cost(self, num_processes: int) -> int:
        return num_processes if self.accelerators else 1

    def capacity_problem(self, num_processes: int, num_machines: int = 1) -> str | None:
        if num_machines > 1 or not self.settings.local_worker or self.fleet.online_count():
            return None  # workers on other machines run it (a job no worker fits waits for one that does)
        if self.accelerators and num_processes > len(self.accelerators):
            return f"needs {num_processes} accelerators; this server has {len(self.accelerators)}"
        return None

    def submit(self, **fields: Any) -> JobRow:
        with self.db.session(write=True) as s:
            job = JobRow(status="queued", submitted_at=now(), **fields)
            s.add(job)
            s.flush()
            self.job_event(s, job)
        self.broker.notify()
        self.wake()
        return job

    def cancel(self, job_id: int) -> JobRow | None:
        """Cancel a queued job at once; ask a running one to stop (SIGTERM, then SIGKILL after the grace)."""
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            if job is None:
                return None
            if job.status == "queued":
                res = s.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status == "queued")
                    .values(status="cancelled", finished_at=now(), reason="cancelled before it started")
                )
                if res.rowcount == 1:
                    s.refresh(job)
                    self.job_event(s, job)
            elif job.status == "running" and not job.cancel_requested:
                job.cancel_requested = True
                self.record(s, job, "job", {"status": "running", "attempt": job.attempt, "cancel_requested": True})
        self.broker.notify()
        self.wake()
        return job

    def retry(self, job_id: int, *, start_over: bool = False) -> JobRow | None:
        """Put a finished job back in the queue as its next attempt: it continues the same run from its newest
        valid checkpoint (same run dir), or with ``start_over`` from step 0 (the previous output kept aside).
        None when there is no such job; RetryConflict when it is not finished."""
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            if job is None:
                return None
            if job.status not in FINISHED:
                raise RetryConflict(f"job {job_id} is {job.status}; only a finished job can be retried")
            newest = rundir.newest_checkpoint(rundir.output_of(job.run_dir)) if job.run_dir else None
            if start_over:
                reason = "retry requested: starts over from step 0"
            elif newest is not None:
                reason = f"retry requested: resumes from step {newest[0]}"
            else:
                reason = "retry requested: no checkpoint yet, starts from step 0"
            res = s.execute(
                update(JobRow).where(JobRow.id == job_id, JobRow.status == job.status)
                .values(status="queued", reason=reason, start_over=start_over, retries=0, finished_at=None,
                        exit_code=None, cancel_requested=False, pid=None, pgid=None, owner=None,
                        owner_host=None, owner_pid=None, started_at=None, webhook_secret=None)
            )
            if res.rowcount != 1:
                raise RetryConflict(f"job {job_id} changed meanwhile; try again")
            s.refresh(job)
            self.job_event(s, job, start_over=start_over,
                           resumes_from_step=None if start_over or newest is None else newest[0])
        self.broker.notify()
        self.wake()
        return job

    def _retry_after_crash(self, job_id: int, reason: str, exit_code: int | None, results: dict) -> bool:
        """Re-queue a job whose trainer crashed, while it has automatic retries left (``max_retries``); the next
        attempt resumes from the newest checkpoint. True when it was re-queued."""
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            if job is None or job.cancel_requested or (job.retries or 0) >= (job.max_retries or 0):
                return False
            newest = rundir.newest_checkpoint(rundir.output_of(job.run_dir)) if job.run_dir else None
            where = f"resumes from step {newest[0]}" if newest else "starts from step 0 (no checkpoint yet)"
            tail = read_log_tail(Path(job.run_dir) / "train.log" if job.run_dir else None,
                                 self.settings.log_tail_lines) or None
            res = s.execute(
                update(JobRow).where(JobRow.id == job_id, JobRow.status == "running")
                .values(status="queued", retries=JobRow.retries + 1, exit_code=exit_code, results=results,
                        log_tail=tail, pid=None, pgid=None, owner=None, owner_host=None, owner_pid=None,
                        started_at=None, webhook_secret=None,
                        reason=f"{reason}; automatic retry {(job.retries or 0) + 1} of {job.max_retries}, {where}")
            )
            if res.rowcount != 1:
                return False
            s.refresh(job)
            self.job_event(s, job, retry=job.retries)
        self.broker.notify()
        logger.info("job %s: %s", job_id, job.reason)
        self._wake.set()
        return True

    # ---- claiming and launching ----------------------------------------------------------------------
    def _free_devices(self) -> list[str]:
        used = {d for r in self.procs.values() for d in r.devices}
        return [d for d in self.accelerators if d not in used]

    def _start_next(self) -> bool:
        """The server's own machine is one worker among the others: it claims single-machine jobs that fit it."""
        if not self.settings.local_worker or len(self.procs) >= self.max_concurrent:
            return False
        free = self._free_devices()
        with self.db.session() as s:
            # the whole queue, less the jobs still waiting for their cache job: a window of the first N would let N
            # waiting jobs (or N too big for this machine) hide the cache job they wait for
            candidates = s.execute(
                select(JobRow.id, JobRow.num_processes, JobRow.depends_on)
                .where(JobRow.status == "queued", JobRow.num_machines <= 1, ~waiting_for_cache_job())
                .order_by(JobRow.priority.desc(), JobRow.submitted_at, JobRow.id)
            ).all()
        for job_id, num_processes, depends_on in candidates:
            with self.db.session() as s:
                state, why = dependency_state(s, job_id, depends_on)
            if state == "waiting":
                continue  # its cache job was re-queued since the scan; jobs behind it may start
            if state == "failed":
                self._fail_queued(job_id, why)
                return True
            if self.accelerators and num_processes > len(self.accelerators) and self.fleet.online_count():
                continue  # too big for this machine: a worker with more devices takes it
            problem = self.capacity_problem(num_processes)
            if problem:
                self._fail_queued(job_id, problem)
                return True
            if self.accelerators and num_processes > len(free):
                return False  # strict priority: wait for devices rather than let later jobs pass
            secret = secrets.token_hex(32)
            with self.db.session(write=True) as s:
                t = now()
                claimed = s.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status == "queued")
                    .values(
                        status="running",
                        started_at=t,
                        heartbeat_at=t,
                        owner=self.server_id,
                        owner_host=self.host,
                        owner_pid=self.pid,
                        attempt=JobRow.attempt + 1,
                        webhook_secret=secret,
                        run_dir=str(self.run_dir_for(job_id)),
                        pid=None,
                        pgid=None,
                        exit_code=None,
                        finished_at=None,
                        # per-attempt fields start empty (a re-queued job's events keep the history)
                        reason=None,
                        error=None,
                        log_tail=None,
                        progress=None,
                    )
                ).rowcount
            if claimed != 1:
                continue  # another server took it; try the next one
            devices = free[:num_processes] if self.accelerators else []
            self._launch(job_id, devices)
            return True
        return False

    def _fail_queued(self, job_id: int, reason: str) -> None:
        with self.db.session(write=True) as s:
            res = s.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status == "queued")
                .values(status="failed", finished_at=now(), reason=reason)
            )
            if res.rowcount == 1:
                self.job_event(s, s.get(JobRow, job_id))
        self.broker.notify()

    def run_dir_for(self, job_id: int) -> Path:
        return self.settings.resolved_runs_dir() / f"job-{job_id}"

    def prepare_run(self, job: JobRow, write: bool = True) -> PreparedRun:
        """Write the run dir of the job's current attempt (frozen config, data backends, prompt library); with
        ``write=False`` only say where it is (another machine of the job wrote it)."""
        run_dir = self.run_dir_for(job.id)
        if not write:
            newest = rundir.newest_checkpoint(run_dir / "output") if job.attempt > 1 else None
            return PreparedRun(run_dir, run_dir / "config.json", newest[0] if newest else None)
        archived = rundir.prepare_attempt(run_dir, job.attempt, bool(job.start_over)) if job.attempt > 1 else None
        (run_dir / "output").mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in (job.train_config or {}).items()
                  if _canon(k) not in ("output_dir", "data_backend_config", "user_prompt_library")}
        config["output_dir"] = str(run_dir / "output")
        newest = rundir.newest_checkpoint(run_dir / "output") if job.attempt > 1 else None
        if newest is not None:
            config["resume_from_checkpoint"] = "latest"  # a retry continues the run (a damaged newest is skipped)
        config["data_backend_config"] = str(run_dir / "multidatabackend.json")
        if job.prompt_library:
            (run_dir / "user_prompt_library.json").write_text(json.dumps(job.prompt_library, indent=2))
            config["user_prompt_library"] = str(run_dir / "user_prompt_library.json")
        backends = absolutize_backends(job.data_backends or [], self.settings.workdir)
        (run_dir / "multidatabackend.json").write_text(json.dumps(backends, indent=2))
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
        return PreparedRun(run_dir, run_dir / "config.json", newest[0] if newest else None, archived)

    def plan(self, job: JobRow, devices: list[str]) -> LaunchPlan:
        """Write the run dir and build the command that runs the job on this machine."""
        prepared = self.prepare_run(job)
        run_dir, config_path = prepared.run_dir, prepared.config_path
        n = max(1, int(job.num_processes or 1))
        module = "simpletuner.cache" if job.kind == "cache" else "simpletuner.train"  # split training's stage 1
        if self.settings.job_command:
            fmt = {"python": sys.executable, "config": str(config_path), "run_dir": str(run_dir),
                   "num_processes": str(n), "job_id": str(job.id), "module": module}
            cmd = [part.format(**fmt) for part in self.settings.job_command]
        elif self.settings.launcher == "python" and n == 1:
            cmd = [sys.executable, "-m", module, "--config", str(config_path)]
        else:
            cmd = accelerate_command(LaunchSpec(num_processes=n, use_cpu=not self.accelerators),
                                     ["--config", str(config_path)], module=module)

        env = {k: v for k, v in os.environ.items() if k != "SIMPLETUNER_API_TOKEN"}
        env.update(
            SIMPLETUNER_WEBHOOK_URL=f"{self.settings.webhook_base_url()}/api/jobs/{job.id}/events",
            SIMPLETUNER_WEBHOOK_SECRET=job.webhook_secret or "",
            SIMPLETUNER_JOB_ID=str(job.id),
            SIMPLETUNER_JOB_KIND=job.kind or "train",
            SIMPLETUNER_RUN_DIR=str(run_dir),
            PYTHONUNBUFFERED="1",
        )
        # the trainer checks every path again when it opens it (a symlink may have been swapped in since)
        env[paths.ROOTS_ENV] = paths.roots_env_value(self.settings.resolved_allowed_roots())
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        elif not self.accelerators:
            env["ACCELERATE_USE_CPU"] = "1"
        return LaunchPlan(cmd=cmd, env=env, cwd=self.settings.workdir, run_dir=run_dir, devices=devices,
                          resume_step=prepared.resume_step, archived=prepared.archived)

    def _launch(self, job_id: int, devices: list[str]) -> None:
        t0 = time.perf_counter()
        with self.db.session() as s:
            job = s.get(JobRow, job_id)
        log_file = None
        try:
            plan = self.plan(job, devices)
            log_file = open(plan.run_dir / "train.log", "ab", buffering=0)
            log_file.write(f"=== job {job.id} attempt {job.attempt}: {' '.join(plan.cmd)}\n".encode())
            proc = subprocess.Popen(
                plan.cmd,
                cwd=plan.cwd,
                env=plan.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except Exception as exc:
            if log_file is not None:
                log_file.close()
            logger.exception("job %s: could not start", job_id)
            self._finish(job_id, status="failed", reason=f"could not start the trainer: {exc}", exit_code=None)
            return
        self.launch_latency[job_id] = time.perf_counter() - t0
        run = Running(job_id=job_id, pid=proc.pid, pgid=proc.pid, devices=devices,
                      cost=self.cost(job.num_processes), proc=proc, log_file=log_file)
        run.waiter = threading.Thread(target=self._wait_proc, args=(proc,), daemon=True)
        run.waiter.start()
        self.procs[job_id] = run
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            job.pid, job.pgid = proc.pid, proc.pid
            job.run_dir = str(plan.run_dir)
            job.devices = ",".join(devices) or None
            job.start_over = False
            extra = {"resumes_from_step": plan.resume_step} if plan.resume_step is not None else {}
            if plan.archived:
                extra["previous_output"] = plan.archived
            self.job_event(s, job, run_dir=job.run_dir, **extra)
        self.broker.notify()
        logger.info("job %s started (pid %s)", job_id, proc.pid)

    def _wait_proc(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._wake.set()

    # ---- watching ------------------------------------------------------------------------------------
    def _reap(self) -> None:
        for job_id, run in list(self.procs.items()):
            if run.proc is not None:
                code = run.proc.poll()
                if code is None:
                    continue
                self._complete(run, _exit_code(code))
            elif not group_alive(run.pgid):
                self._complete(run, None)

    def _complete(self, run: Running, exit_code: int | None) -> None:
        self.procs.pop(run.job_id, None)
        _signal_group(run.pgid, signal.SIGKILL)  # stragglers (e.g. workers) the leader left behind
        if run.log_file is not None:
            run.log_file.close()
        with self.db.session() as s:
            job = s.get(JobRow, run.job_id)
        results = dict(job.results or {})
        results.update(self._collect_results(job))
        trainer_said = (job.results or {}).get("trainer_status")
        if job.cancel_requested:
            status, reason = "cancelled", "cancelled by user"
        elif exit_code == 0:
            status, reason = "succeeded", None
        elif exit_code is None:
            # Adopted after a restart: not our child, so no exit code. Its run dir says whether it finished.
            ok = trainer_said == "succeeded" or (job.run_dir and rundir.finished_on_disk(job.run_dir) is not None)
            status = "succeeded" if ok else "failed"
            reason = None if ok else "trainer ended while unobserved (exit code unknown)"
        elif run.killed:
            status, reason = "failed", f"killed (exit code {exit_code})"
        else:
            status, reason = "failed", f"trainer exited with code {exit_code}"
        if status == "failed" and self._retry_after_crash(run.job_id, reason, exit_code, results):
            return
        self._finish(run.job_id, status=status, reason=reason, exit_code=exit_code, results=results)

    def complete_remote(self, job_id: int, attempt: int, exit_code: int | None, log_tail: str | None = None) -> None:
        """Every machine of a job that workers ran has ended (``exit_code``: the first failing machine's, else
        0): succeeded, cancelled, re-queued by ``max_retries``, or failed."""
        with self.db.session() as s:
            job = s.get(JobRow, job_id)
        if job is None or job.status != "running" or job.attempt != attempt:
            return
        results = {**(job.results or {}), **self._collect_results(job)}
        if job.cancel_requested:
            status, reason = "cancelled", "cancelled by user"
        elif exit_code == 0:
            status, reason = "succeeded", None
        else:
            status, reason = "failed", f"trainer exited with code {exit_code} on a worker"
        if status == "failed" and self._retry_after_crash(job_id, reason, exit_code, results):
            return
        self._finish(job_id, status=status, reason=reason, exit_code=exit_code, results=results)
        if log_tail and status == "failed":
            with self.db.session(write=True) as s:
                row = s.get(JobRow, job_id)
                row.log_tail = row.log_tail or log_tail

    def _collect_results(self, job: JobRow) -> dict:
        out: dict[str, Any] = {}
        if not job.run_dir:
            return out
        output = Path(job.run_dir) / "output"
        summary = output / (rundir.CACHE_SUMMARY if job.kind == "cache" else "run_summary.json")
        if summary.exists():
            try:
                data = json.loads(summary.read_text())
                if isinstance(data, dict):
                    out.update(data)
            except (OSError, ValueError):
                pass
        if not out.get("lora_path") and output.is_dir():
            for name in LORA_NAMES:
                hits = sorted(output.rglob(name), key=lambda p: (len(p.parts), str(p)))
                # the final one; without it, the newest checkpoint's (by step: as text checkpoint-20 > -100)
                hits = [h for h in hits if "checkpoint" not in str(h.relative_to(output))] or sorted(
                    hits, key=lambda p: -_checkpoint_step(p.relative_to(output)))
                if hits:
                    out["lora_path"] = str(hits[0])
                    break
        out.setdefault("output_dir", str(output))
        newest = rundir.newest_checkpoint(output)
        if newest is not None:  # what a Retry resumes from
            out["last_checkpoint"], out["last_checkpoint_step"] = str(newest[1]), newest[0]
        return out

    def _finish(self, job_id: int, *, status: str, reason: str | None, exit_code: int | None,
                results: dict | None = None) -> None:
        with self.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            job.status = status
            job.reason = reason
            job.exit_code = exit_code
            job.finished_at = now()
            job.webhook_secret = None  # a finished job's trainer has nothing more to say
            if results is not None:
                job.results = results
            if status == "failed":
                job.log_tail = read_log_tail(Path(job.run_dir) / "train.log" if job.run_dir else None,
                                             self.settings.log_tail_lines) or None
            self.job_event(s, job, results=job.results)
        self.broker.notify()
        logger.info("job %s %s%s", job_id, status, f" ({reason})" if reason else "")
        self._wake.set()

    def _handle_cancels(self) -> None:
        if not self.procs:
            return
        with self.db.session() as s:
            wanted = set(s.scalars(select(JobRow.id).where(
                JobRow.id.in_(list(self.procs)), JobRow.cancel_requested.is_(True))))
        t = time.time()
        for job_id in wanted:
            run = self.procs.get(job_id)
            if run is None:
                continue
            if run.term_sent_at is None:
                run.term_sent_at = t
                _signal_group(run.pgid, signal.SIGTERM)
                logger.info("job %s: SIGTERM sent to process group %s", job_id, run.pgid)
            elif not run.killed and t - run.term_sent_at >= self.settings.cancel_grace:
                run.killed = True
                _signal_group(run.pgid, signal.SIGKILL)
                logger.info("job %s: SIGKILL sent to process group %s", job_id, run.pgid)

    def _heartbeat(self) -> None:
        self._last_heartbeat = time.time()
        with self.db.session(write=True) as s:
            s.execute(update(JobRow).where(JobRow.owner == self.server_id, JobRow.status == "running")
                      .values(heartbeat_at=now()))

    def _terminate_all(self, reason: str) -> None:
        for run in list(self.procs.values()):
            _signal_group(run.pgid, signal.SIGTERM)
        deadline = time.time() + self.settings.cancel_grace
        while self.procs and time.time() < deadline:
            for run in list(self.procs.values()):
                alive = (run.proc.poll() is None) if run.proc is not None else group_alive(run.pgid)
                if not alive:
                    self._complete_as(run, "cancelled", reason)
            time.sleep(0.05)
        for run in list(self.procs.values()):
            _signal_group(run.pgid, signal.SIGKILL)
            if run.proc is not None:
                try:
                    run.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            self._complete_as(run, "cancelled", reason)

    def _complete_as(self, run: Running, status: str, reason: str) -> None:
        self.procs.pop(run.job_id, None)
        _signal_group(run.pgid, signal.SIGKILL)
        if run.log_file is not None:
            run.log_file.close()
        code = run.proc.poll() if run.proc is not None else None
        self._finish(run.job_id, status=status, reason=reason,
                     exit_code=_exit_code(code) if code is not None else None)

    # ---- restart safety --------------------------------------------------------------------------------
    def _orphaned(self, job: JobRow, t: float) -> bool:
        if job.owner == self.server_id:
            return False  # ours: the scheduler thread tracks it (claim and launch happen on that thread)
        if (job.owner or "").startswith(WORKER_PREFIX):
            return False  # a worker's: its lease says whether it lives (Fleet.expire)
        stale = job.heartbeat_at is None or t - job.heartbeat_at > self.settings.orphan_timeout
        if job.owner_host == self.host:
            return stale or not pid_alive(job.owner_pid) or job.owner_pid == self.pid
        return stale

    def _ours(self, job: JobRow) -> bool:
        """Is the job's process group alive on this machine and really this job's trainer?"""
        if job.owner_host != self.host or not job.pgid or not group_alive(job.pgid):
            return False
        env = _environ(job.pid) if job.pid else None
        if env is None:
            return False
        return env.get("SIMPLETUNER_JOB_ID") == str(job.id) and env.get("SIMPLETUNER_WEBHOOK_SECRET") == (job.webhook_secret or "")

    def reconcile(self) -> list[tuple[int, str]]:
        """Take over jobs left ``running`` by a server that is gone: adopt a live trainer of ours; otherwise read
        its run dir first (a trainer that finished meanwhile succeeded), then put it back in the queue
        (``retry_on_restart``, or ``max_retries`` left) or mark it failed ("server restarted")."""
        self._last_orphan_check = time.time()
        t = time.time()
        outcomes: list[tuple[int, str]] = []
        with self.db.session() as s:
            running = list(s.scalars(select(JobRow).where(JobRow.status == "running")))
        for job in running:
            if job.id in self.procs or not self._orphaned(job, t):
                continue
            with self.db.session(write=True) as s:
                took = s.execute(
                    update(JobRow)
                    .where(JobRow.id == job.id, JobRow.status == "running", JobRow.owner == job.owner)
                    .values(owner=self.server_id, owner_host=self.host, owner_pid=self.pid, heartbeat_at=now())
                ).rowcount
            if took != 1:
                continue
            if self._ours(job):
                devices = [d for d in (job.devices or "").split(",") if d]
                self.procs[job.id] = Running(job_id=job.id, pid=job.pid, pgid=job.pgid, devices=devices,
                                             cost=self.cost(job.num_processes))
                with self.db.session(write=True) as s:
                    row = s.get(JobRow, job.id)
                    self.record(s, row, "job", {"status": "running", "attempt": row.attempt, "pid": row.pid,
                                                "adopted": True, "reason": "adopted after server restart"})
                outcomes.append((job.id, "adopted"))
                logger.info("job %s: adopted running trainer (pid %s) after restart", job.id, job.pid)
                continue
            if job.pgid and job.owner_host == self.host:
                _signal_group(job.pgid, signal.SIGKILL)  # never leave a half-known process behind
            results = {**(job.results or {}), **self._collect_results(job)}
            if job.run_dir and rundir.finished_on_disk(job.run_dir) is not None:
                # the trainer finished while no server watched: its run dir has the summary and the model
                self._finish(job.id, status="succeeded", reason="finished while the server was down",
                             exit_code=None, results=results)
                outcomes.append((job.id, "succeeded"))
            elif job.cancel_requested:
                self._finish(job.id, status="cancelled", reason="cancelled by user (server restarted)",
                             exit_code=None, results={**(job.results or {})})
                outcomes.append((job.id, "cancelled"))
            elif job.retry_on_restart:
                with self.db.session(write=True) as s:
                    row = s.get(JobRow, job.id)
                    row.status = "queued"
                    row.reason = f"re-queued: {SERVER_RESTARTED}"
                    row.pid = row.pgid = None
                    row.owner = row.owner_host = row.owner_pid = None
                    row.started_at = None
                    row.webhook_secret = None
                    row.results = results
                    self.job_event(s, row)
                outcomes.append((job.id, "requeued"))
            elif self._retry_after_crash(job.id, f"trainer lost ({SERVER_RESTARTED})", None, results):
                outcomes.append((job.id, "requeued"))
            else:
                self._finish(job.id, status="failed", reason=SERVER_RESTARTED, exit_code=None, results=results)
                outcomes.append((job.id, "failed"))
        if outcomes:
            self.broker.notify()
            self._wake.set()
        return outcomes

    # ---- info ----------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {
            "server_id": self.server_id,
            "max_concurrent": self.max_concurrent,
            "accelerators": self.accelerators,
            "running_here": sorted(self.procs),
            "local_worker": self.settings.local_worker,
        }
