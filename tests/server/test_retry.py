"""Retry continues the same run (issue 15: every retry path started from step 0): the API, the CLI and automatic
retries after a trainer crash (``max_retries``) resume from the newest checkpoint in the same run dir; "start
over" keeps the old output aside. A restarted server reads the run dir before it declares anything failed.
Real HTTP, real processes (the fake trainer, which checkpoints and resumes like the real one)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from simpletuner.server.db import JobRow
from simpletuner.server.queue import JobManager
from simpletuner.training.webhooks import sign
from tests.server.fake_trainer import EMPTY_SAFETENSORS
from tests.server.helpers import job_body


def _resumable(**train):
    return job_body(train={"tracker_run_name": "resume", "max_train_steps": 9, "checkpointing_steps": 3, **train})


def _steps(job: dict) -> list[int]:
    return [int(x) for x in (Path(job["run_dir"]) / "output" / "steps.log").read_text().split()]


def test_retry_resumes_the_same_run_from_its_newest_checkpoint(live_server):
    srv = live_server()
    job = srv.http.post("/api/jobs", json=_resumable(tracker_project_name="crash-at-8")).json()
    failed = srv.wait_status(job["id"], "failed")
    assert failed["reason"] == "trainer exited with code 137" and failed["results"]["last_checkpoint_step"] == 6

    r = srv.http.post(f"/api/jobs/{job['id']}/retry")
    assert r.status_code == 200 and r.json()["id"] == job["id"]
    assert r.json()["status"] == "queued" and "resumes from step 6" in r.json()["reason"]
    done = srv.wait_status(job["id"], "succeeded")
    assert done["attempt"] == 2 and done["run_dir"] == failed["run_dir"]
    assert _steps(done) == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9]  # steps 7-8 redone: less than one interval lost
    cfg = json.loads((Path(done["run_dir"]) / "config.json").read_text())
    assert cfg["resume_from_checkpoint"] == "latest"
    events = srv.http.get(f"/api/jobs/{job['id']}/events", params={"type": "job"}).json()["events"]
    assert any(e["data"].get("resumes_from_step") == 6 and e["data"]["status"] == "running" for e in events)


def test_start_over_keeps_the_old_output_aside(live_server):
    srv = live_server()
    job = srv.http.post("/api/jobs", json=_resumable(tracker_project_name="crash-at-5")).json()
    failed = srv.wait_status(job["id"], "failed")
    r = srv.http.post(f"/api/jobs/{job['id']}/retry", json={"start_over": True})
    assert "starts over" in r.json()["reason"]
    done = srv.wait_status(job["id"], "succeeded")
    assert _steps(done) == list(range(1, 10))
    old = Path(failed["run_dir"]) / "output.attempt-1"
    assert [int(x) for x in (old / "steps.log").read_text().split()] == [1, 2, 3, 4, 5]
    assert (old / "checkpoint-3").is_dir()


def test_only_a_finished_job_can_be_retried(live_server):
    srv = live_server(run_scheduler=False)
    job = srv.http.post("/api/jobs", json=job_body()).json()
    assert srv.http.post(f"/api/jobs/{job['id']}/retry").status_code == 409
    assert srv.http.post("/api/jobs/999/retry").status_code == 404


def test_a_crashed_trainer_is_retried_automatically_and_resumes(live_server):
    srv = live_server()
    job = srv.http.post("/api/jobs", json=_resumable(tracker_project_name="crash-at-8") | {"max_retries": 2}).json()
    done = srv.wait_status(job["id"], "succeeded")
    assert done["attempt"] == 2 and done["retries"] == 1
    assert _steps(done) == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9]
    events = srv.http.get(f"/api/jobs/{job['id']}/events", params={"type": "job"}).json()["events"]
    requeued = [e for e in events if e["data"]["status"] == "queued" and e["data"].get("retry")]
    assert len(requeued) == 1 and "automatic retry 1 of 2, resumes from step 6" in requeued[0]["data"]["reason"]


def test_automatic_retries_run_out(live_server):
    srv = live_server()
    body = _resumable(tracker_project_name="crash-always-at-2") | {"max_retries": 2}
    done = srv.wait_status(srv.http.post("/api/jobs", json=body).json()["id"], "failed")
    assert done["attempt"] == 3 and done["retries"] == 2 and done["reason"] == "trainer exited with code 137"


def test_a_cancelled_job_is_not_retried_automatically(live_server):
    srv = live_server()
    job = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "hang"}, max_retries=3)).json()
    srv.wait_status(job["id"], "running")
    srv.http.post(f"/api/jobs/{job['id']}/cancel")
    done = srv.wait_status(job["id"], "cancelled")
    assert done["attempt"] == 1


def test_webhook_secrets_stop_working_when_the_job_ends(live_server):
    srv = live_server()
    job = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "hang"})).json()
    srv.wait_status(job["id"], "running")
    with srv.app.state.db.session() as s:
        secret = s.get(JobRow, job["id"]).webhook_secret

    def post(seq):
        body = json.dumps({"seq": seq, "type": "log", "time": time.time(), "data": {"message": "hi"}}).encode()
        return srv.http.post(f"/api/jobs/{job['id']}/events", content=body,
                             headers={"X-SimpleTuner-Signature": sign(secret, body)})

    assert post(1000).status_code == 200
    srv.http.post(f"/api/jobs/{job['id']}/cancel")
    srv.wait_status(job["id"], "cancelled")
    assert post(1001).status_code == 403


# ---- a restarted server reads the run dir before it declares anything failed --------------------------------
def _orphan(mgr: JobManager, job_id: int) -> Path:
    """Mark a job running under a server and a trainer that are both gone."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with mgr.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.webhook_secret = "running", 1, "s"
        job.owner, job.owner_host, job.owner_pid = f"{mgr.host}:{gone.pid}:x", mgr.host, gone.pid
        job.pid = job.pgid = gone.pid
        job.heartbeat_at, job.started_at = time.time(), time.time() - 5
        job.run_dir = str(mgr.run_dir_for(job_id))
    out = mgr.run_dir_for(job_id) / "output"
    out.mkdir(parents=True)
    return out


