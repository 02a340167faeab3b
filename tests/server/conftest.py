"""Fixtures: a fresh app per test (temp SQLite), a tiny dataset, and an in-process uvicorn for tests that
need real HTTP (the trainer's webhooks must reach the server)."""

from __future__ import annotations

import socket
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

FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")
LOOPBACK = ("127.0.0.1", 50000)
REMOTE = ("203.0.113.7", 50000)
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


def train_config(**extra):
    return {"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 3, **extra}


def data_backends(folder: str = "imgs"):
    return [
        {"id": "d", "type": "local", "instance_data_dir": folder, "caption_strategy": "textfile",
         "resolution": 64, "resolution_type": "pixel", "cache_dir_vae": "cache/vae"},
        {"id": "te", "dataset_type": "text_embeds", "type": "local", "default": True, "cache_dir": "cache/text"},
    ]


def job_body(**extra):
    body = {"train_config": train_config(**extra.pop("train", {})), "data_backends": data_backends()}
    body.update(extra)
    return body


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    imgs = work / "imgs"
    imgs.mkdir(parents=True)
    for i in range(2):
        (imgs / f"{i}.png").write_bytes(PNG)
        (imgs / f"{i}.txt").write_text("a cat")
    return work


def make_settings(tmp_path: Path, workdir: Path, **overrides) -> ServerSettings:
    values = dict(
        data_dir=tmp_path / "data",
        workdir=workdir,
        token="test-token",
        accelerators=[],
        job_command=["{python}", str(FAKE_TRAINER), "--config", "{config}"],
        poll_interval=0.05,
        heartbeat_interval=0.5,
        cancel_grace=2.0,
        stop_jobs_on_shutdown=True,
    )
    values.update(overrides)
    return ServerSettings(**values)


@pytest.fixture
def settings_factory(tmp_path, workdir):
    return lambda **kw: make_settings(tmp_path, workdir, **kw)


@pytest.fixture
def client(settings_factory):
    """TestClient from a loopback address, scheduler off (jobs stay queued)."""
    app = create_app(settings_factory(run_scheduler=False))
    with TestClient(app, client=LOOPBACK) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)

    def wait_status(self, job_id: int, statuses, timeout: float = 30) -> dict:
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
