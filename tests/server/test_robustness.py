"""Small server failures from issue 15: each was a 500, a wrong answer or a wrong refusal."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from simpletuner.server.db import JobRow
from simpletuner.training.webhooks import sign
from tests.server.helpers import LOOPBACK, data_backends, job_body, train_config

LOCAL = {"client": LOOPBACK, "base_url": "http://127.0.0.1"}


# headers arrive as latin-1: b"\xb2" is "²", which str.isdigit() calls a digit and int() refuses (over real HTTP:
# the in-process test client re-encodes header bytes)
@pytest.mark.parametrize("last_event_id", [b"\xb2", b"12\xb3", b"\xb9\xb2", "\u0661\u0662".encode(), b"-1", b"abc"])
def test_a_non_ascii_last_event_id_is_ignored_not_a_500(live_server, last_event_id):
    srv = live_server(run_scheduler=False)
    job = srv.http.post("/api/jobs", json=job_body()).json()["id"]
    srv.http.post(f"/api/jobs/{job}/cancel")  # finished: the stream replays and ends
    r = srv.http.get(f"/api/jobs/{job}/stream", params={"until_done": "true"},
                     headers={"Last-Event-ID": last_event_id})
    assert r.status_code == 200 and "event: end" in r.text


def _running_with_secret(client) -> tuple[int, str]:
    job_id = client.post("/api/jobs", json=job_body()).json()["id"]
    with client.app.state.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.webhook_secret = "running", 1, "s3"
    return job_id, "s3"


@pytest.mark.parametrize("raw", ['{"seq": 1, "type": "log", "time": NaN, "data": {}}',
                                 '{"seq": 1, "type": "log", "time": Infinity, "data": {}}',
                                 '{"seq": 1, "type": "progress", "time": 1.5, "data": {"loss": NaN}}'])
def test_non_finite_numbers_in_an_event_are_refused_not_acknowledged(client, raw):
    job_id, secret = _running_with_secret(client)
    body = raw.encode()
    r = client.post(f"/api/jobs/{job_id}/events", content=body, headers={"X-SimpleTuner-Signature": sign(secret, body)})
    assert r.status_code == 422, r.text  # it was "accepted, duplicate" and never stored
    good = json.dumps({"seq": 1, "type": "log", "time": 1.5, "data": {"message": "x"}}).encode()
    r = client.post(f"/api/jobs/{job_id}/events", content=good, headers={"X-SimpleTuner-Signature": sign(secret, good)})
    assert r.json() == {"accepted": True, "duplicate": False, "id": r.json()["id"]}


def test_overrides_replace_every_spelling_of_their_key(client):
    cfg = {"--model_family": "flux", "--model_flavour": "tiny", "--max_train_steps": 50,
           "TRAINER_EXTRA_ARGS": "--lora_rank=8"}
    assert client.post("/api/configs", json={"name": "dashes", "train_config": cfg,
                                             "data_backends": data_backends()}).status_code == 201
    r = client.post("/api/jobs", json={"config_name": "dashes", "overrides": {"max_train_steps": 3, "lora-rank": 4}})
    assert r.status_code == 201, r.text
    frozen = client.get(f"/api/jobs/{r.json()['id']}").json()["train_config"]
    assert frozen["max_train_steps"] == 3 and frozen["lora_rank"] == 4


@pytest.mark.parametrize("field, value", [("learning_rate", "inf"), ("learning_rate", 1e400), ("max_train_steps", 2**63),
                                          ("seed", 2**64), ("lora_alpha", "nan")])
def test_non_finite_and_absurd_numbers_are_422_naming_the_field(client, field, value):
    raw = json.dumps(job_body(train={field: value})).replace("Infinity", "1e400")
    r = client.post("/api/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert f"train_config.{field}" in [e["path"] for e in r.json()["errors"]]


# ---- the database -------------------------------------------------------------------------------------------
def _damage_jobs_table(db_file) -> None:
    """Overwrite the jobs table's root page, as a bad sector or a torn write would."""
    con = sqlite3.connect(db_file)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    with open(db_file, "r+b") as fh:
        fh.seek((root - 1) * page)
        fh.write(b"\xff" * page)


def test_a_damaged_database_fails_health_and_requests_say_503(settings_factory):
    settings = settings_factory(run_scheduler=False)
    app = create_app(settings)
    with TestClient(app, **LOCAL) as c:
        for _ in range(20):
            assert c.post("/api/jobs", json=job_body()).status_code == 201
        assert c.get("/api/health").json() == {"status": "ok", "detail": None}
        app.state.db.engine.dispose()
        _damage_jobs_table(settings.data_dir / "simpletuner.db")
        app.state.db.engine.dispose()
        r = c.get("/api/jobs")
        assert r.status_code == 503 and "malformed" in r.json()["detail"]
        health = c.get("/api/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "simpletuner.db" in health.json()["detail"]
    with pytest.raises(ValueError, match="simpletuner.db.*recover"):  # DatabaseDamaged
        create_app(settings_factory(run_scheduler=False))  # the start-up integrity check names the file


def test_the_server_command_refuses_a_damaged_database(settings_factory, capsys):
    from simpletuner.cli import _build_parser
    from simpletuner.server import cli as server_cli

    settings = settings_factory(run_scheduler=False)
    app = create_app(settings)
    with TestClient(app, **LOCAL) as c:
        for _ in range(20):
            c.post("/api/jobs", json=job_body())
    app.state.db.dispose()
    _damage_jobs_table(settings.data_dir / "simpletuner.db")
    args = _build_parser("server").parse_args(["server", "--data-dir", str(settings.data_dir)])
    assert server_cli.run(args) == 2
    assert "is damaged" in capsys.readouterr().err


def test_a_locked_database_is_503_with_retry_after(settings_factory):
    settings = settings_factory(run_scheduler=False, db_busy_timeout=0.2)
    with TestClient(create_app(settings), **LOCAL) as c:
        holder = sqlite3.connect(settings.data_dir / "simpletuner.db", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another writer holds the lock
        try:
            r = c.post("/api/jobs", json=job_body())
            assert r.status_code == 503 and r.headers["retry-after"].isdigit()
            assert "busy" in r.json()["detail"]
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert c.post("/api/jobs", json=job_body()).status_code == 201


def test_an_older_database_gains_the_new_columns(settings_factory):
    settings = settings_factory(run_scheduler=False)
    settings.data_dir.mkdir(parents=True)
    old = sqlite3.connect(settings.data_dir / "simpletuner.db")
    old.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, name VARCHAR(200), status VARCHAR(16), priority INTEGER,"
                " train_config JSON, data_backends JSON, num_processes INTEGER, retry_on_restart BOOLEAN,"
                " submitted_at FLOAT, attempt INTEGER, cancel_requested BOOLEAN)")
    old.execute("INSERT INTO jobs VALUES (1, 'old', 'failed', 0, '{}', '[]', 1, 0, 1.0, 1, 0)")
    old.commit()
    old.close()
    with TestClient(create_app(settings), **LOCAL) as c:
        job = c.get("/api/jobs/1").json()
        assert job["max_retries"] == 0 and job["retries"] == 0 and job["name"] == "old"
