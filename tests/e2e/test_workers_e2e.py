"""One server, two workers (separate processes and data dirs), real PostgreSQL: jobs run once each, spread over
both workers; a worker killed with -9 mid-job loses its lease and its job resumes on the other worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.fleet import WorkerProcess, fake_trainer_command, worker_token, workers_of
from tests.e2e.server_process import REPO, ServerProcess, group_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]  # a hang guard
INTERVAL = 3


@pytest.fixture(scope="module")
def postgres_url():
    pytest.importorskip("psycopg", reason="the psycopg driver is part of the test extras")
    from tests.server.postgres import running_postgres

    with running_postgres() as url:
        yield url


def _body(steps: int, name: str) -> dict:
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    return {"name": name, "data_backends": backends, "max_retries": 0, "train_config": {
        "model_family": "flux", "model_flavour": "tiny", "max_train_steps": steps, "checkpointing_steps": INTERVAL,
        "tracker_run_name": "resume"}}


def _steps(run_dir: str) -> list[int]:
    return [int(x) for x in (Path(run_dir) / "output" / "steps.log").read_text().split()]


def test_two_workers_share_the_queue_and_a_killed_workers_job_resumes_elsewhere(tmp_path, postgres_url):
    runs = tmp_path / "shared-runs"  # storage both workers reach (here: the same disk)
    # an 8 s lease: heartbeats (every lease / 3) keep it on a loaded machine
    server = ServerProcess(tmp_path / "server-data", tmp_path, "--db-url", postgres_url, "--no-local-worker",
                           "--runs-dir", str(runs), "--worker-lease", "8").start()
    workers = []
    try:
        token = worker_token(server, tmp_path)
        env = {"SIMPLETUNER_WORKER_JOB_COMMAND": fake_trainer_command(), "SIMPLETUNER_FAKE_STEP_SECONDS": "0.1"}
        workers = [WorkerProcess(server, token, name, tmp_path, env=env).start() for name in ("w1", "w2")]

        # 20 jobs: each runs exactly once, and both workers take some
        ids = [server.http.post("/api/jobs", json=_body(3, f"job-{i}")).json()["id"] for i in range(20)]
        ran_on: dict[str, list[int]] = {"w1": [], "w2": []}
        for job_id in ids:
            job = server.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=600)
            assert job["status"] == "succeeded" and job["attempt"] == 1, job
            assert job["run_dir"].startswith(str(runs))
            assert _steps(job["run_dir"]) == [1, 2, 3]  # every step once: no second trainer ever ran it
            machines = workers_of(server, job_id)
            assert len(machines) == 1, machines
            ran_on[machines[0][1]].append(job_id)
        assert ran_on["w1"] and ran_on["w2"], ran_on

        # kill -9 the worker running a long job: the lease runs out, the job resumes on the other worker
        victim_job = server.http.post("/api/jobs", json=_body(24, "long")).json()["id"]
        server.wait_step(victim_job, 5, timeout=600)
        first = workers_of(server, victim_job)
        assert [(a, r) for a, _, r in first] == [(1, 0)]
        pid = server.job(victim_job)["pid"]
        victim = next(w for w in workers if w.name == first[0][1])
        survivor = next(w for w in workers if w is not victim)
        victim.kill9()
        assert group_gone(pid, timeout=120), "the trainer outlived its worker"
        job = server.wait_status(victim_job, "succeeded", "failed", "cancelled", timeout=600)
        assert job["status"] == "succeeded" and job["attempt"] == 2, job
        assert [(a, w) for a, w, _ in workers_of(server, victim_job)] == [(1, victim.name), (2, survivor.name)]
        requeued = [e for e in server.events(victim_job, "job") if e["data"].get("status") == "queued"
                    and "lease expired" in (e["data"].get("reason") or "")]
        assert requeued, "the job was not re-queued on lease expiry"
        steps = _steps(job["run_dir"])
        resumed_from = json.loads((Path(job["run_dir"]) / "output" / "run_summary.json").read_text())[
            "started_at_step"]
        assert resumed_from >= INTERVAL and resumed_from % INTERVAL == 0  # from a checkpoint, not from step 0
        redone = len(steps) - len(set(steps))  # steps trained twice: what the kill cost
        assert 0 <= redone <= INTERVAL, steps
        assert sorted(set(steps)) == list(range(1, 25))
        listed = {w["name"]: w["status"] for w in server.http.get("/api/workers").json() if not w["local"]}
        assert listed == {victim.name: "lost", survivor.name: "online"}
    finally:
        for w in workers:
            w.stop()
        server.stop()
