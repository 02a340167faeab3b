"""``simpletuner worker`` as a real subprocess beside a ``simpletuner server`` subprocess, for end-to-end drills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.server_process import REPO, ServerProcess
from tests.helpers import get_json_despite_drops


def worker_token(server: ServerProcess, folder: Path, name: str = "drill") -> Path:
    """Create a worker token on the server; returns the file it is stored in (mode 600)."""
    r = server.http.post("/api/worker-tokens", json={"name": name})
    assert r.status_code == 201, r.text
    path = folder / f"worker-token-{name}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(r.json()["token"])
    return path


class WorkerProcess:
    """One worker in its own process and data dir."""

    def __init__(self, server: ServerProcess, token_file: Path, name: str, tmp: Path, *extra: str,
                 env: dict | None = None):
        self.server, self.name = server, name
        self.data_dir = tmp / f"worker-{name}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "worker.log"
        self.cmd = [sys.executable, "-m", "simpletuner.cli", "worker", "--server", server.url, "--token-file",
                    str(token_file), "--name", name, "--data-dir", str(self.data_dir), "--devices", "none",
                    "--poll-interval", "0.2", "--log-level", "info", *extra]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_")
                    or k == "SIMPLETUNER_TINY_DIR"}
        self.env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WorkerProcess":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600  # a hang guard: the worker's imports take minutes on a stalled machine
        while not self._online(deadline):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"worker {self.name} did not register:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def _online(self, deadline: float) -> bool:
        workers = get_json_despite_drops(self.server.http, "/api/workers", self.server.proc, deadline)
        return any(w["name"] == self.name and w["status"] == "online" for w in workers)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


def fake_trainer_command() -> str:
    return json.dumps(["{python}", str(REPO / "tests" / "server" / "fake_trainer.py"), "--config", "{config}"])


def workers_of(server: ServerProcess, job_id: int) -> list[tuple[int, str, int]]:
    """(attempt, worker name, machine rank) of every machine that started the job, in order."""
    return [(e["attempt"], e["data"]["worker"], e["data"]["machine_rank"]) for e in server.events(job_id, "job")
            if e["data"].get("worker") and "pid" in e["data"]]
