"""Browser tests: Debian's Chromium, driven by Playwright, against a real `simpletuner server` subprocess.

Chromium is installed with apt when it is missing (root only); without it, or without the playwright
package, the tests skip and say why. Screenshots and the server's log go to test-artifacts/browser/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.helpers import free_port, get_json_despite_drops, wait_until_healthy

ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _find_chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _install_chromium() -> str:
    """apt-get install chromium, or an explanation of why that cannot happen here."""
    if not shutil.which("apt-get"):
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "installing it needs root (run: apt-get update && apt-get install -y chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(cmd)} failed: {exc}"
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}"
    return ""


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = _find_chromium()
    if path is None:
        why = _install_chromium()
        path = _find_chromium()
        if path is None:
            pytest.skip(f"Debian's chromium is not installed and could not be installed: {why or 'unknown reason'}")
    return path


@pytest.fixture(scope="session")
def browser(chromium_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                                                  "(pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Server:
    """`simpletuner server` in a subprocess (uvicorn on a free loopback port) with a private data dir and a
    working dir holding a copy of the sample dataset."""

    def __init__(self, root: Path, name: str, fake_gpus: int = 0, extra_args: tuple[str, ...] = (),
                 token: str | None = None):
        self.extra_args = list(extra_args)
        self.workdir = root / "work"
        self.data_dir = root / "data"
        shutil.copytree(REPO / "datasets" / "sample", self.workdir / "datasets" / "sample")
        held_out = self.workdir / "datasets" / "held-out"  # for eval loss
        held_out.mkdir()
        for name in ("00_orange_circle.png", "00_orange_circle.txt", "01_red_square.png", "01_red_square.txt"):
            shutil.copy(REPO / "datasets" / "sample" / name, held_out / name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.log_path = ARTIFACTS / f"server-{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SIMPLETUNER_API_TOKEN", None)
        if token:  # from the environment: a token on the command line would show in ps
            env["SIMPLETUNER_API_TOKEN"] = token
        if fake_gpus:  # the server finds accelerators with `nvidia-smi -L`; this one lists made-up GPUs
            bin_dir = root / "bin"
            bin_dir.mkdir()
            lines = "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-fake-{i})'\n" for i in range(fake_gpus))
            (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}")
            (bin_dir / "nvidia-smi").chmod(0o755)
            env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        self.env = env
        self.log = open(self.log_path, "w")
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"} if token else None)
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(self.port),
             "--data-dir", str(self.data_dir), "--launcher", "python", "--cancel-grace", "30",
             "--stop-jobs-on-exit", "--log-level", "warning", *self.extra_args],
            cwd=self.workdir, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_healthy(self.proc, self.url, self.log_path, timeout=300)

    def crash_and_restart(self) -> None:
        """SIGKILL the server (its trainers run on in their own sessions) and start it again on the same port
        and database; the new server adopts the running jobs."""
        self.proc.kill()
        self.proc.wait(10)
        self.start()

    def all_events(self, job_id: int) -> list[dict]:
        out, after = [], 0
        while True:
            page = self.http.get(f"/api/jobs/{job_id}/events", params={"after": after, "limit": 5000}).json()
            out += page["events"]
            if not page["events"]:
                return out
            after = page["last_id"]

    def wait_job(self, job_id: int, statuses: set[str], timeout: float = 600) -> dict:
        deadline = time.time() + timeout
        while True:
            job = get_json_despite_drops(self.http, f"/api/jobs/{job_id}", self.proc, deadline, pause=0.5)
            if job["status"] in statuses:
                return job
            if time.time() > deadline:
                raise AssertionError(f"job {job_id} is still {job['status']} after {timeout}s")
            time.sleep(0.5)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    srv = Server(tmp_path_factory.mktemp("browser"), request.module.__name__.rsplit(".", 1)[-1])
    yield srv
    srv.close()


class PageErrors(list):
    """Console errors and uncaught exceptions of one page."""

    def watch(self, page) -> None:
        page.on("console", lambda m: self.append(f"console.{m.type}: {m.text} @ {m.location}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.append(f"uncaught: {e}"))


@pytest.fixture
def page(browser, request):
    """A fresh page at 1280x800; fails the test on any console error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    errors = PageErrors()
    errors.watch(pg)
    pg.errors = errors
    yield pg
    context.close()
    assert not errors, "console errors:\n" + "\n".join(errors)


def shot(page, name: str, full_page: bool = True) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def tiny_train_config(**extra) -> dict:
    """The shipped config.json, shrunk to a short tiny-Flux run."""
    config = json.loads((REPO / "config" / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("--data_backend_config", "--output_dir", "--resume_from_checkpoint")}
    config.update({"--max_train_steps": 12, "--checkpointing_steps": 6, "--lr_warmup_steps": 2})
    config.update({f"--{k}": v for k, v in extra.items()})
    return config


def tiny_backends() -> list[dict]:
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(resolution=64, cache_dir_vae="cache/vae/sample")
    return backends
