"""End to end: the real ``simpletuner server`` (uvicorn subprocess on a free loopback port) running real
tiny-Flux trainers under ``accelerate launch``; everything over HTTP.

- two jobs on one slot: the second waits for the first; progress and completion arrive over SSE; LoRAs land
  in the run dirs; a third is cancelled mid-run and its process group is gone
- kill -9 the server with jobs running and queued; restart; nothing is lost and states are reconciled
- auth with --require-token, forged webhooks, path escapes and bad configs over real HTTP
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
TOKEN = "e2e-token"


class Server:
    """``python -m simpletuner.cli server`` in its own process, cwd = the repo (so datasets/ resolves)."""

    def __init__(self, data_dir: Path, tmp: Path, *extra: str, port: int | None = None, env: dict | None = None):
        self.port = port or free_port()
        self.data_dir = data_dir
        self.log_path = tmp / f"server-{self.port}-{time.time_ns()}.log"
        self.cmd = [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(self.port),
                    "--data-dir", str(data_dir), "--allowed-root", str(REPO), "--allowed-root", str(tmp),
                    "--cancel-grace", "20", "--log-level", "warning", *extra]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_")}
        self.env["SIMPLETUNER_API_TOKEN"] = TOKEN  # not on the command line, where ps shows it
        self.env.update(env or {})
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_healthy(self.proc, self.url, self.log_path, timeout=300)
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        self.log.close()

    def job(self, job_id: int) -> dict:
        return self.http.get(f"/api/jobs/{job_id}").json()

    def wait(self, job_id: int, predicate, timeout: float = 600, what: str = "") -> dict:
        deadline = time.time() + timeout
        while True:
            job = self.job(job_id)
            if predicate(job):
                return job
            if time.time() > deadline:
                log = self.http.get(f"/api/jobs/{job_id}/log", params={"tail": 40}).text
                raise AssertionError(f"job {job_id} never {what}: {job}\n{log}")
            time.sleep(0.2)

    def wait_status(self, job_id: int, *statuses: str, timeout: float = 600) -> dict:
        return self.wait(job_id, lambda j: j["status"] in statuses, timeout, f"reached {statuses}")

    def wait_progress(self, job_id: int, timeout: float = 600) -> dict:
        return self.wait(job_id, lambda j: j["status"] == "running" and (j["progress"] or {}).get("step"),
                         timeout, "reported progress")


class SSEReader(threading.Thread):
    """Collects events from the queue-wide stream in the background."""

    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server = server
        self.events: list[dict] = []
        self.ids: list[int] = []
        self.stop = False

    def run(self) -> None:
        with httpx.Client(timeout=None) as c:
            with c.stream("GET", f"{self.server.url}/api/stream", params={"after": 0},
                          headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                event: dict = {}
                for line in r.iter_lines():
                    if self.stop:
                        return
                    if line == "":
                        if "data" in event:
                            self.ids.append(int(event["id"]))
                            self.events.append(json.loads(event["data"]))
                        event = {}
                    elif not line.startswith(":"):
                        key, _, value = line.partition(": ")
                        event[key] = value

    def of(self, job_id: int, type_: str) -> list[dict]:
        return [e for e in list(self.events) if e["job_id"] == job_id and e["type"] == type_]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The demo config shrunk for tests: 5 steps, no checkpoints, caches in a temp dir (shared by the jobs)."""
    tmp = tmp_path_factory.mktemp("server-e2e")
    cfg = json.loads((REPO / "config" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k.lstrip("-") not in ("data_backend_config", "resume_from_checkpoint")}
    cfg.update({"--max_train_steps": 5, "--checkpointing_steps": 100000, "--lr_warmup_steps": 0,
                "--validation_steps": None})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    for b in backends:
        for key in ("cache_dir_vae", "cache_dir"):
            if key in b:
                b[key] = str(tmp / "cache" / b["id"])
    return {"tmp": tmp, "train_config": cfg, "data_backends": backends}


def _job(tiny, steps: int = 5, **extra) -> dict:
    cfg = dict(tiny["train_config"], **{"--max_train_steps": steps})
    return {"train_config": cfg, "data_backends": tiny["data_backends"], **extra}


def _group_gone(pgid: int, timeout: float = 60) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_queue_sse_lora_and_cancel(tiny):
    tmp = tiny["tmp"]
    server = Server(tmp / "data-queue", tmp, "--max-concurrent", "1").start()
    sse = SSEReader(server)
    sse.start()
    try:
        first = server.http.post("/api/jobs", json=_job(tiny, name="first"))
        assert first.status_code == 201, first.text
        second = server.http.post("/api/jobs", json=_job(tiny, name="second")).json()
        third = server.http.post("/api/jobs", json=_job(tiny, steps=10000, name="to-cancel")).json()
        first = first.json()
        assert second["status"] == "queued" and second["queue_position"] == 1

        # the second waits for the first
        running_first = server.wait_progress(first["id"])
        assert server.job(second["id"])["status"] == "queued"
        done1 = server.wait_status(first["id"], "succeeded", "failed")
        assert done1["status"] == "succeeded", done1
        done2 = server.wait_status(second["id"], "succeeded", "failed")
        assert done2["status"] == "succeeded", done2
        assert done2["started_at"] >= done1["finished_at"]
        for job in (done1, done2):
            lora = Path(job["run_dir"]) / "output" / "pytorch_lora_weights.safetensors"
            assert lora.is_file() and job["results"]["lora_path"] == str(lora)
            assert job["results"]["steps"] == 5 and isinstance(job["results"]["final_loss"], float)
            assert job["exit_code"] == 0

        # the third: cancel mid-run; its whole process group goes away
        running = server.wait_progress(third["id"])
        pgid = running["pid"]
        assert server.http.post(f"/api/jobs/{third['id']}/cancel").json()["cancel_requested"]
        cancelled = server.wait_status(third["id"], "cancelled", "failed", timeout=300)
        assert cancelled["status"] == "cancelled" and cancelled["exit_code"] == 143
        assert _group_gone(pgid)

        # progress and completion arrived over SSE, in order, with increasing ids
        time.sleep(0.5)
        for job in (done1, done2):
            steps = [e["data"]["step"] for e in sse.of(job["id"], "progress")]
            assert steps == [1, 2, 3, 4, 5]
            assert [e["data"]["status"] for e in sse.of(job["id"], "job")][-1] == "succeeded"
            assert sse.of(job["id"], "status")[-1]["data"]["status"] == "succeeded"  # from the trainer
        assert [e["data"]["status"] for e in sse.of(third["id"], "job")][-1] == "cancelled"
        assert sse.ids == sorted(sse.ids) and len(set(sse.ids)) == len(sse.ids)
        assert running_first["progress"]["total_steps"] == 5

        # a reconnecting page resumes after its Last-Event-ID and misses nothing
        cut = sse.of(done1["id"], "progress")[1]["id"]
        with server.http.stream("GET", f"/api/jobs/{done1['id']}/stream", params={"until_done": "true"},
                                headers={"Last-Event-ID": str(cut)}) as r:
            ids = [int(line[4:]) for line in r.iter_lines() if line.startswith("id: ")]
        expected = [e["id"] for e in sse.events if e["job_id"] == done1["id"] and e["id"] > cut]
        assert ids == expected
    finally:
        sse.stop = True
        server.stop()


def test_kill_9_restart_reconciles(tiny):
    """Three trainers running and one queued when the server dies: one trainer survives (adopted), one dies
    with it and asked for a retry (re-queued), one dies and did not (failed); the queued job runs later."""
    tmp = tiny["tmp"]
    data = tmp / "data-restart"
    server = Server(data, tmp, "--max-concurrent", "3").start()
    port = server.port
    try:
        survivor = server.http.post("/api/jobs", json=_job(tiny, steps=10000, name="survivor")).json()["id"]
        retry = server.http.post("/api/jobs", json=_job(tiny, steps=10000, name="retry",
                                                         retry_on_restart=True)).json()["id"]
        lost = server.http.post("/api/jobs", json=_job(tiny, steps=10000, name="lost")).json()["id"]
        waiting = server.http.post("/api/jobs", json=_job(tiny, steps=3, name="waiting")).json()["id"]
        jobs = {j: server.wait_progress(j) for j in (survivor, retry, lost)}
        assert server.job(waiting)["status"] == "queued"

        server.kill9()
        for j in (retry, lost):  # these trainers die with the machine, so to speak
            os.killpg(jobs[j]["pid"], signal.SIGKILL)
            assert _group_gone(jobs[j]["pid"])
        server.stop()

        server = Server(data, tmp, "--max-concurrent", "3", port=port).start()
        assert server.job(lost)["status"] == "failed" and server.job(lost)["reason"] == "server restarted"
        requeued = server.job(retry)
        assert requeued["status"] in ("queued", "running") and requeued["attempt"] >= 1
        events = server.http.get(f"/api/jobs/{retry}/events", params={"type": "job"}).json()["events"]
        assert any(e["data"].get("reason") == "re-queued: server restarted" for e in events)
        adopted = server.job(survivor)
        assert adopted["status"] == "running" and adopted["pid"] == jobs[survivor]["pid"]
        step_before = adopted["progress"]["step"]
        # the adopted trainer keeps reporting to the new server
        server.wait(survivor, lambda j: j["progress"]["step"] > step_before + 1, 60, "kept reporting")

        # the re-queued job starts again (attempt 2); the queued one runs too; nothing was lost
        server.wait(retry, lambda j: j["status"] == "running" and j["attempt"] == 2 and j["pid"], 60, "restarted")
        done = server.wait_status(waiting, "succeeded", "failed")
        assert done["status"] == "succeeded", done
        for j in (survivor, retry):
            pgid = server.job(j)["pid"]
            server.http.post(f"/api/jobs/{j}/cancel")
            assert server.wait_status(j, "cancelled", timeout=300)["status"] == "cancelled"
            assert _group_gone(pgid)
        listed = {j["id"]: j["status"] for j in server.http.get("/api/jobs").json()["jobs"]}
        assert listed == {survivor: "cancelled", retry: "cancelled", lost: "failed", waiting: "succeeded"}
    finally:
        server.stop()


def test_auth_forged_webhooks_paths_and_bad_configs(tiny):
    tmp = tiny["tmp"]
    sleeper = json.dumps(["{python}", "-c", "import time; time.sleep(120)"])
    server = Server(tmp / "data-auth", tmp, "--require-token",
                    env={"SIMPLETUNER_SERVER_JOB_COMMAND": sleeper}).start()
    try:
        anon = httpx.Client(base_url=server.url, timeout=10)
        assert anon.get("/api/jobs").status_code == 401  # loopback, but --require-token
        assert anon.post("/api/jobs", json=_job(tiny)).status_code == 401
        assert anon.get("/api/stream").status_code == 401
        assert anon.get("/api/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert anon.get("/api/health").status_code == 200

        job = server.http.post("/api/jobs", json=_job(tiny)).json()
        server.wait(job["id"], lambda j: j["status"] == "running" and j["pid"], 30, "started")
        event = json.dumps({"job_id": job["id"], "seq": 1, "type": "status", "time": time.time(),
                            "data": {"status": "succeeded", "lora_path": "/etc/passwd"}}).encode()
        url = f"/api/jobs/{job['id']}/events"
        assert anon.post(url, content=event).status_code == 401
        forged = anon.post(url, content=event, headers={"X-SimpleTuner-Signature": "sha256=" + "ab" * 32})
        assert forged.status_code == 403
        assert "lora_path" not in (server.job(job["id"])["results"] or {})
        server.http.post(f"/api/jobs/{job['id']}/cancel")
        assert server.wait_status(job["id"], "cancelled", timeout=300)["status"] == "cancelled"

        escapes = [
            ({"--output_dir": "/etc/simpletuner"}, None, "train_config.output_dir"),
            ({"--init_lora": "../../../outside/l.safetensors"}, None, "train_config.init_lora"),
            (None, {"instance_data_dir": "/root"}, "data_backends[sample].instance_data_dir"),
            (None, {"cache_dir_vae": "/var/tmp/../../etc"}, "data_backends[sample].cache_dir_vae"),
        ]
        bad = [
            ({"--model_family": "sdxx"}, None, "train_config.model_family"),
            ({"--learning_rate": "fast"}, None, "train_config.learning_rate"),
            ({"--lora_rank": 0}, None, "train_config.lora_rank"),
            ({"--mixed_precision": "fp4"}, None, "train_config.mixed_precision"),
            ({"--optimizer": "sgd"}, None, "train_config.optimizer"),
            ({"--train_batch_size": "two"}, None, "train_config.train_batch_size"),
            ({"--lora_dropout": 2}, None, "train_config.lora_dropout"),
            ({"--lr_scheduler": "zigzag"}, None, "train_config.lr_scheduler"),
            (None, {"resolution": "huge"}, "data_backends[sample].resolution"),
            (None, {"caption_strategy": "guess"}, "data_backends[sample].caption_strategy"),
            (None, {"repeats": -3}, "data_backends[sample].repeats"),
            (None, {"crop": "sometimes"}, "data_backends[sample].crop"),
        ]
        for cfg_patch, backend_patch, path in escapes + bad:
            body = _job(tiny)
            body["train_config"] = {**body["train_config"], **(cfg_patch or {})}
            body["data_backends"] = [dict(b) for b in body["data_backends"]]
            body["data_backends"][0].update(backend_patch or {})
            r = server.http.post("/api/jobs", json=body)
            assert r.status_code == 422, (path, r.text)
            assert path in [e["path"] for e in r.json()["errors"]], (path, r.json())
        assert server.http.get("/api/jobs").json()["total"] == 1  # nothing bad was queued
        assert server.http.get("/api/datasets/scan", params={"path": "/etc"}).status_code == 422
        scan = server.http.get("/api/datasets/scan", params={"path": "datasets/sample"}).json()
        assert scan["images"] > 0 and scan["images_with_captions"] == scan["images"]
    finally:
        server.stop()
