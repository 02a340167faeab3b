"""Jobs through real HTTP and real processes (an in-process uvicorn, the fake trainer)."""

import time
from pathlib import Path

import pytest

from simpletuner.server.queue import group_alive

from tests.server.helpers import job_body


def test_job_runs_and_reports(live_server):
    srv = live_server()
    r = srv.http.post("/api/jobs", json=job_body(name="first", train={"max_train_steps": 4}))
    assert r.status_code == 201, r.text
    job = srv.wait_status(r.json()["id"], "succeeded")
    assert job["exit_code"] == 0 and job["attempt"] == 1 and job["reason"] is None
    assert job["results"]["steps"] == 4 and job["results"]["scores"] == {"clip_score": pytest.approx(0.31)}
    assert Path(job["results"]["lora_path"]).is_file()
    run_dir = Path(job["run_dir"])
    assert {"config.json", "multidatabackend.json", "train.log"} <= {p.name for p in run_dir.iterdir()}
    files = {f["path"] for f in srv.http.get(f"/api/jobs/{job['id']}/files").json()}
    assert "output/pytorch_lora_weights.safetensors" in files
    assert "step 4/4" in srv.http.get(f"/api/jobs/{job['id']}/log", params={"tail": 5}).text
    kinds = [e["type"] for e in srv.http.get(f"/api/jobs/{job['id']}/events").json()["events"]]
    assert kinds.count("progress") == 4 and "checkpoint" in kinds and kinds[-1] == "job"


def test_frozen_config_points_into_run_dir(live_server, workdir):
    srv = live_server()
    job = srv.wait_status(srv.http.post("/api/jobs", json=job_body()).json()["id"], "succeeded")
    import json

    run_dir = Path(job["run_dir"])
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["output_dir"] == str(run_dir / "output")
    assert cfg["data_backend_config"] == str(run_dir / "multidatabackend.json")
    backends = json.loads((run_dir / "multidatabackend.json").read_text())
    assert backends[0]["instance_data_dir"] == str(workdir / "imgs")  # relative paths resolved at submit
    detail = srv.http.get(f"/api/jobs/{job['id']}").json()
    assert detail["train_config"]["learning_rate"] == 1e-4  # defaults resolved: the frozen config


def test_one_slot_runs_jobs_in_priority_then_submission_order(live_server):
    srv = live_server(max_concurrent=1)
    blocker = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "hang"})).json()["id"]
    srv.wait_status(blocker, "running")
    low = srv.http.post("/api/jobs", json=job_body(priority=0)).json()
    high = srv.http.post("/api/jobs", json=job_body(priority=5)).json()
    assert low["status"] == "queued" and high["queue_position"] == 1
    assert srv.http.get(f"/api/jobs/{low['id']}").json()["queue_position"] == 2
    srv.http.post(f"/api/jobs/{blocker}/cancel")
    done_high = srv.wait_status(high["id"], "succeeded")
    done_low = srv.wait_status(low["id"], "succeeded")
    assert done_high["started_at"] < done_low["started_at"]
    assert done_low["started_at"] >= done_high["finished_at"]


def test_cancel_queued_and_running(live_server):
    srv = live_server(max_concurrent=1)
    running = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "hang"})).json()["id"]
    queued = srv.http.post("/api/jobs", json=job_body()).json()["id"]
    job = srv.wait_status(running, "running")
    assert srv.http.post(f"/api/jobs/{queued}/cancel").json()["status"] == "cancelled"
    _wait_file(Path(job["run_dir"]) / "output" / "started")
    r = srv.http.post(f"/api/jobs/{running}/cancel").json()
    assert r["cancel_requested"] is True
    done = srv.wait_status(running, "cancelled")
    assert done["exit_code"] == 143  # the trainer's own SIGTERM exit
    assert not group_alive(done["pid"])
    assert srv.http.post(f"/api/jobs/{running}/cancel").status_code == 409


def test_cancel_escalates_to_sigkill_and_kills_the_whole_group(live_server):
    srv = live_server(cancel_grace=0.5)
    job_id = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "stubborn"})).json()["id"]
    job = srv.wait_status(job_id, "running")
    _wait_file(Path(job["run_dir"]) / "output" / "started")
    srv.http.post(f"/api/jobs/{job_id}/cancel")
    done = srv.wait_status(job_id, "cancelled", timeout=120)
    assert done["exit_code"] == 137
    deadline = time.time() + 60
    while group_alive(job["pid"]) and time.time() < deadline:  # the grandchild too
        time.sleep(0.05)
    assert not group_alive(job["pid"])


def test_failure_keeps_log_tail_and_error(live_server):
    srv = live_server()
    job_id = srv.http.post("/api/jobs", json=job_body(train={"tracker_run_name": "fail"})).json()["id"]
    job = srv.wait_status(job_id, "failed")
    assert job["exit_code"] == 3 and "exited with code 3" in job["reason"]
    assert "CUDA out of memory" in job["error"] and "RuntimeError" in job["log_tail"]


def test_missing_launcher_fails_cleanly(live_server):
    srv = live_server(job_command=["/nonexistent/trainer", "{config}"])
    job = srv.wait_status(srv.http.post("/api/jobs", json=job_body()).json()["id"], "failed")
    assert "could not start" in job["reason"]


def test_patch_priority_list_filter_delete(live_server):
    srv = live_server(run_scheduler=False)
    a = srv.http.post("/api/jobs", json=job_body()).json()["id"]
    b = srv.http.post("/api/jobs", json=job_body()).json()["id"]
    assert srv.http.patch(f"/api/jobs/{b}", json={"priority": 10}).json()["queue_position"] == 1
    assert srv.http.get("/api/jobs", params={"status": "queued"}).json()["total"] == 2
    assert srv.http.delete(f"/api/jobs/{a}").status_code == 409  # not finished
    srv.http.post(f"/api/jobs/{a}/cancel")
    assert srv.http.delete(f"/api/jobs/{a}").status_code == 204
    assert srv.http.get(f"/api/jobs/{a}").status_code == 404
    assert [j["id"] for j in srv.http.get("/api/jobs").json()["jobs"]] == [b]


def test_submit_from_stored_config_with_overrides(live_server):
    srv = live_server()
    body = job_body()
    srv.http.post("/api/configs", json={"name": "tiny", "train_config": body["train_config"],
                                        "data_backends": body["data_backends"]})
    r = srv.http.post("/api/jobs", json={"config_name": "tiny", "overrides": {"max_train_steps": 2}})
    job = srv.wait_status(r.json()["id"], "succeeded")
    assert job["config_name"] == "tiny" and job["config_version"] == 1 and job["results"]["steps"] == 2
    assert srv.http.post("/api/jobs", json={"config_name": "nope"}).status_code == 404
    both = srv.http.post("/api/jobs", json={"config_name": "tiny", "train_config": {}})
    assert both.status_code == 422


def test_too_many_processes_for_the_accelerators(live_server):
    srv = live_server(accelerators=["0"], run_scheduler=False)
    r = srv.http.post("/api/jobs", json=job_body(num_processes=2))
    assert r.status_code == 422 and r.json()["errors"][0]["path"] == "num_processes"


def _wait_file(path: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)
