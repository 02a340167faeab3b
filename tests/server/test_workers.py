"""Worker tokens, registration, leases and gang claims on the server (real SQLite, real HTTP through TestClient)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from simpletuner.server.db import JobRow
from tests.server.helpers import REMOTE, job_body


@pytest.fixture
def app_client(settings_factory):
    """A server whose scheduler does not run (the test drives leases by hand); no local worker."""
    app = create_app(settings_factory(run_scheduler=False, local_worker=False, worker_lease=30.0,
                                      trust_loopback=False))
    with TestClient(app, client=REMOTE, base_url="http://127.0.0.1",
                    headers={"Authorization": "Bearer test-token"}) as c:
        yield c


def _token(c, name="w") -> str:
    r = c.post("/api/worker-tokens", json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def _as(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _register(c, token, name, slots=1) -> str:
    r = c.post("/api/workers", json={"name": name, "host": name, "address": "127.0.0.1", "slots": slots},
               headers=_as(token))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _submit(c, **extra) -> int:
    r = c.post("/api/jobs", json=job_body(**extra))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _claim(c, token, worker, port=29600):
    return c.post(f"/api/workers/{worker}/claim", json={"port": port}, headers=_as(token))


def test_worker_tokens_are_separate_from_the_api_token_and_revocable(app_client):
    c = app_client
    token = _token(c)
    assert token not in str(c.get("/api/worker-tokens").json())  # only its hash is stored
    # the API token does not register a worker; a worker token does not read or submit jobs
    assert c.post("/api/workers", json={"name": "x", "host": "x"}).status_code == 401
    assert c.get("/api/jobs", headers=_as(token)).status_code == 401
    assert c.post("/api/jobs", json=job_body(), headers=_as(token)).status_code == 401
    worker = _register(c, token, "w1")
    job_id = _submit(c)
    claim = _claim(c, token, worker).json()
    assert claim["job_id"] == job_id and claim["machine_rank"] == 0 and claim["webhook_secret"]
    token_id = c.get("/api/worker-tokens").json()[0]["id"]
    assert c.delete(f"/api/worker-tokens/{token_id}").json()["revoked_at"]
    assert c.post(f"/api/workers/{worker}/heartbeat", headers=_as(token)).status_code == 401
    assert _register_status(c, token) == 401
    job = c.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "queued" and "token was revoked" in job["reason"]  # its job went back


def _register_status(c, token) -> int:
    return c.post("/api/workers", json={"name": "again", "host": "h"}, headers=_as(token)).status_code


def test_a_gang_is_formed_all_or_nothing_with_ranks_and_rendezvous(app_client):
    c = app_client
    token = _token(c)
    a, b = _register(c, token, "a"), _register(c, token, "b")
    single = _submit(c)
    assert _claim(c, token, b).json()["job_id"] == single
    gang = _submit(c, num_machines=2, num_processes=2, priority=5)
    later = _submit(c)
    assert c.post("/api/jobs", json=job_body(num_machines=2, num_processes=3)).status_code == 422
    # b is busy, so the gang cannot form: a waits for it (strict priority: the later job does not pass it either),
    # and nothing is half-taken
    assert _claim(c, token, a).status_code == 204
    assert c.get(f"/api/jobs/{later}").json()["status"] == "queued"
    assert c.get(f"/api/jobs/{gang}").json()["status"] == "queued"
    # b finishes; now a's claim forms the gang: a is rank 0 and its port is the rendezvous
    claim_b = c.get("/api/workers").json()
    assert any(w["name"] == "b" and w["jobs"] for w in claim_b)
    sid = _assignment(c, single)
    assert c.post(f"/api/workers/{b}/assignments/{sid}/started", json={"pid": 123},
                  headers=_as(token)).status_code == 204
    assert c.post(f"/api/workers/{b}/assignments/{sid}/finished", json={"exit_code": 0},
                  headers=_as(token)).status_code == 204
    lead = _claim(c, token, a, port=29777).json()
    assert (lead["job_id"], lead["machine_rank"], lead["num_machines"]) == (gang, 0, 2)
    assert (lead["main_process_ip"], lead["main_process_port"]) == ("127.0.0.1", 29777)
    member = _claim(c, token, b, port=29999).json()  # b picks up the share the gang assigned it
    assert (member["job_id"], member["machine_rank"], member["main_process_port"]) == (gang, 1, 29777)
    assert member["webhook_secret"] is None and member["run_dir"] == lead["run_dir"]
    # one machine fails: the job fails once every machine has ended; the other is told to stop
    for worker, claim in ((a, lead), (b, member)):
        c.post(f"/api/workers/{worker}/assignments/{claim['assignment_id']}/started", json={"pid": 1},
               headers=_as(token))
    c.post(f"/api/workers/{b}/assignments/{member['assignment_id']}/finished", json={"exit_code": 1},
           headers=_as(token))
    stop = c.post(f"/api/workers/{a}/heartbeat", headers=_as(token)).json()["stop"]
    assert [s["assignment_id"] for s in stop] == [lead["assignment_id"]]
    assert c.get(f"/api/jobs/{gang}").json()["status"] == "running"
    c.post(f"/api/workers/{a}/assignments/{lead['assignment_id']}/finished", json={"exit_code": 143},
           headers=_as(token))
    job = c.get(f"/api/jobs/{gang}").json()
    assert job["status"] == "failed" and job["exit_code"] == 1 and "on a worker" in job["reason"]


def _assignment(c, job_id) -> int:
    from simpletuner.server.workers import AssignmentRow

    with c.app.state.db.session() as s:
        return s.query(AssignmentRow).filter_by(job_id=job_id).one().id


def test_a_worker_that_stops_heartbeating_loses_its_lease_and_its_job(app_client):
    c = app_client
    token = _token(c)
    worker = _register(c, token, "w1")
    job_id = _submit(c)
    claim = _claim(c, token, worker).json()
    c.post(f"/api/workers/{worker}/assignments/{claim['assignment_id']}/started", json={"pid": 1},
           headers=_as(token))
    fleet = c.app.state.manager.fleet
    assert fleet.expire() == []  # the lease is fresh
    from simpletuner.server.workers import WorkerRow

    with c.app.state.db.session(write=True) as s:
        s.get(WorkerRow, worker).lease_expires_at = time.time() - 1
    assert fleet.expire() == [worker]
    with c.app.state.db.session() as s:
        job = s.get(JobRow, job_id)
    assert job.status == "queued" and "lease expired" in job.reason and job.webhook_secret is None
    # the worker comes back: told it is gone; it registers again and gets the job back as a new attempt
    assert c.post(f"/api/workers/{worker}/heartbeat", headers=_as(token)).status_code == 410
    again = _register(c, token, "w1")
    retry = _claim(c, token, again).json()
    assert (retry["job_id"], retry["attempt"]) == (job_id, 2)


def test_a_worker_runs_a_cache_job_as_stage_1_and_its_train_job_only_after_it(app_client):
    c = app_client
    token = _token(c)
    worker = _register(c, token, "w1", slots=2)
    cache = _submit(c, kind="cache")
    train = _submit(c, depends_on=cache, train={"train_from_cache": True})
    claim = _claim(c, token, worker).json()
    assert (claim["job_id"], claim["module"]) == (cache, "simpletuner.cache")
    c.post(f"/api/workers/{worker}/assignments/{claim['assignment_id']}/started", json={"pid": 1},
           headers=_as(token))
    assert _claim(c, token, worker).status_code == 204  # the train job waits while its cache job runs
    c.post(f"/api/workers/{worker}/assignments/{claim['assignment_id']}/finished", json={"exit_code": 0},
           headers=_as(token))
    claim = _claim(c, token, worker).json()
    assert (claim["job_id"], claim["module"]) == (train, "simpletuner.train")


def test_any_number_of_jobs_waiting_for_a_cache_job_never_hide_it_from_a_worker(app_client):
    """More train jobs than one scan used to read (20), all ahead of their own cache job by priority: the worker
    still finds the cache job (the queue would otherwise wait forever)."""
    c = app_client
    token = _token(c)
    worker = _register(c, token, "w1", slots=2)
    cache = _submit(c, kind="cache")
    waiting = [_submit(c, depends_on=cache, priority=5, train={"train_from_cache": True}) for _ in range(25)]
    claim = _claim(c, token, worker).json()
    assert (claim["job_id"], claim["module"]) == (cache, "simpletuner.cache")
    assert {c.get(f"/api/jobs/{j}").json()["status"] for j in waiting} == {"queued"}
