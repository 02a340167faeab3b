"""``simpletuner worker --server URL --token-file F [--devices 0,1]``: run a server's jobs on this machine.

The worker registers its devices, heartbeats (each heartbeat renews its lease), claims the jobs that fit, and runs
each with the shared launcher (``accelerate launch``, one machine's share of a multi-machine job with its
``machine_rank`` and rank 0's rendezvous address). The trainer posts its events (progress, images, checkpoints)
straight to the server's webhook URL; the worker reports when its share started and ended. Run dirs live on storage
that the server and every worker reach at the same path.

A worker that cannot renew its lease stops its trainers by itself once the lease has run out (by then the server
has handed the job to another worker), and every trainer dies with the worker (``PR_SET_PDEATHSIG``), so a job never
runs twice. No torch here: the trainer runs in its own processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simpletuner.config import paths
from simpletuner.config.events import JOB_ID_ENV, SECRET_ENV, URL_ENV
from simpletuner.config.launch import PARENT_ENV, LaunchSpec, accelerate_command, die_with_parent, launch_env

logger = logging.getLogger("simpletuner.worker")
TOKEN_ENV = "SIMPLETUNER_WORKER_TOKEN"
JOB_COMMAND_ENV = "SIMPLETUNER_WORKER_JOB_COMMAND"  # tests and benchmarks: a JSON list replacing the trainer


class ServerRefused(Exception):
    """The server answered with an error that waiting will not fix (bad token, bad request)."""


class Gone(Exception):
    """The server no longer knows this worker (lease lost, token revoked): stop everything, register again."""


@dataclass
class Share:
    """One running share of a job on this machine."""

    claim: dict
    proc: subprocess.Popen
    devices: list[str]
    log: Any
    stop_sent_at: float | None = None
    killed: bool = False


@dataclass
class WorkerOptions:
    server: str
    token: str
    name: str = field(default_factory=socket.gethostname)
    devices: list[str] = field(default_factory=list)
    slots: int | None = None
    address: str | None = None
    data_dir: Path = field(default_factory=lambda: Path.cwd() / ".simpletuner-worker")
    poll_interval: float = 1.0
    stop_grace: float = 15.0
    port_range: tuple[int, int] = (29500, 29999)
    job_command: list[str] | None = None


class Worker:
    def __init__(self, options: WorkerOptions):
        import httpx

        self.o = options
        self.http = httpx.Client(base_url=options.server.rstrip("/"), timeout=30,
                                 headers={"Authorization": f"Bearer {options.token}"})
        self.id: str | None = None
        self.lease = 30.0
        self.heartbeat_every = 10.0
        self.last_renewed = 0.0
        self.last_heartbeat = 0.0
        self.shares: dict[int, Share] = {}  # assignment id -> share
        self.unreported: list[tuple[int, int | None, str | None]] = []  # finished shares the server has not heard of
        self.stopping = False
        self.capacity = options.slots or max(1, len(options.devices))

    # ---- HTTP -------------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None):
        r = self.http.request(method, path, json=body)
        if r.status_code == 410:
            raise Gone(r.json().get("detail", "gone"))
        if r.status_code in (401, 403, 404, 422):
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text
            raise ServerRefused(f"{method} {path}: HTTP {r.status_code}: {detail}")
        r.raise_for_status()
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.o.data_dir / "worker.json"

    def register(self) -> None:
        previous = None
        try:
            previous = json.loads(self._state_file().read_text()).get("id")
        except (OSError, ValueError, AttributeError):
            pass
        body = {"name": self.o.name, "host": socket.gethostname(), "address": self.o.address,
                "devices": self.o.devices, "slots": self.capacity, "replaces": previous,
                "info": {"pid": os.getpid(), "python": sys.version.split()[0]}}
        reply = self._call("POST", "/api/workers", body)
        self.id, self.lease = reply["id"], float(reply["lease_seconds"])
        self.heartbeat_every = float(reply["heartbeat_interval"])
        self.last_renewed = self.last_heartbeat = time.monotonic()
        self.o.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.id, "server": self.o.server}))
        os.replace(tmp, self._state_file())
        logger.info("registered as %s (%s) with %s; lease %.0fs", self.o.name, self.id[:8],
                    f"devices {','.join(self.o.devices)}" if self.o.devices else f"{self.capacity} CPU slot(s)",
                    self.lease)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        while True:
            try:
                self.register()
                break
            except ServerRefused as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:  # the server is not up yet
                logger.warning("cannot reach %s (%s); retrying", self.o.server, exc)
                if self.stopping:
                    return 0
                time.sleep(self.o.poll_interval)
        while not (self.stopping and not self.shares):
            try:
                self.tick()
            except Gone as exc:
                logger.warning("the server dropped this worker (%s): stopping its jobs, registering again", exc)
                self._stop_all(force=True)
                self._register_again()
            except ServerRefused as exc:
                logger.error("%s", exc)
            except Exception as exc:  # the network or the server: keep going, the lease decides
                logger.warning("server unreachable (%s)", exc)
            time.sleep(self.o.poll_interval)
        self._report_finished()
        return 0

    def _register_again(self) -> None:
        self.unreported.clear()  # the server re-queued those jobs already
        while not self.stopping:
            try:
                self.register()
                return
            except Exception as exc:
                logger.warning("cannot register (%s); retrying", exc)
                time.sleep(self.o.poll_interval)

    def _on_signal(self, signum, frame) -> None:
        if self.stopping:  # a second Ctrl-C: stop the trainers now
            self._stop_all(force=True)
        self.stopping = True
        self._stop_all(force=False)

    def tick(self) -> None:
        self._reap()
        self._report_finished()
        t = time.monotonic()
        if t - self.last_renewed > self.lease and self.shares:
            # the server has handed our jobs to someone else by now: never let two trainers share a run
            logger.error("lease lost (no heartbeat for %.0fs): stopping %d job(s)", t - self.last_renewed,
                         len(self.shares))
            self._stop_all(force=True)
        if t - self.last_heartbeat >= self.heartbeat_every:
            self.last_heartbeat = t
            reply = self._call("POST", f"/api/workers/{self.id}/heartbeat")
            self.last_renewed = time.monotonic()
            for item in reply["stop"]:
                share = self.shares.get(item["assignment_id"])
                if share is not None:
                    self._stop(share, force=False)
        self._escalate()
        while not self.stopping and len(self.shares) < self.capacity:
            claim = self._call("POST", f"/api/workers/{self.id}/claim", {"port": self._free_port()})
            if not claim:
                break
            self._launch(claim)

    # ---- running shares ----------------------------------------------------------------------------------------
    def _free_port(self) -> int | None:
        lo, hi = self.o.port_range
        for port in range(lo + os.getpid() % max(1, hi - lo), hi + 1):
            with socket.socket() as sock:
                try:
                    sock.bind(("", port))
                    return port
                except OSError:
                    continue
        return None

    def _free_devices(self) -> list[str]:
        used = {d for s in self.shares.values() for d in s.devices}
        return [d for d in self.o.devices if d not in used]

    def _launch(self, claim: dict) -> None:
        aid = claim["assignment_id"]
        run_dir = Path(claim["run_dir"])
        spec = LaunchSpec(num_processes=claim["num_processes"], num_machines=claim["num_machines"],
                          machine_rank=claim["machine_rank"], main_process_ip=claim["main_process_ip"],
                          main_process_port=claim["main_process_port"], use_cpu=not self.o.devices)
        devices = self._free_devices()[:spec.processes_here] if self.o.devices else []
        if not Path(claim["config"]).is_file():
            why = (f"run dir {run_dir} is not reachable from worker {self.o.name}: put the server's runs dir on "
                   "storage every worker mounts at the same path (see docs/deployment.md)")
            logger.error("job %s: %s", claim["job_id"], why)
            self.unreported.append((aid, 2, why))
            return
        rank = claim["machine_rank"]
        env = launch_env(spec)
        env.pop(TOKEN_ENV, None)
        env.update({JOB_ID_ENV: str(claim["job_id"]), "SIMPLETUNER_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1",
                    "SIMPLETUNER_MACHINE_RANK": str(rank), PARENT_ENV: "1",
                    paths.ROOTS_ENV: paths.roots_env_value([Path(r) for r in claim["allowed_roots"]])})
        if rank == 0 and claim.get("webhook_secret"):  # machine 0's main process reports for the whole job
            env.update({URL_ENV: f"{self.o.server.rstrip('/')}/api/jobs/{claim['job_id']}/events",
                        SECRET_ENV: claim["webhook_secret"]})
        else:
            env.pop(URL_ENV, None)
            env.pop(SECRET_ENV, None)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if self.o.job_command:
            fmt = {"python": sys.executable, "config": claim["config"], "run_dir": str(run_dir),
                   "num_processes": str(spec.num_processes), "job_id": str(claim["job_id"]),
                   "machine_rank": str(rank), "module": claim.get("module", "simpletuner.train")}
            cmd = [part.format(**fmt) for part in self.o.job_command]
        else:
            cmd = accelerate_command(spec, ["--config", claim["config"]],
                                     module=claim.get("module", "simpletuner.train"))
        log_path = run_dir / ("train.log" if rank == 0 else f"train-machine{rank}.log")
        log = open(log_path, "ab", buffering=0)
        log.write(f"=== job {claim['job_id']} attempt {claim['attempt']} machine {rank} on worker {self.o.name}: "
                  f"{' '.join(cmd)}\n".encode())
        try:
            proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    preexec_fn=die_with_parent)
        except OSError as exc:
            log.close()
            self.unreported.append((aid, 127, f"could not start the trainer: {exc}"))
            return
        self.shares[aid] = Share(claim, proc, devices, log)
        logger.info("job %s attempt %s machine %d/%d: started (pid %d)", claim["job_id"], claim["attempt"], rank,
                    spec.num_machines, proc.pid)
        try:
            self._call("POST", f"/api/workers/{self.id}/assignments/{aid}/started",
                       {"pid": proc.pid, "devices": devices})
        except ServerRefused:  # 409: the job moved on meanwhile
            self._stop(self.shares[aid], force=True)

    def _reap(self) -> None:
        for aid, share in list(self.shares.items()):
            code = share.proc.poll()
            if code is None:
                continue
            self.shares.pop(aid)
            _kill_group(share.proc.pid, signal.SIGKILL)  # ranks the launcher left behind
            share.log.close()
            code = 128 - code if code < 0 else code
            logger.info("job %s machine %d: exited with code %d", share.claim["job_id"],
                        share.claim["machine_rank"], code)
            tail = _log_tail(Path(share.log.name)) if code else None
            self.unreported.append((aid, code, tail))

    def _report_finished(self) -> None:
        while self.unreported:
            aid, code, tail = self.unreported[0]
            try:
                self._call("POST", f"/api/workers/{self.id}/assignments/{aid}/finished",
                           {"exit_code": code, "log_tail": tail})
            except ServerRefused as exc:  # an assignment the server dropped with this worker: nothing to tell
                logger.warning("%s", exc)
            self.unreported.pop(0)

    def _stop(self, share: Share, force: bool) -> None:
        if force:
            share.killed = True
            _kill_group(share.proc.pid, signal.SIGKILL)
        elif share.stop_sent_at is None:
            share.stop_sent_at = time.monotonic()
            _kill_group(share.proc.pid, signal.SIGTERM)

    def _escalate(self) -> None:
        t = time.monotonic()
        for share in self.shares.values():
            if share.stop_sent_at is not None and not share.killed and t - share.stop_sent_at > self.o.stop_grace:
                self._stop(share, force=True)

    def _stop_all(self, force: bool) -> None:
        for share in list(self.shares.values()):
            self._stop(share, force)
        if force:
            for share in list(self.shares.values()):
                try:
                    share.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            self._reap()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _log_tail(path: Path, lines: int = 60) -> str | None:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 32 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    return "\n".join(text.splitlines()[-lines:]) or None


# ---- the command ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("SIMPLETUNER_SERVER", "http://127.0.0.1:8001"),
                        help="the server's URL (default $SIMPLETUNER_SERVER or http://127.0.0.1:8001)")
    parser.add_argument("--token", default=None,
                        help=f"a worker token (prefer ${TOKEN_ENV} or --token-file: `ps` shows arguments)")
    parser.add_argument("--token-file", type=Path, default=None, help="read the worker token from this file")
    parser.add_argument("--devices", default=None,
                        help="accelerator ids to use, e.g. 0,1 (default: every GPU nvidia-smi lists; 'none': CPU)")
    parser.add_argument("--slots", type=int, default=None,
                        help="jobs at once (default: one per device, 1 on a CPU machine)")
    parser.add_argument("--name", default=socket.gethostname(), help="shown in the server's worker list")
    parser.add_argument("--address", default=None,
                        help="where other workers reach this machine for a multi-machine job's rendezvous "
                             "(default: the address the server sees)")
    parser.add_argument("--port-range", default="29500-29999",
                        help="rendezvous ports this machine may open when it leads a multi-machine job")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="this worker's own state (default ./.simpletuner-worker)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between claims (default 1)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _token(args) -> str:
    if args.token_file is not None:
        try:
            token = args.token_file.expanduser().read_text().strip()
        except OSError as exc:
            raise SystemExit(f"error: --token-file {args.token_file}: cannot be read ({exc.strerror or exc})")
        if not token:
            raise SystemExit(f"error: --token-file {args.token_file}: the file is empty")
        return token
    if args.token:
        print("warning: --token shows the worker token to every user of this machine (`ps`); prefer "
              f"${TOKEN_ENV} or --token-file", file=sys.stderr)
        return args.token
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"error: no worker token: give --token-file FILE or set ${TOKEN_ENV} (create one with "
                         "`simpletuner workers token create NAME`)")
    return token


def _devices(value: str | None) -> list[str]:
    if value is None:
        from .settings import detect_accelerators

        return detect_accelerators()
    if value.strip().lower() in ("", "none", "cpu"):
        return []
    devices = [d.strip() for d in value.split(",") if d.strip()]
    bad = [d for d in devices if not d.replace("-", "").replace(":", "").isalnum()]
    if bad:
        raise SystemExit(f"error: --devices: {bad[0]!r} is not a device id (e.g. 0,1 or none)")
    return devices


def _port_range(value: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in value.split("-", 1))
    except ValueError:
        raise SystemExit(f"error: --port-range: {value!r} is not LOW-HIGH (e.g. 29500-29999)") from None
    if not 1 <= lo <= hi <= 65535:
        raise SystemExit(f"error: --port-range: {value!r} is not inside 1-65535")
    return lo, hi


def _job_command() -> list[str] | None:
    raw = os.environ.get(JOB_COMMAND_ENV)
    if not raw:
        return None
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SystemExit(f"error: ${JOB_COMMAND_ENV} must be a JSON list of strings")
    return value


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.slots is not None and args.slots < 1:
        raise SystemExit("error: --slots: must be at least 1")
    options = WorkerOptions(server=args.server, token=_token(args), name=args.name, devices=_devices(args.devices),
                            slots=args.slots, address=args.address,
                            data_dir=args.data_dir or Path.cwd() / ".simpletuner-worker",
                            poll_interval=args.poll_interval, port_range=_port_range(args.port_range),
                            job_command=_job_command())
    return Worker(options).run()
