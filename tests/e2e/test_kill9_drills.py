"""kill -9 drills: the real ``simpletuner server`` and real tiny-Flux trainers, killed where it hurts.

- the trainer mid-step, and mid-save (a failpoint SIGKILLs it with checkpoint-20 half-written)
- the server with a job running and one queued, the running trainer finishing while the server is down
- the server and the running trainer at once, a job queued behind

Every drill asserts: no job lost, none run twice (each attempt is accounted for), at most one checkpoint interval
of steps lost through the normal Retry path, and the right final state of every job.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.server_process import REPO, ServerProcess, group_gone, logged_steps, resume_points

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]  # a hang guard
INTERVAL = 4  # checkpointing_steps


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """The demo config, shrunk: checkpoints every 4 steps, 64 px, caches shared by every job of the module."""
    tmp = tmp_path_factory.mktemp("drills")
    cfg = json.loads((REPO / "config" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k.lstrip("-") not in ("data_backend_config", "output_dir")}
    cfg.update({"--checkpointing_steps": INTERVAL, "--checkpoints_total_limit": None, "--lr_warmup_steps": 0,
                "--resume_from_checkpoint": None})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(resolution=64, cache_dir_vae=str(tmp / "cache" / "vae"))
    backends[1].update(cache_dir=str(tmp / "cache" / "text"))
    return {"tmp": tmp, "train_config": cfg, "data_backends": backends}


def _body(drill, steps: int, name: str, **extra) -> dict:
    return {"name": name, "train_config": {**drill["train_config"], "--max_train_steps": steps},
            "data_backends": drill["data_backends"], **extra}


def _submit(server: ServerProcess, body: dict) -> int:
    r = server.http.post("/api/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _lost_steps(run_dir: str) -> list[int]:
    """Steps trained twice at each restart (what a crash cost)."""
    return [killed_at - (resumed_at - 1) for killed_at, resumed_at in resume_points(logged_steps(run_dir))]


def _succeeded(server: ServerProcess, job_id: int, steps: int) -> dict:
    job = server.wait_status(job_id, "succeeded", "failed", "cancelled")
    assert job["status"] == "succeeded", job
    lora = Path(job["run_dir"]) / "output" / "pytorch_lora_weights.safetensors"
    assert lora.is_file() and job["results"]["lora_path"] == str(lora)
    assert job["results"]["global_step"] == steps if "global_step" in job["results"] else job["results"]["steps"] == steps
    assert set(logged_steps(job["run_dir"])) == set(range(1, steps + 1))  # every step trained, none skipped
    return job


def _listed(server: ServerProcess) -> dict[int, tuple[str, int]]:
    return {j["id"]: (j["status"], j["attempt"]) for j in server.http.get("/api/jobs").json()["jobs"]}


def test_trainer_killed_mid_step_and_mid_save(drill):
    tmp = drill["tmp"]
    marker = tmp / "failpoint-fired"
    server = ServerProcess(tmp / "data-trainer", tmp, env={"SIMPLETUNER_FAILPOINT": "checkpoint.save:20",
                                                          "SIMPLETUNER_FAILPOINT_ONCE": str(marker)}).start()
    try:
        mid_step = _submit(server, _body(drill, 16, "mid-step"))
        mid_save = _submit(server, _body(drill, 24, "mid-save"))

        # 1. kill -9 the trainer between checkpoints
        running = server.wait_step(mid_step, INTERVAL + 2)
        os.killpg(running["pid"], signal.SIGKILL)
        failed = server.wait_status(mid_step, "failed")
        assert failed["exit_code"] == 137 and failed["results"]["last_checkpoint_step"] >= INTERVAL
        assert server.http.post(f"/api/jobs/{mid_step}/retry").status_code == 200  # the normal Retry path
        done = _succeeded(server, mid_step, 16)
        assert done["attempt"] == 2
        lost = _lost_steps(done["run_dir"])
        assert len(lost) == 1 and 0 <= lost[0] <= INTERVAL, lost

        # 2. the next job dies halfway through writing checkpoint-20
        failed = server.wait_status(mid_save, "failed", "succeeded")
        assert failed["status"] == "failed" and failed["exit_code"] == 137 and marker.is_file()
        output = Path(failed["run_dir"]) / "output"
        assert [p.name for p in output.iterdir() if p.name == ".checkpoint-20.tmp"]  # the half-written one
        assert failed["results"]["last_checkpoint_step"] == 16
        assert server.http.post(f"/api/jobs/{mid_save}/retry").json()["reason"].endswith("resumes from step 16")
        done = _succeeded(server, mid_save, 24)
        assert _lost_steps(done["run_dir"]) == [INTERVAL]  # steps 17-20 redone: one interval
        assert not [p for p in output.iterdir() if p.name.startswith(".checkpoint-")]  # removed at the next start
        log = server.http.get(f"/api/jobs/{mid_save}/log").text
        assert "left by a crash during a checkpoint save" in log

        assert _listed(server) == {mid_step: ("succeeded", 2), mid_save: ("succeeded", 2)}
    finally:
        server.stop()


def test_server_killed_with_a_job_running_and_one_queued(drill):
    """The trainer outlives the server and finishes while it is down; on restart its run dir says it succeeded,
    and the queued job runs, once."""
    tmp = drill["tmp"]
    server = ServerProcess(tmp / "data-server", tmp).start()
    try:
        running = _submit(server, _body(drill, 10, "finishes-while-down"))
        queued = _submit(server, _body(drill, 6, "queued"))
        pid = server.wait_step(running, 2)["pid"]
        assert server.job(queued)["status"] == "queued"
        server.kill9()
        assert group_gone(pid, timeout=240), "the trainer did not finish"  # it trained on without a server
        summary = Path(server.data_dir / "runs" / f"job-{running}" / "output" / "run_summary.json")
        assert json.loads(summary.read_text())["global_step"] == 10

        server.restart()
        job = server.job(running)
        assert job["status"] == "succeeded" and job["reason"] == "finished while the server was down"
        assert job["results"]["final_loss"] is not None and job["results"]["global_step"] == 10
        _succeeded(server, running, 10)
        _succeeded(server, queued, 6)
        assert _listed(server) == {running: ("succeeded", 1), queued: ("succeeded", 1)}
    finally:
        server.stop()


def test_server_and_trainer_killed_at_once(drill):
    """Both die together: the running job is failed "server restarted" with its checkpoints on record, the queued
    one runs once, and Retry continues the failed run from its newest checkpoint."""
    tmp = drill["tmp"]
    server = ServerProcess(tmp / "data-both", tmp).start()
    try:
        running = _submit(server, _body(drill, 16, "dies-with-the-server"))
        queued = _submit(server, _body(drill, 6, "queued"))
        pid = server.wait_step(running, INTERVAL + 2)["pid"]
        server.kill9()
        os.killpg(pid, signal.SIGKILL)
        assert group_gone(pid)

        server.restart()
        failed = server.job(running)
        assert failed["status"] == "failed" and failed["reason"] == "server restarted"
        assert failed["results"]["last_checkpoint_step"] >= INTERVAL
        _succeeded(server, queued, 6)
        r = server.http.post(f"/api/jobs/{running}/retry")
        assert f"resumes from step {failed['results']['last_checkpoint_step']}" in r.json()["reason"]
        done = _succeeded(server, running, 16)
        lost = _lost_steps(done["run_dir"])
        assert len(lost) == 1 and 0 <= lost[0] <= INTERVAL, lost
        assert _listed(server) == {running: ("succeeded", 2), queued: ("succeeded", 1)}
    finally:
        server.stop()
