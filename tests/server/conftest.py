"""Fixtures: a fresh app per test (temp SQLite), a tiny dataset, and an in-process uvicorn for tests that
need real HTTP (the trainer's webhooks must reach the server)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from simpletuner.server.settings import ServerSettings
from tests.helpers import free_port
from tests.server.helpers import LOOPBACK, PNG, make_settings


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    imgs = work / "imgs"
    imgs.mkdir(parents=True)
    for i in range(2):
        (imgs / f"{i}.png").write_bytes(PNG)
        (imgs / f"{i}.txt").write_text("a cat")
    return work


@pytest.fixture
def settings_factory(tmp_path, workdir):
    return lambda **kw: make_settings(tmp_path, workdir, **kw)


@pytest.fixture
def client(settings_factory):
    """TestClient from a loopback address, scheduler off (jobs stay queued)."""
    app = create_app(settings_factory(run_scheduler=False))
    with TestClient(app, client=LOOPBACK, base_url="http://127.0.0.1") as c:
        yield c


class LiveServer:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{settings.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 120  # a hang guard: a busy machine starts threads slowly
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)

    def wait_status(self, job_id: int, statuses, timeout: float = 300) -> dict:
        """Poll until the job is in one of ``statuses`` (a running job: until its process has started)."""
        statuses = {statuses} if isinstance(statuses, str) else set(statuses)
        deadline = time.time() + timeout
        while True:
            job = self.http.get(f"/api/jobs/{job_id}").json()
            if job["status"] in statuses and (job["status"] != "running" or job["pid"]):
                return job
            if time.time() > deadline:
                raise AssertionError(f"job {job_id} is {job['status']}, wanted {statuses}: {job}")
            time.sleep(0.05)


@pytest.fixture
def live_server(settings_factory):
    """Start an in-process uvicorn; call with settings overrides."""
    servers = []

    def start(**overrides) -> LiveServer:
        port = free_port()
        srv = LiveServer(settings_factory(port=port, **overrides))
        servers.append(srv.__enter__())
        return srv

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


def python() -> str:
    return sys.executable
