"""Claiming is exclusive across servers sharing a database; restarts reconcile left-over running jobs."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import select

from simpletuner.server.broker import EventBroker
from simpletuner.server.db import Database, JobEventRow, JobRow
from simpletuner.server.queue import SERVER_RESTARTED, JobManager, group_alive
from simpletuner.server.queue import logger as queue_logger

from tests.server.helpers import data_backends, make_settings, train_config


def _manager(tmp_path, workdir, db_url, **kw) -> JobManager:
    settings = make_settings(tmp_path, workdir, db_url=db_url, run_scheduler=False, **kw)
    db = Database(settings.resolved_db_url())
    db.create_all()
    return JobManager(settings, db, EventBroker())


def _queue(mgr: JobManager, n: int, **kw) -> list[int]:
    return [mgr.submit(train_config=train_config(), data_backends=data_backends(), **kw).id for _ in range(n)]


def _update(mgr: JobManager, job_id: int, **fields) -> None:
    """Change a job row as another server, a worker or the user would (one committed write)."""
    with mgr.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        for key, value in fields.items():
            setattr(job, key, value)


def _start_all(mgr: JobManager, limit: int = 200) -> None:
    """Start jobs until the manager says there is nothing more to start; a manager that never says so fails the
    test at once instead of hanging it."""
    for _ in range(limit):
        if not mgr._start_next():
            return
    raise AssertionError(f"_start_next still had something to start after {limit} calls")


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
        _start_all(mgr)

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
    _update(mgr, retry, results={"final_loss": 0.5})  # what the lost attempt had reported
    fresh = _manager(tmp_path, workdir, url)  # "the restarted server"
    outcomes = dict(fresh.reconcile())
    assert outcomes == {plain: "failed", retry: "requeued"}
    with fresh.db.session() as s:
        rows = {j.id: j for j in s.query(JobRow)}
    assert rows[plain].status == "failed" and rows[plain].reason == SERVER_RESTARTED
    assert rows[retry].status == "queued" and rows[retry].reason == f"re-queued: {SERVER_RESTARTED}"
    # nothing of the lost attempt's process or owner is left on the re-queued row
    assert [getattr(rows[retry], k) for k in ("pid", "pgid", "owner", "owner_host", "owner_pid", "started_at",
                                              "webhook_secret")] == [None] * 7
    assert rows[retry].results == {"final_loss": 0.5, "output_dir": f"{rows[retry].run_dir}/output"}  # kept
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
    _update(mgr, job_id, heartbeat_at=time.time() - 3600)
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
        assert fresh.procs[job_id].devices == []  # a CPU job holds no device
        fresh.cancel(job_id)  # cancel works on an adopted job: SIGTERM to its group
        deadline = time.time() + 60
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
        assert stranger.wait(timeout=60) == -signal.SIGKILL  # the job's group, not provably its trainer: killed
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
    _start_all(mgr)
    assert started == [(one, ["0"])]  # the 2-GPU job waits for both devices; the later 1-GPU job waits too
    mgr.procs.clear()
    _start_all(mgr)
    assert started[1] == (two, ["0", "1"])
    assert len(started) == 2  # the 1-GPU job submitted last still waits: both devices are busy
    mgr.procs.clear()
    _start_all(mgr)
    assert started[2] == (small, ["0"])


# --- the launch plan, exit codes, log tails, cancel escalation, how a finished job is judged -------------------
# (in-process and fast: the job manager without its scheduler thread, real SQLite, real child processes)


def _claim(mgr: JobManager, job_id: int, attempt: int = 1) -> JobRow:
    with mgr.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.webhook_secret = "running", attempt, "sekrit"
        job.owner, job.owner_host, job.owner_pid = mgr.server_id, mgr.host, mgr.pid
        job.run_dir = str(mgr.run_dir_for(job_id))
    with mgr.db.session() as s:
        return s.get(JobRow, job_id)


def _row(mgr: JobManager, job_id: int) -> JobRow:
    with mgr.db.session() as s:
        return s.get(JobRow, job_id)


def test_plan_writes_the_run_dir_and_the_accelerate_command(tmp_path, workdir, monkeypatch):
    import json

    from simpletuner.config import paths

    monkeypatch.setenv("SIMPLETUNER_API_TOKEN", "never-passed-on")
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", job_command=None, port=8123)
    (job_id,) = _queue(mgr, 1, prompt_library={"cat": "a cat"})
    with mgr.db.session(write=True) as s:
        s.get(JobRow, job_id).train_config = {**train_config(), "--output_dir": "/elsewhere",
                                              "data_backend_config": "/x.json", "user_prompt_library": "/p.json"}
    plan = mgr.plan(_claim(mgr, job_id), [])
    run_dir = mgr.run_dir_for(job_id)
    assert plan.run_dir == run_dir and plan.cwd == workdir and plan.devices == [] and plan.resume_step is None
    assert plan.cmd == [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu",
                        "-m", "simpletuner.train", "--config", str(run_dir / "config.json")]
    config = json.loads((run_dir / "config.json").read_text())
    assert "--output_dir" not in config and config["output_dir"] == str(run_dir / "output")
    assert config["data_backend_config"] == str(run_dir / "multidatabackend.json")
    assert config["user_prompt_library"] == str(run_dir / "user_prompt_library.json")
    assert "resume_from_checkpoint" not in config and (run_dir / "output").is_dir()
    assert json.loads((run_dir / "user_prompt_library.json").read_text()) == {"cat": "a cat"}
    backends = json.loads((run_dir / "multidatabackend.json").read_text())
    assert backends[0]["instance_data_dir"] == str(workdir / "imgs")  # absolute: the trainer runs elsewhere
    env = plan.env
    assert "SIMPLETUNER_API_TOKEN" not in env
    assert env["SIMPLETUNER_WEBHOOK_URL"] == f"http://127.0.0.1:8123/api/jobs/{job_id}/events"
    assert env["SIMPLETUNER_WEBHOOK_SECRET"] == "sekrit" and env["SIMPLETUNER_JOB_ID"] == str(job_id)
    assert env["SIMPLETUNER_RUN_DIR"] == str(run_dir) and env["PYTHONUNBUFFERED"] == "1"
    assert json.loads(env[paths.ROOTS_ENV]) == [str(p) for p in mgr.settings.resolved_allowed_roots()]
    assert env["ACCELERATE_USE_CPU"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


def test_plan_on_gpus_and_with_the_python_launcher(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    gpus = _manager(tmp_path, workdir, url, job_command=None, accelerators=["0", "1", "2"])
    one, two = _queue(gpus, 1, num_processes=1)[0], _queue(gpus, 1, num_processes=2)[0]
    plan = gpus.plan(_claim(gpus, one), ["2"])
    assert "--cpu" not in plan.cmd and "--multi_gpu" not in plan.cmd
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2" and "ACCELERATE_USE_CPU" not in plan.env
    plan = gpus.plan(_claim(gpus, two), ["0", "1"])
    assert plan.cmd[plan.cmd.index("--num_processes") + 1] == "2" and "--multi_gpu" in plan.cmd
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    python = _manager(tmp_path, workdir, url, job_command=None, launcher="python")
    (three,) = _queue(python, 1)
    plan = python.plan(_claim(python, three), [])
    assert plan.cmd == [sys.executable, "-m", "simpletuner.train", "--config",
                        str(python.run_dir_for(three) / "config.json")]
    # a job command template gets every placeholder
    custom = _manager(tmp_path, workdir, url,
                      job_command=["{python}", "x", "{config}", "{run_dir}", "{num_processes}", "{job_id}"])
    (four,) = _queue(custom, 1, num_processes=3)
    run_dir = custom.run_dir_for(four)
    assert custom.plan(_claim(custom, four), []).cmd == [sys.executable, "x", str(run_dir / "config.json"),
                                                         str(run_dir), "3", str(four)]


def test_a_retry_plan_resumes_from_the_newest_checkpoint(tmp_path, workdir):
    import json

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", job_command=None)
    (job_id,) = _queue(mgr, 1)
    mgr.plan(_claim(mgr, job_id, attempt=1), [])
    output = mgr.run_dir_for(job_id) / "output"
    for step in (2, 10):
        (output / f"checkpoint-{step}").mkdir(parents=True)
        (output / f"checkpoint-{step}" / "training_state.json").write_text(json.dumps({"global_step": step}))
    plan = mgr.plan(_claim(mgr, job_id, attempt=2), [])
    assert plan.resume_step == 10 and plan.archived is None
    config = json.loads((plan.run_dir / "config.json").read_text())
    assert config["resume_from_checkpoint"] == "latest"


def test_exit_codes_and_log_tails(tmp_path):
    from simpletuner.server.queue import _exit_code, read_log_tail

    assert _exit_code(0) == 0 and _exit_code(3) == 3
    assert _exit_code(-9) == 137 and _exit_code(-15) == 143  # killed by signal N: 128 + N
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert read_log_tail(log, lines=3) == "line 97\nline 98\nline 99"
    assert read_log_tail(log) == "\n".join(f"line {i}" for i in range(40, 100))  # 60 lines by default
    assert read_log_tail(log, lines=100, max_bytes=16) == "line 98\nline 99"  # only the end is read
    assert read_log_tail(log, lines=2, max_bytes=len(log.read_bytes())).startswith("line 98")
    assert read_log_tail(tmp_path / "missing.log") == "" and read_log_tail(None) == ""
    log.write_bytes(b"ok \xff\xfe\n")
    assert read_log_tail(log) == "ok \ufffd\ufffd"


def test_pid_and_group_checks(tmp_path):
    from simpletuner.server.queue import pid_alive

    assert pid_alive(os.getpid()) and not pid_alive(_dead_pid())
    assert not pid_alive(None) and not pid_alive(0) and not pid_alive(-1)
    assert not group_alive(None) and not group_alive(0) and not group_alive(-5)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert group_alive(proc.pid)
        proc.kill()
        deadline = time.time() + 60  # a zombie (killed, not reaped yet) counts as gone
        while group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not group_alive(proc.pid) and proc.returncode is None  # still unreaped: a zombie
    finally:
        proc.kill()
        proc.wait()
    assert not group_alive(proc.pid)


def test_cancel_escalates_from_sigterm_to_sigkill_after_the_grace(tmp_path, workdir):
    from simpletuner.server.queue import Running

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", cancel_grace=0.3)
    (job_id,) = _queue(mgr, 1)
    _claim(mgr, job_id)
    # a trainer that ignores SIGTERM (it says so once the handler is in place)
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        mgr.procs[job_id] = Running(job_id, proc.pid, proc.pid, [], 1, proc=proc)
        mgr._handle_cancels()  # nothing asked yet
        assert mgr.procs[job_id].term_sent_at is None
        mgr.cancel(job_id)
        assert _row(mgr, job_id).cancel_requested is True and _row(mgr, job_id).status == "running"
        mgr._handle_cancels()
        run = mgr.procs[job_id]
        assert run.term_sent_at is not None and not run.killed
        mgr._handle_cancels()  # within the grace: no SIGKILL yet
        assert not run.killed and proc.poll() is None
        time.sleep(0.4)
        mgr._handle_cancels()
        assert run.killed
        assert proc.wait(10) == -9
        mgr._reap()
        job = _row(mgr, job_id)
        assert job.status == "cancelled" and job.reason == "cancelled by user" and job.exit_code == 137
        assert job_id not in mgr.procs
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("script, killed, status, reason, code", [
    ("raise SystemExit(0)", False, "succeeded", None, 0),
    ("raise SystemExit(3)", False, "failed", "trainer exited with code 3", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", True, "failed", "killed (exit code 137)", 137),
])
def test_how_a_finished_trainer_is_judged(tmp_path, workdir, script, killed, status, reason, code):
    from simpletuner.server.queue import Running

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    (job_id,) = _queue(mgr, 1)
    _claim(mgr, job_id)
    run_dir = mgr.run_dir_for(job_id)
    (run_dir / "output").mkdir(parents=True)
    (run_dir / "train.log").write_text("starting\nboom\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    proc.wait()
    mgr.procs[job_id] = Running(job_id, proc.pid, proc.pid, [], 1, proc=proc, killed=killed)
    mgr._reap()
    job = _row(mgr, job_id)
    assert (job.status, job.reason, job.exit_code) == (status, reason, code)
    assert job.finished_at is not None and job.webhook_secret is None and job_id not in mgr.procs
    assert job.log_tail == ("starting\nboom" if status == "failed" else None)
    assert job.results["output_dir"] == str(run_dir / "output")


def test_results_name_the_final_lora_and_the_newest_checkpoint(tmp_path, workdir):
    import json

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    (job_id,) = _queue(mgr, 1)
    job = _claim(mgr, job_id)
    output = mgr.run_dir_for(job_id) / "output"
    assert mgr._collect_results(job) == {"output_dir": str(output)}
    for step in (5, 30, 20):
        (output / f"checkpoint-{step}").mkdir(parents=True)
        (output / f"checkpoint-{step}" / "training_state.json").write_text("{}")
        (output / f"checkpoint-{step}" / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    results = mgr._collect_results(job)
    # only checkpoints hold a LoRA so far: the newest one's, by step (as text, checkpoint-20 came first)
    assert results["lora_path"] == str(output / "checkpoint-30" / "pytorch_lora_weights.safetensors")
    assert results["last_checkpoint"] == str(output / "checkpoint-30") and results["last_checkpoint_step"] == 30
    (output / "models").mkdir()
    (output / "models" / "adapter_model.safetensors").write_bytes(b"x")
    (output / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    assert mgr._collect_results(job)["lora_path"] == str(output / "pytorch_lora_weights.safetensors")
    (output / "run_summary.json").write_text(json.dumps({"lora_path": "/from/summary", "steps": 3}))
    results = mgr._collect_results(job)
    assert results["lora_path"] == "/from/summary" and results["steps"] == 3
    (output / "run_summary.json").write_text("[1, 2]")  # not an object: ignored
    assert mgr._collect_results(job)["lora_path"] == str(output / "pytorch_lora_weights.safetensors")
    (output / "run_summary.json").write_text("{cut")
    assert mgr._collect_results(job)["lora_path"] == str(output / "pytorch_lora_weights.safetensors")
    _update(mgr, job_id, run_dir=None)
    assert mgr._collect_results(_row(mgr, job_id)) == {}


def test_a_job_that_needs_more_accelerators_than_the_server_has_fails_at_once(tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", accelerators=["0", "1"])
    assert mgr.capacity_problem(3) == "needs 3 accelerators; this server has 2"
    assert mgr.capacity_problem(2) is None and mgr.cost(2) == 2
    cpu = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db2.sqlite'}")
    assert cpu.capacity_problem(8) is None and cpu.cost(8) == 1  # the CPU: one slot whatever it asks
    launched = []
    monkeypatch.setattr(mgr, "_launch", lambda job_id, devices: launched.append(job_id))
    big, small = _queue(mgr, 1, num_processes=3)[0], _queue(mgr, 1, num_processes=1)[0]
    assert mgr._start_next() is True
    job = _row(mgr, big)
    assert job.status == "failed" and job.reason == "needs 3 accelerators; this server has 2"
    assert job.finished_at is not None and launched == []
    assert _row(mgr, small).status == "queued"  # only that job fails
    from simpletuner.server.db import JobEventRow

    with mgr.db.session() as s:
        events = [e.data["status"] for e in s.query(JobEventRow).filter_by(job_id=big).order_by(JobEventRow.id)]
    assert events == ["queued", "failed"]
    assert mgr._start_next() is True and launched == [small]
    assert mgr._start_next() is False
    assert mgr.summary() == {"server_id": mgr.server_id, "max_concurrent": 2, "accelerators": ["0", "1"],
                             "running_here": [], "local_worker": True}


def _finish_as(mgr: JobManager, job_id: int, status: str = "failed") -> None:
    """A job that ran and ended: every per-attempt field set, as a real run leaves them."""
    with mgr.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.retries, job.max_retries = status, 1, 2, 3
        job.finished_at, job.started_at, job.exit_code, job.cancel_requested = time.time(), time.time() - 5, 3, True
        job.pid, job.pgid, job.webhook_secret = 111, 111, "old-secret"
        job.owner, job.owner_host, job.owner_pid = "someone:1:x", "somehost", 1
        job.run_dir = str(mgr.run_dir_for(job_id))


@pytest.mark.parametrize("checkpoint, start_over, reason, resumes", [
    (None, False, "retry requested: no checkpoint yet, starts from step 0", None),
    (7, False, "retry requested: resumes from step 7", 7),
    (7, True, "retry requested: starts over from step 0", None),
])
def test_retry_requeues_one_finished_job_with_a_clean_attempt(tmp_path, workdir, checkpoint, start_over, reason,
                                                              resumes):
    from simpletuner.server.db import JobEventRow

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    job_id, other = _queue(mgr, 2)
    _finish_as(mgr, job_id)
    _finish_as(mgr, other)
    if checkpoint is not None:
        folder = mgr.run_dir_for(job_id) / "output" / f"checkpoint-{checkpoint}"
        folder.mkdir(parents=True)
        (folder / "training_state.json").write_text("{}")
    returned = mgr.retry(job_id, start_over=start_over)
    assert returned.id == job_id and returned.status == "queued"
    job = _row(mgr, job_id)
    assert (job.status, job.reason, bool(job.start_over), job.retries) == ("queued", reason, start_over, 0)
    for name in ("finished_at", "exit_code", "pid", "pgid", "owner", "owner_host", "owner_pid", "started_at",
                 "webhook_secret"):
        assert getattr(job, name) is None, name
    assert job.cancel_requested is False and job.max_retries == 3 and job.attempt == 1
    assert _row(mgr, other).status == "failed"  # only the job asked for
    with mgr.db.session() as s:
        event = s.query(JobEventRow).filter_by(job_id=job_id).order_by(JobEventRow.id.desc()).first()
    assert event.data["status"] == "queued" and event.data["start_over"] is start_over
    assert event.data["resumes_from_step"] == resumes


def test_retry_refuses_an_unfinished_job_and_ignores_an_unknown_one(tmp_path, workdir):
    from simpletuner.server.queue import RetryConflict

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    (job_id,) = _queue(mgr, 1)
    with pytest.raises(RetryConflict, match=f"job {job_id} is queued; only a finished job can be retried"):
        mgr.retry(job_id)
    assert mgr.retry(job_id + 100) is None
    _update(mgr, job_id, status="cancelled")  # a finished job without a run dir (it never started)
    assert mgr.retry(job_id).reason == "retry requested: no checkpoint yet, starts from step 0"


def test_a_crashed_trainer_is_requeued_while_retries_last(tmp_path, workdir):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    job_id, capped, cancelled = _queue(mgr, 1, max_retries=2)[0], _queue(mgr, 1)[0], _queue(mgr, 1, max_retries=2)[0]
    for jid in (job_id, capped, cancelled):
        _claim(mgr, jid)
    (mgr.run_dir_for(job_id)).mkdir(parents=True, exist_ok=True)
    (mgr.run_dir_for(job_id) / "train.log").write_text("oops\n")
    assert mgr._retry_after_crash(job_id, "trainer exited with code 1", 1, {"k": 1}) is True
    job = _row(mgr, job_id)
    assert (job.status, job.retries, job.exit_code, job.results, job.log_tail) == ("queued", 1, 1, {"k": 1}, "oops")
    assert job.reason == ("trainer exited with code 1; automatic retry 1 of 2, starts from step 0 (no checkpoint "
                          "yet)")
    assert all(getattr(job, n) is None for n in ("pid", "pgid", "owner", "owner_host", "owner_pid", "started_at",
                                                  "webhook_secret"))
    _claim(mgr, job_id)
    folder = mgr.run_dir_for(job_id) / "output" / "checkpoint-4"
    folder.mkdir(parents=True)
    (folder / "training_state.json").write_text("{}")
    assert mgr._retry_after_crash(job_id, "lost", None, {}) is True
    assert _row(mgr, job_id).reason == "lost; automatic retry 2 of 2, resumes from step 4"
    _claim(mgr, job_id)
    assert mgr._retry_after_crash(job_id, "again", 1, {}) is False  # retries used up
    assert _row(mgr, job_id).status == "running"
    assert mgr._retry_after_crash(capped, "x", 1, {}) is False  # max_retries 0
    mgr.cancel(cancelled)
    assert mgr._retry_after_crash(cancelled, "x", 1, {}) is False  # a cancel is never retried
    assert mgr._retry_after_crash(job_id + 100, "x", 1, {}) is False
    _update(mgr, capped, max_retries=5, status="failed")  # another server finished it: not re-queued
    assert mgr._retry_after_crash(capped, "x", 1, {}) is False and _row(mgr, capped).status == "failed"


@pytest.mark.parametrize("env_secret, row_secret, env_job, pid_known, adopted", [
    ("s", "s", True, True, True),
    ("", None, True, True, True),  # a job started without a secret runs with an empty one
    ("other", "s", True, True, False),  # right job id, wrong secret: a stranger
    ("s", "s", False, True, False),  # right secret, another job's id
    ("s", "s", True, False, False),  # the group lives but the leader's pid is unknown
])
def test_only_the_jobs_own_trainer_is_adopted(tmp_path, workdir, env_secret, row_secret, env_job, pid_known,
                                              adopted):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    (job_id,) = _queue(mgr, 1)
    env = {**os.environ, "SIMPLETUNER_JOB_ID": str(job_id if env_job else job_id + 1),
           "SIMPLETUNER_WEBHOOK_SECRET": env_secret}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env, start_new_session=True)
    try:
        _fake_running(mgr, job_id, owner_pid=_dead_pid(), pid=proc.pid if pid_known else None, pgid=proc.pid,
                      secret=row_secret)
        fresh = _manager(tmp_path, workdir, url)
        assert dict(fresh.reconcile()) == {job_id: "adopted" if adopted else "failed"}
    finally:
        proc.kill()
        proc.wait()


def test_reconcile_leaves_this_servers_own_jobs_to_its_scheduler(tmp_path, workdir):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    (job_id,) = _queue(mgr, 1)
    _claim(mgr, job_id)  # claimed by this server (no heartbeat yet, no process known)
    assert mgr.reconcile() == []
    assert _row(mgr, job_id).status == "running" and _row(mgr, job_id).owner == mgr.server_id


def test_an_adopted_trainer_is_taken_over_with_its_pid_and_devices(tmp_path, workdir, caplog):
    """Reconcile walks every running job: one a live server still owns is left alone, the next one (a live
    trainer of a dead server) is adopted with its process, its devices and this server as owner."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    alive, job_id, gone = _queue(mgr, 3)
    _fake_running(mgr, alive, owner_pid=os.getppid())  # a live server on this host: not orphaned
    dead = _dead_pid()
    _fake_running(mgr, gone, owner_pid=dead, pid=dead, pgid=dead)  # and after the adopted one, a lost one
    env = {**os.environ, "SIMPLETUNER_JOB_ID": str(job_id), "SIMPLETUNER_WEBHOOK_SECRET": "s"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env, start_new_session=True)
    try:
        _fake_running(mgr, job_id, owner_pid=_dead_pid(), pid=proc.pid, pgid=proc.pid, heartbeat=time.time() - 5)
        _update(mgr, job_id, devices="0,1", num_processes=2)
        fresh = _manager(tmp_path, workdir, url, accelerators=["0", "1"], max_concurrent=2)
        before = time.time()
        with caplog.at_level("INFO", logger=queue_logger.name):
            assert fresh.reconcile() == [(job_id, "adopted"), (gone, "failed")]
        assert f"job {job_id}: adopted running trainer (pid {proc.pid}) after restart" in caplog.messages
        run = fresh.procs[job_id]
        assert (run.pid, run.pgid, run.devices, run.cost) == (proc.pid, proc.pid, ["0", "1"], 2)
        assert fresh._free_devices() == []  # both devices are the adopted trainer's
        with fresh.db.session() as s:
            event = s.scalars(select(JobEventRow).where(JobEventRow.job_id == job_id)
                              .order_by(JobEventRow.id.desc())).first()
        assert (event.type, event.source, event.data) == ("job", "server", {
            "status": "running", "attempt": 1, "pid": proc.pid, "adopted": True,
            "reason": "adopted after server restart"})
        row = _row(fresh, job_id)
        assert (row.owner, row.owner_host, row.owner_pid) == (fresh.server_id, fresh.host, fresh.pid)
        assert row.heartbeat_at >= before and row.status == "running"
        assert _row(fresh, alive).owner == f"{mgr.host}:{os.getppid()}:dead"  # untouched
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("change", [{"owner": "elsewhere:1:x"}, {"status": "succeeded"}],
                         ids=["another-server-took-it", "it-finished-meanwhile"])
