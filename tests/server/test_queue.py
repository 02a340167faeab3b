"""Claiming is exclusive across servers sharing a database; restarts reconcile left-over running jobs."""

import os
import subprocess
import sys
import threading
import time

import pytest

from simpletuner.server.broker import EventBroker
from simpletuner.server.db import Database, JobRow
from simpletuner.server.queue import SERVER_RESTARTED, JobManager, group_alive

from tests.server.helpers import data_backends, make_settings, train_config

pytestmark = pytest.mark.timeout(60)


def _manager(tmp_path, workdir, db_url, **kw) -> JobManager:
    settings = make_settings(tmp_path, workdir, db_url=db_url, run_scheduler=False, **kw)
    db = Database(settings.resolved_db_url())
    db.create_all()
    return JobManager(settings, db, EventBroker())


def _queue(mgr: JobManager, n: int, **kw) -> list[int]:
    return [mgr.submit(train_config=train_config(), data_backends=data_backends(), **kw).id for _ in range(n)]


@pytest.fixture(scope="module")
def postgres_url():
    from tests.server.postgres import running_postgres

    pytest.importorskip("psycopg", reason="the psycopg driver is part of the test extras")
    with running_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    url = request.getfixturevalue("postgres_url")
    from sqlalchemy import create_engine

    from simpletuner.server.db import Base

    engine = create_engine(url)  # each test starts from empty tables
    Base.metadata.drop_all(engine)
    engine.dispose()
    return url


def test_two_servers_sharing_a_database_never_claim_the_same_job(tmp_path, workdir, monkeypatch, shared_db_url):
    url = shared_db_url
    a = _manager(tmp_path, workdir, url, max_concurrent=100)
    b = _manager(tmp_path, workdir, url, max_concurrent=100)
    ids = _queue(a, 40)
    launched: dict[str, list[int]] = {"a": [], "b": []}
    for name, mgr in (("a", a), ("b", b)):
        # Record the launch instead of starting processes; the claim is what is under test.
        monkeypatch.setattr(mgr, "_launch", lambda job_id, devices, name=name: launched[name].append(job_id))
    barrier = threading.Barrier(2)

    def drain(mgr):
        barrier.wait()
        while mgr._start_next():
            pass

    threads = [threading.Thread(target=drain, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = launched["a"] + launched["b"]
    assert sorted(together) == ids  # every job claimed exactly once
    with a.db.session() as s:
        owners = {j.id: j.owner for j in s.query(JobRow)}
    assert {owners[i] for i in launched["a"]} <= {a.server_id}
    assert {owners[i] for i in launched["b"]} <= {b.server_id}


def _fake_running(mgr, job_id, *, owner_pid, pid=None, pgid=None, secret="s", heartbeat=None):
    with mgr.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.webhook_secret = "running", 1, secret
        job.owner, job.owner_host, job.owner_pid = f"{mgr.host}:{owner_pid}:dead", mgr.host, owner_pid
        job.pid, job.pgid, job.heartbeat_at = pid, pgid, heartbeat if heartbeat is not None else time.time()
        job.run_dir = str(mgr.run_dir_for(job_id))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_restart_fails_or_requeues_jobs_whose_process_is_gone(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    plain, retry, queued = (_queue(mgr, 1)[0], _queue(mgr, 1, retry_on_restart=True)[0], _queue(mgr, 1)[0])
    dead = _dead_pid()
    _fake_running(mgr, plain, owner_pid=dead, pid=dead, pgid=dead)
    _fake_running(mgr, retry, owner_pid=dead, pid=dead, pgid=dead)
    fresh = _manager(tmp_path, workdir, url)  # "the restarted server"
    outcomes = dict(fresh.reconcile())
    assert outcomes == {plain: "failed", retry: "requeued"}
    with fresh.db.session() as s:
        rows = {j.id: j for j in s.query(JobRow)}
    assert rows[plain].status == "failed" and rows[plain].reason == SERVER_RESTARTED
    assert rows[retry].status == "queued" and "server restarted" in rows[retry].reason
    assert rows[queued].status == "queued"  # queued jobs survive untouched
    assert fresh.reconcile() == []  # idempotent


def test_live_server_and_fresh_heartbeat_are_left_alone(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    job_id = _queue(mgr, 1)[0]
    _fake_running(mgr, job_id, owner_pid=os.getppid())  # a live process on this host owns it
    other = _manager(tmp_path, workdir, url)
    assert other.reconcile() == []
    # ...until its heartbeat goes stale
    with mgr.db.session(write=True) as s:
        s.get(JobRow, job_id).heartbeat_at = time.time() - 3600
    assert dict(other.reconcile()) == {job_id: "failed"}


def test_restart_adopts_a_trainer_that_is_still_running(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    job_id = _queue(mgr, 1)[0]
    env = {**os.environ, "SIMPLETUNER_JOB_ID": str(job_id), "SIMPLETUNER_WEBHOOK_SECRET": "sekrit"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env,
                            start_new_session=True)
    try:
        _fake_running(mgr, job_id, owner_pid=_dead_pid(), pid=proc.pid, pgid=proc.pid, secret="sekrit")
        fresh = _manager(tmp_path, workdir, url)
        assert dict(fresh.reconcile()) == {job_id: "adopted"}
        assert job_id in fresh.procs
        fresh.cancel(job_id)  # cancel works on an adopted job: SIGTERM to its group
        deadline = time.time() + 10
        while job_id in fresh.procs and time.time() < deadline:
            fresh.tick()
            time.sleep(0.05)
        with fresh.db.session() as s:
            job = s.get(JobRow, job_id)
        assert job.status == "cancelled" and not group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_stranger_with_the_old_pid_is_not_adopted(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    job_id = _queue(mgr, 1)[0]
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        _fake_running(mgr, job_id, owner_pid=_dead_pid(), pid=stranger.pid, pgid=stranger.pid)
        fresh = _manager(tmp_path, workdir, url)
        assert dict(fresh.reconcile()) == {job_id: "failed"}
    finally:
        stranger.kill()
        stranger.wait()


def test_strict_priority_waits_for_devices(tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", accelerators=["0", "1"],
                   max_concurrent=2)
    started: list[tuple[int, list[str]]] = []

    def fake_launch(job_id, devices):
        started.append((job_id, devices))
        from simpletuner.server.queue import Running
        mgr.procs[job_id] = Running(job_id, 1, 1, devices, len(devices))

    monkeypatch.setattr(mgr, "_launch", fake_launch)
    one = _queue(mgr, 1, num_processes=1)[0]
    two = _queue(mgr, 1, num_processes=2)[0]
    small = _queue(mgr, 1, num_processes=1)[0]
    while mgr._start_next():
        pass
    assert started == [(one, ["0"])]  # the 2-GPU job waits for both devices; the later 1-GPU job waits too
    mgr.procs.clear()
    while mgr._start_next():
        pass
    assert started[1] == (two, ["0", "1"])
    assert len(started) == 2  # the 1-GPU job submitted last still waits: both devices are busy
    mgr.procs.clear()
    while mgr._start_next():
        pass
    assert started[2] == (small, ["0"])
