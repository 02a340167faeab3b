"""Split training on the server: cache jobs, train jobs that depend on them, and old databases without the columns
(real HTTP, the fake trainer in real processes, real SQLite and PostgreSQL)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, text

from tests.server.helpers import data_backends, job_body


def _pair(srv, cache_mode: str = "ok", **train):
    cache = srv.http.post("/api/jobs", json=job_body(name="cache", kind="cache",
                                                     train={"tracker_run_name": cache_mode}))
    assert cache.status_code == 201, cache.text
    body = job_body(name="train", depends_on=cache.json()["id"], train={"train_from_cache": True, **train})
    trained = srv.http.post("/api/jobs", json=body)
    assert trained.status_code == 201, trained.text
    return cache.json(), trained.json()


def test_a_train_job_runs_after_its_cache_job_succeeds(live_server):
    srv = live_server(max_concurrent=2)  # room for both: only the dependency holds the train job back
    cache, train = _pair(srv, cache_mode="hang")
    assert cache["kind"] == "cache" and train["kind"] == "train" and train["depends_on"] == cache["id"]
    assert train["reason"] == f"waits for cache job {cache['id']}" and train["warnings"] == []
    srv.wait_status(cache["id"], "running")
    time.sleep(1.0)  # many scheduler passes
    assert srv.http.get(f"/api/jobs/{train['id']}").json()["status"] == "queued"
    srv.http.post(f"/api/jobs/{cache['id']}/cancel")
    failed = srv.wait_status(train["id"], "failed")
    assert failed["reason"] == f"cache job {cache['id']} cancelled: cancelled by user; retry it, then this job"
    assert failed["started_at"] is None  # it never ran

    cache, train = _pair(srv)
    done = srv.wait_status(cache["id"], "succeeded")
    assert done["results"]["cache_manifest"].endswith("cache_manifest.json")
    ran = srv.wait_status(train["id"], "succeeded")
    assert ran["started_at"] >= done["finished_at"] and ran["reason"] is None
    assert "lora_path" in ran["results"] and "lora_path" not in done["results"]  # each ran as its kind


def test_a_train_job_fails_clearly_when_its_cache_job_failed(live_server):
    srv = live_server(max_concurrent=2)
    cache, train = _pair(srv, cache_mode="fail")
    srv.wait_status(cache["id"], "failed")
    failed = srv.wait_status(train["id"], "failed")
    assert failed["reason"] == (f"cache job {cache['id']} failed: trainer exited with code 3; retry it, then this "
                                "job")
    events = srv.http.get(f"/api/jobs/{train['id']}/events").json()["events"]
    assert events[-1]["data"]["reason"] == failed["reason"]


def test_submitting_a_pair_names_what_is_wrong(client):
    def post(**body):
        return client.post("/api/jobs", json=job_body(**body))

    def field_error(response) -> str:
        assert response.status_code == 422, response.text
        errors = response.json()["errors"]
        assert errors[0]["path"] == "depends_on", errors
        return errors[0]["message"]

    assert field_error(post(depends_on=999)) == "job 999 does not exist"
    plain = post().json()
    assert field_error(post(depends_on=plain["id"])) == (f"job {plain['id']} is a train job; a train job waits only "
                                                         "for a cache job (kind 'cache')")
    cache = post(kind="cache").json()
    assert field_error(post(kind="cache", depends_on=cache["id"])).startswith("a cache job waits for nothing")
    elsewhere = data_backends()
    elsewhere[1]["cache_dir"] = "cache/other-text"
    message = field_error(post(depends_on=cache["id"], data_backends=elsewhere))
    assert "cache/text/cache_manifest.json, and this config reads" in message and "cache/other-text" in message
    # the same cache, but the train job would load the encoders itself: accepted, with a warning saying so
    ok = post(depends_on=cache["id"])
    assert ok.status_code == 201 and ok.json()["warnings"][0].startswith("depends_on: train_from_cache is not set")
    listed = {j["id"]: j for j in client.get("/api/jobs").json()["jobs"]}
    assert listed[cache["id"]]["kind"] == "cache" and listed[ok.json()["id"]]["depends_on"] == cache["id"]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    from tests.server.postgres import running_postgres

    pytest.importorskip("psycopg", reason="the psycopg driver is part of the test extras")
    with running_postgres() as url:
        yield url


def test_a_database_from_before_split_jobs_loads(db_url, settings_factory):
    """A database of the revision before split jobs (no kind, no depends_on): migration 0003 adds the columns, its
    jobs read as train jobs, and a pair can be queued beside them."""
    from fastapi.testclient import TestClient

    from simpletuner.server import migrations
    from simpletuner.server.app import create_app
    from simpletuner.server.db import Base
    from tests.server.helpers import LOOPBACK

    engine = create_engine(db_url)
    Base.metadata.drop_all(engine)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS alembic_version"))
    migrations.upgrade(engine, "0002")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (name, status, priority, train_config, data_backends, num_processes, "
                          "retry_on_restart, max_retries, retries, start_over, submitted_at, attempt, "
                          "cancel_requested) VALUES ('old', 'succeeded', 0, '{}', '[]', 1, false, 0, 0, false, 1.0, "
                          "1, false)"))
    engine.dispose()
    app = create_app(settings_factory(db_url=db_url, run_scheduler=False))
    with TestClient(app, client=LOOPBACK, base_url="http://127.0.0.1") as c:
        assert migrations.current(create_engine(db_url)) == "0004"
        old = c.get("/api/jobs").json()["jobs"]
        assert [(j["name"], j["kind"], j["depends_on"]) for j in old] == [("old", "train", None)]
        cache = c.post("/api/jobs", json=job_body(kind="cache")).json()
        train = c.post("/api/jobs", json=job_body(depends_on=cache["id"], train={"train_from_cache": True}))
        assert train.status_code == 201 and train.json()["depends_on"] == cache["id"]


def test_jobs_submit_queues_a_pair_from_the_command_line(live_server, capsys):
    from simpletuner.cli import _build_parser
    from simpletuner.server import client as jobs_cli
    from tests.server.helpers import train_config

    srv = live_server(max_concurrent=2)
    srv.http.post("/api/configs", json={"name": "tiny", "train_config": train_config(),
                                        "data_backends": data_backends()})

    def jobs(*argv):
        return jobs_cli.run(_build_parser("jobs").parse_args(["jobs", "--server", srv.url, *argv]))

    assert jobs("submit", "--config-name", "tiny", "--kind", "cache", "--json") == 0
    cache = __import__("json").loads(capsys.readouterr().out)
    assert jobs("submit", "--config-name", "tiny", "--depends-on", str(cache["id"]), "--set", "train_from_cache=true",
                "--wait") == 0
    assert "succeeded" in capsys.readouterr().out
    done = srv.http.get("/api/jobs").json()["jobs"]
    assert {(j["kind"], j["depends_on"], j["status"]) for j in done} == {
        ("cache", None, "succeeded"), ("train", cache["id"], "succeeded")}