def test_a_job_that_changed_between_the_read_and_the_take_over_is_left_alone(tmp_path, workdir, change):
    """Two servers may reconcile at once: the take-over only takes a row still running under the owner read."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    taken, lost = _queue(mgr, 2)
    dead = _dead_pid()
    for job_id in (taken, lost):
        _fake_running(mgr, job_id, owner_pid=dead, pid=dead, pgid=dead)
    fresh = _manager(tmp_path, workdir, url)
    orphaned = fresh._orphaned

    def meanwhile(job, t):  # the other server acts between this one's read and its update
        if job.id == taken:
            _update(mgr, taken, **change)
        return orphaned(job, t)

    fresh._orphaned = meanwhile
    assert fresh.reconcile() == [(lost, "failed")]
    row = _row(fresh, taken)
    assert row.owner == change.get("owner", f"{mgr.host}:{dead}:dead")
    assert row.status == change.get("status", "running")


def test_a_cancelled_job_lost_with_its_server_ends_cancelled(tmp_path, workdir):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mgr = _manager(tmp_path, workdir, url)
    (job_id,) = _queue(mgr, 1)
    dead = _dead_pid()
    _fake_running(mgr, job_id, owner_pid=dead, pid=dead, pgid=dead)
    _update(mgr, job_id, cancel_requested=True, exit_code=7, results={"last_checkpoint_step": 4})
    fresh = _manager(tmp_path, workdir, url)
    assert fresh.reconcile() == [(job_id, "cancelled")]
    row = _row(fresh, job_id)
    assert (row.status, row.reason, row.exit_code) == ("cancelled", "cancelled by user (server restarted)", None)
    assert row.results == {"last_checkpoint_step": 4} and row.webhook_secret is None


# --- the local worker's pick: which queued job this server starts, and what the claim writes -------------------
# (in-process: real SQLite, the launch recorded instead of started)


def _recorded_launches(mgr: JobManager, monkeypatch) -> list[tuple[int, list[str]]]:
    from simpletuner.server.queue import Running

    started: list[tuple[int, list[str]]] = []

    def fake_launch(job_id, devices):
        started.append((job_id, devices))
        mgr.procs[job_id] = Running(job_id, 1, 1, devices, max(1, len(devices)))

    monkeypatch.setattr(mgr, "_launch", fake_launch)
    return started


def test_the_local_worker_takes_queued_single_machine_jobs_by_priority_then_submission_then_id(
        tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100)
    started = _recorded_launches(mgr, monkeypatch)
    low, high, high_earlier, tie_a, tie_b, two_machines, cancelled = _queue(mgr, 7)
    with mgr.db.session(write=True) as s:
        rows = {j.id: j for j in s.query(JobRow)}
        base = rows[low].submitted_at
        for job_id, priority, submitted in ((low, 0, base), (high, 5, base + 5), (high_earlier, 5, base - 10),
                                            (tie_a, 1, base + 1), (tie_b, 1, base + 1), (two_machines, 9, base),
                                            (cancelled, 9, base)):
            rows[job_id].priority, rows[job_id].submitted_at = priority, submitted
        rows[two_machines].num_machines = 2  # workers on other machines run it
        rows[cancelled].status = "cancelled"
    _start_all(mgr)
    assert started == [(high_earlier, []), (high, []), (tie_a, []), (tie_b, []), (low, [])]  # no devices: CPU
    assert _row(mgr, two_machines).status == "queued" and _row(mgr, cancelled).status == "cancelled"


def test_the_local_worker_stops_at_its_concurrency_and_when_it_is_not_a_worker(tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=2)
    started = _recorded_launches(mgr, monkeypatch)
    first, second, third = _queue(mgr, 3)
    assert mgr._start_next() is True and mgr._start_next() is True
    assert mgr._start_next() is False  # two running: the limit
    assert [j for j, _ in started] == [first, second] and _row(mgr, third).status == "queued"
    mgr.procs.pop(first)
    assert mgr._start_next() is True and started[-1][0] == third

    off = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'off.sqlite'}", local_worker=False)
    off_started = _recorded_launches(off, monkeypatch)
    (waiting,) = _queue(off, 1)
    assert off._start_next() is False and off_started == []
    assert _row(off, waiting).status == "queued"


def test_a_claim_starts_a_clean_attempt_owned_by_this_server(tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100)
    started = _recorded_launches(mgr, monkeypatch)
    again, fresh = _queue(mgr, 2)
    with mgr.db.session(write=True) as s:  # a re-queued job still holds what its last attempt left
        job = s.get(JobRow, again)
        job.attempt, job.pid, job.pgid, job.exit_code, job.finished_at = 1, 123, 123, 1, 5.0
        job.reason, job.error, job.log_tail, job.progress = "crashed", "Traceback", "last lines", {"step": 3}
        job.webhook_secret, job.owner = "old-secret", "another:1:server"
    _start_all(mgr)
    assert [j for j, _ in started] == [again, fresh]
    secrets_seen = set()
    for job_id, attempt in ((again, 2), (fresh, 1)):
        row = _row(mgr, job_id)
        assert row.status == "running" and row.attempt == attempt
        assert row.started_at is not None and row.heartbeat_at == row.started_at
        assert (row.owner, row.owner_host, row.owner_pid) == (mgr.server_id, mgr.host, mgr.pid)
        assert row.run_dir == str(mgr.run_dir_for(job_id))
        assert (row.pid, row.pgid, row.exit_code, row.finished_at) == (None, None, None, None)
        assert (row.reason, row.error, row.log_tail, row.progress) == (None, None, None, None)
        assert len(row.webhook_secret) == 64 and int(row.webhook_secret, 16) >= 0
        secrets_seen.add(row.webhook_secret)
    assert len(secrets_seen) == 2 and "old-secret" not in secrets_seen


def test_jobs_waiting_for_their_cache_job_let_later_jobs_start_and_a_failed_one_fails_them(
        tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100)
    started = _recorded_launches(mgr, monkeypatch)
    cache, broken = _queue(mgr, 2)
    _update(mgr, cache, status="running")  # still caching (on another machine)
    _update(mgr, broken, status="failed", reason="out of disk")
    (waits,) = _queue(mgr, 1, depends_on=cache, priority=5)
    (doomed,) = _queue(mgr, 1, depends_on=broken, priority=3)
    later = _queue(mgr, 1)[0]
    assert mgr._start_next() is True  # the waiting job is passed over; the one whose cache job failed fails
    row = _row(mgr, doomed)
    assert (row.status, row.reason) == ("failed", f"cache job {broken} failed: out of disk; retry it, then this job")
    assert row.finished_at is not None and started == []
    with mgr.db.session() as s:
        events = [e.data["status"] for e in s.query(JobEventRow).filter_by(job_id=doomed).order_by(JobEventRow.id)]
    assert events == ["queued", "failed"]
    assert mgr._start_next() is True and started == [(later, [])]
    assert mgr._start_next() is False and _row(mgr, waits).status == "queued"
    _update(mgr, cache, status="succeeded")
    assert mgr._start_next() is True and started[-1] == (waits, [])


def test_a_job_too_big_for_this_machine_is_left_to_the_workers_while_one_is_online(tmp_path, workdir, monkeypatch):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", accelerators=["0", "1"],
                   max_concurrent=4)
    started = _recorded_launches(mgr, monkeypatch)
    monkeypatch.setattr(mgr.fleet, "online_count", lambda: 1)
    big = _queue(mgr, 1, num_processes=3, priority=9)[0]
    small = _queue(mgr, 1, num_processes=2)[0]
    assert mgr._start_next() is True and started == [(small, ["0", "1"])]
    assert mgr._start_next() is False and _row(mgr, big).status == "queued" and _row(mgr, big).reason is None


def test_a_job_another_server_claimed_first_is_passed_over(tmp_path, workdir, monkeypatch):
    import simpletuner.server.queue as queue_module

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100)
    started = _recorded_launches(mgr, monkeypatch)
    taken, free = _queue(mgr, 2)
    real = queue_module.dependency_state

    def meanwhile(session, job_id, depends_on):  # another server claims ``taken`` after this one read the queue
        if job_id == taken:
            _update(mgr, taken, status="running", owner="another:1:server")
        return real(session, job_id, depends_on)

    monkeypatch.setattr(queue_module, "dependency_state", meanwhile)
    assert mgr._start_next() is True and started == [(free, [])]
    assert _row(mgr, taken).owner == "another:1:server"


def test_failing_a_queued_job_leaves_one_that_changed_meanwhile(tmp_path, workdir):
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}")
    started, cancelled = _queue(mgr, 2)
    _update(mgr, started, status="running")  # another server claimed it
    _update(mgr, cancelled, status="cancelled", reason="cancelled before it started")
    for job_id in (started, cancelled):
        mgr._fail_queued(job_id, "cache job 1 failed")
    assert (_row(mgr, started).status, _row(mgr, started).reason) == ("running", None)
    assert (_row(mgr, cancelled).status, _row(mgr, cancelled).reason) == ("cancelled", "cancelled before it started")
    with mgr.db.session() as s:
        assert [e.data["status"] for e in s.query(JobEventRow).order_by(JobEventRow.id)] == ["queued", "queued"]


def test_any_number_of_jobs_waiting_for_a_cache_job_never_hide_it_from_the_local_worker(tmp_path, workdir,
                                                                                         monkeypatch):
    """Jobs ahead of their own cache job by priority, more than one scan used to read (20), or ahead of it and too
    big for this machine while workers are online: the cache job still starts."""
    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100,
                   accelerators=["0"])
    started = _recorded_launches(mgr, monkeypatch)
    (cache,) = _queue(mgr, 1)
    waiting = _queue(mgr, 25, depends_on=cache, priority=5)
    assert mgr._start_next() is True and started == [(cache, ["0"])]
    assert {_row(mgr, j).status for j in waiting} == {"queued"}
    mgr.procs.clear()
    monkeypatch.setattr(mgr.fleet, "online_count", lambda: 1)
    too_big = _queue(mgr, 25, num_processes=2, priority=3)
    (small,) = _queue(mgr, 1)
    assert mgr._start_next() is True and started[-1] == (small, ["0"])  # the big ones are left to the workers
    assert {_row(mgr, j).status for j in too_big} == {"queued"}


def test_waiting_jobs_cost_the_scan_nothing_and_a_cache_job_re_queued_meanwhile_makes_its_job_wait(
        tmp_path, workdir, monkeypatch):
    import simpletuner.server.queue as queue_module

    mgr = _manager(tmp_path, workdir, f"sqlite:///{tmp_path / 'db.sqlite'}", max_concurrent=100)
    started = _recorded_launches(mgr, monkeypatch)
    cache, done = _queue(mgr, 2)
    _update(mgr, done, status="succeeded")
    _update(mgr, cache, status="running")  # on another machine
    waiting = _queue(mgr, 5, depends_on=cache, priority=5)
    (ready,) = _queue(mgr, 1, depends_on=done, priority=4)
    (other,) = _queue(mgr, 1)
    real, asked = queue_module.dependency_state, []

    def retried_meanwhile(session, job_id, depends_on):  # the user retries the finished cache job mid-scan
        asked.append(job_id)
        if job_id == ready:
            _update(mgr, done, status="queued")
        return real(session, job_id, depends_on)

    monkeypatch.setattr(queue_module, "dependency_state", retried_meanwhile)
    assert mgr._start_next() is True and started == [(other, [])]  # passed over, and the next job started
    assert asked == [ready, other] and not set(waiting) & set(asked)  # waiting jobs were never looked at
    assert _row(mgr, ready).status == "queued"
