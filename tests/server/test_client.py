"""``simpletuner jobs`` against a live server, and ``simpletuner server`` argument handling."""

import json

import pytest

from simpletuner.cli import _build_parser
from simpletuner.server import cli as server_cli
from simpletuner.server import client as jobs_cli
from simpletuner.server.client import parse_sse

from tests.server.helpers import data_backends, job_body, train_config


def _jobs(srv, *argv, token=None):
    token_args = []
    if token:
        token_file = srv.settings.data_dir / "client-token"
        token_file.write_text(token + "\n")
        token_args = ["--token-file", str(token_file)]
    args = ["jobs", "--server", srv.url] + token_args + list(argv)
    return jobs_cli.run(_build_parser("jobs").parse_args(args))


def test_submit_wait_list_show_logs(live_server, workdir, tmp_path, capsys, monkeypatch):
    srv = live_server()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**train_config(), "--data_backend_config": str(tmp_path / "mdb.json")}))
    (tmp_path / "mdb.json").write_text(json.dumps(data_backends(str(workdir / "imgs"))))
    monkeypatch.chdir(tmp_path)
    assert _jobs(srv, "submit", "--config", str(cfg), "--set", "max_train_steps=2", "--wait") == 0
    out = capsys.readouterr().out
    assert "job 1 " in out and "step 2/2" in out and "job 1 succeeded" in out
    assert _jobs(srv, "list") == 0
    assert "succeeded" in capsys.readouterr().out
    assert _jobs(srv, "show", "1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["results"]["steps"] == 2
    assert _jobs(srv, "logs", "1", "--tail", "3") == 0
    assert "step 2/2" in capsys.readouterr().out


def test_submit_stored_config_and_cancel(live_server, capsys):
    srv = live_server(run_scheduler=False)
    srv.http.post("/api/configs", json={"name": "tiny", "train_config": train_config(),
                                        "data_backends": data_backends()})
    assert _jobs(srv, "submit", "--config-name", "tiny", "--priority", "3") == 0
    assert "queued, position 1" in capsys.readouterr().out
    assert _jobs(srv, "cancel", "1") == 0
    assert "cancelled" in capsys.readouterr().out


def test_errors_are_readable(live_server, tmp_path, capsys):
    srv = live_server(run_scheduler=False, require_token=True)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_family": "flux", "learning_rate": "x"}))
    assert _jobs(srv, "list") == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert _jobs(srv, "submit", "--config", str(cfg), token="test-token") == 2
    err = capsys.readouterr().err
    assert "HTTP 422" in err and "train_config.learning_rate" in err
    token_file = srv.settings.data_dir / "client-token"
    assert jobs_cli.run(_build_parser("jobs").parse_args(
        ["jobs", "--server", srv.url, "list", "--token-file", str(token_file)])) == 0  # after the action too


def test_unreachable_server(capsys):
    args = _build_parser("jobs").parse_args(["jobs", "--server", "http://127.0.0.1:9", "list"])
    assert jobs_cli.run(args) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_parse_sse():
    lines = ["retry: 2000", "", ": keepalive", "id: 3", "event: progress", 'data: {"a":', "data: 1}", "", "id: 4"]
    events = list(parse_sse(iter(lines)))
    assert events[0] == {"retry": "2000"}
    assert events[1] == {"id": "3", "event": "progress", "data": '{"a":\n1}'}
    assert events[2] == {"id": "4"}


def test_server_args_to_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_SERVER_JOB_COMMAND", '["{python}", "x.py"]')
    args = _build_parser("server").parse_args([
        "server", "--port", "9000", "--data-dir", str(tmp_path), "--db-url", "sqlite:///x.db",
        "--max-concurrent", "3", "--require-token", "--allowed-root", str(tmp_path),
        "--token-file", str(tmp_path / "token")])
    (tmp_path / "token").write_text("t\n")
    s = server_cli.settings_from_args(args)
    assert (s.port, s.max_concurrent, s.require_token, s.db_url) == (9000, 3, True, "sqlite:///x.db")
    assert s.resolve_token() == ("t", False)
    assert s.resolved_allowed_roots() == [tmp_path.resolve()] and s.job_command == ["{python}", "x.py"]
    assert s.webhook_base_url() == "http://127.0.0.1:9000"


def test_a_token_on_the_command_line_is_refused(tmp_path, capsys):
    """ps shows every user the command lines of every process: the token comes from the env or a file."""
    args = _build_parser("server").parse_args(["server", "--data-dir", str(tmp_path), "--token", "s3cret"])
    with pytest.raises(SystemExit, match="SIMPLETUNER_API_TOKEN"):
        server_cli.settings_from_args(args)
    args = _build_parser("jobs").parse_args(["jobs", "--server", "http://127.0.0.1:9", "--token", "s3cret", "list"])
    assert jobs_cli.run(args) == 2
    assert "--token-file" in capsys.readouterr().err


def test_set_overrides_a_key_the_config_spells_with_dashes(live_server, workdir, tmp_path, monkeypatch, capsys):
    """`--set max_train_steps=2` on a config holding "--max_train_steps" (and TRAINER_EXTRA_ARGS) was refused as
    "given twice"; an override must override."""
    srv = live_server(run_scheduler=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"--model_family": "flux", "--model_flavour": "tiny", "--max_train_steps": 50,
                               "TRAINER_EXTRA_ARGS": "--lora_rank=8 --learning-rate=1e-3",
                               "--data_backend_config": str(tmp_path / "mdb.json")}))
    (tmp_path / "mdb.json").write_text(json.dumps(data_backends(str(workdir / "imgs"))))
    monkeypatch.chdir(tmp_path)
    assert _jobs(srv, "submit", "--config", str(cfg), "--set", "max_train_steps=2", "--set", "lora_rank=4",
                 "--set", "learning_rate=5e-4") == 0, capsys.readouterr().err
    frozen = srv.http.get("/api/jobs/1").json()["train_config"]
    assert (frozen["max_train_steps"], frozen["lora_rank"], frozen["learning_rate"]) == (2, 4, 5e-4)


def test_jobs_retry_continues_the_run(live_server, capsys):
    srv = live_server()
    body = job_body(train={"tracker_run_name": "resume", "max_train_steps": 9, "checkpointing_steps": 3,
                           "tracker_project_name": "crash-at-7"})
    job = srv.http.post("/api/jobs", json=body).json()
    srv.wait_status(job["id"], "failed")
    assert _jobs(srv, "retry", str(job["id"]), "--wait") == 0
    out = capsys.readouterr().out
    assert "resumes from step 6" in out and f"job {job['id']} succeeded" in out
    assert _jobs(srv, "retry", str(job["id"]), "--start-over") == 0
    assert "starts over" in capsys.readouterr().out
