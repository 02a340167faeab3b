"""``simpletuner server`` as a real subprocess for end-to-end drills, and reading a run's own record of its steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import free_port, get_json_despite_drops, wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
TOKEN = "drill-token"


class ServerProcess:
    """The server in its own process (cwd: the repo, so datasets/ resolves), token from the environment."""

    def __init__(self, data_dir: Path, tmp: Path, *extra: str, port: int | None = None, env: dict | None = None,
                 roots: list[Path] | None = None):
        self.port = port or free_port()
        self.data_dir, self.tmp, self.extra = data_dir, tmp, extra
        self.roots = roots if roots is not None else [REPO, tmp]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("SIMPLETUNER_") or k == "SIMPLETUNER_TINY_DIR"}
        self.env.update({"SIMPLETUNER_API_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.http = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self) -> "ServerProcess":
        self.log_path = self.tmp / f"server-{self.port}-{time.time_ns()}.log"
        self.log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(self.port),
               "--data-dir", str(self.data_dir), *[a for r in self.roots for a in ("--allowed-root", str(r))],
               "--launcher", "python", "--max-concurrent", "1", "--log-level", "warning", *self.extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_healthy(self.proc, self.url, self.log_path, timeout=300)
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def restart(self) -> "ServerProcess":
        return self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log and not self.log.closed:
            self.log.close()
        self.http.close()

    def job(self, job_id: int) -> dict:
        return self.http.get(f"/api/jobs/{job_id}").json()

    def events(self, job_id: int, type_: str | None = None) -> list[dict]:
        out, after = [], 0
        while True:
            params = {"after": after, "limit": 5000, **({"type": type_} if type_ else {})}
            page = self.http.get(f"/api/jobs/{job_id}/events", params=params).json()
            out += page["events"]
            if not page["events"]:
                return out
            after = page["last_id"]

    def wait(self, job_id: int, predicate, what: str, timeout: float = 600) -> dict:
        deadline = time.time() + timeout
        while True:
            job = get_json_despite_drops(self.http, f"/api/jobs/{job_id}", self.proc, deadline)
            if predicate(job):
                return job
            if time.time() > deadline:
                tail = self.http.get(f"/api/jobs/{job_id}/log", params={"tail": 40}).text
                raise AssertionError(f"job {job_id} never {what}: {job}\n{tail}")
            time.sleep(0.05)

    def wait_status(self, job_id: int, *statuses: str, timeout: float = 600) -> dict:
        return self.wait(job_id, lambda j: j["status"] in statuses, f"reached {statuses}", timeout)

    def wait_step(self, job_id: int, step: int, timeout: float = 600) -> dict:
        """Until the running job has reported ``step`` (and has a checkpoint on record)."""
        return self.wait(job_id, lambda j: j["status"] == "running" and (j["progress"] or {}).get("step", 0) >= step,
                         f"reached step {step}", timeout)


def logged_steps(run_dir: str | Path) -> list[int]:
    """Every step the trainer logged, in the order it logged them, across attempts (training_log.jsonl)."""
    steps = []
    path = Path(run_dir) / "output" / "training_log.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line cut short by the kill
    return steps


def resume_points(steps: list[int]) -> list[tuple[int, int]]:
    """(last step logged before a restart, first step logged after it) for each restart in the log."""
    return [(a, b) for a, b in zip(steps, steps[1:]) if b <= a]


def group_gone(pgid: int, timeout: float = 60) -> bool:
    """The process group has no live member left (zombies waiting for a reaper count as gone)."""
    from simpletuner.server.queue import group_alive

    deadline = time.time() + timeout
    while time.time() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.05)
    return False