@pytest.fixture
def manager(settings_factory):
    from simpletuner.server.broker import EventBroker
    from simpletuner.server.db import Database

    settings = settings_factory(run_scheduler=False)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.resolved_db_url())
    db.create_all()
    return lambda: JobManager(settings, db, EventBroker())


def _submit(mgr, **kw) -> int:
    from tests.server.helpers import data_backends, train_config

    return mgr.submit(train_config=train_config(), data_backends=data_backends(), **kw).id


def test_a_trainer_that_finished_while_the_server_was_down_succeeded(manager):
    mgr = manager()
    job_id = _submit(mgr)
    out = _orphan(mgr, job_id)
    (out / "pytorch_lora_weights.safetensors").write_bytes(EMPTY_SAFETENSORS)
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "training_state.json").write_text('{"global_step": 5}')
    summary = {"lora_path": str(out / "pytorch_lora_weights.safetensors"), "global_step": 5, "final_loss": 0.25}
    (out / "run_summary.json").write_text(json.dumps(summary))
    assert dict(manager().reconcile()) == {job_id: "succeeded"}
    with mgr.db.session() as s:
        job = s.get(JobRow, job_id)
    assert job.status == "succeeded" and job.reason == "finished while the server was down"
    assert job.results["lora_path"] == summary["lora_path"] and job.results["final_loss"] == 0.25
    assert job.results["last_checkpoint_step"] == 5 and job.webhook_secret is None


@pytest.mark.parametrize("damage", ["no-summary", "cut-summary", "cut-lora"])
def test_a_half_finished_run_is_not_taken_for_a_finished_one(manager, damage):
    mgr = manager()
    job_id = _submit(mgr)
    out = _orphan(mgr, job_id)
    lora = out / "pytorch_lora_weights.safetensors"
    lora.write_bytes(EMPTY_SAFETENSORS[:6] if damage == "cut-lora" else EMPTY_SAFETENSORS)
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "training_state.json").write_text('{"global_step": 4}')
    if damage != "no-summary":
        text = json.dumps({"lora_path": str(lora), "global_step": 9})
        (out / "run_summary.json").write_text(text[:10] if damage == "cut-summary" else text)
    assert dict(manager().reconcile()) == {job_id: "failed"}
    with mgr.db.session() as s:
        job = s.get(JobRow, job_id)
    assert job.results["last_checkpoint_step"] == 4  # what Retry resumes from


def test_a_job_lost_with_the_server_uses_its_automatic_retries(manager):
    mgr = manager()
    job_id = _submit(mgr, max_retries=1)
    _orphan(mgr, job_id)
    assert dict(manager().reconcile()) == {job_id: "requeued"}
    with mgr.db.session() as s:
        job = s.get(JobRow, job_id)
    assert job.status == "queued" and job.retries == 1
    assert job.reason == ("trainer lost (server restarted); automatic retry 1 of 1, starts from step 0 "
                          "(no checkpoint yet)")
    assert job.results == {"output_dir": f"{job.run_dir}/output"}  # what the lost attempt left: no checkpoint yet
