"""The shared launcher: one builder of ``accelerate launch`` for the CLI, the server and workers."""

from __future__ import annotations

import sys

import pytest

from simpletuner.config.launch import LaunchSpec, accelerate_command, launch_env, problems


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_process_on_the_cpu_uses_cpu_mode():
    cmd = accelerate_command(LaunchSpec(use_cpu=True), ["--config", "c.json"])
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert "--cpu" in cmd and "--multi_gpu" not in cmd and "--machine_rank" not in cmd
    assert cmd[-4:] == ["-m", "simpletuner.train", "--config", "c.json"]
    assert launch_env(LaunchSpec(use_cpu=True), {})["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU" not in launch_env(LaunchSpec(use_cpu=False), {})


def test_several_processes_on_the_cpu_are_real_gloo_ranks():
    # `--cpu --num_processes 2` silently runs one process: --multi_gpu + ACCELERATE_USE_CPU=1 gives two ranks
    spec = LaunchSpec(num_processes=2, use_cpu=True)
    cmd = accelerate_command(spec, [])
    assert "--multi_gpu" in cmd and "--cpu" not in cmd and _flag(cmd, "--num_processes") == "2"
    assert launch_env(spec, {"A": "1"}) == {"A": "1", "ACCELERATE_USE_CPU": "1"}


def test_a_machine_of_a_multi_node_run_gets_its_rank_and_rank_zeros_address():
    spec = LaunchSpec(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.5",
                      main_process_port=29555)
    cmd = accelerate_command(spec, ["--config", "c.json"], python="/opt/py")
    assert cmd[0] == "/opt/py"
    assert (_flag(cmd, "--num_processes"), _flag(cmd, "--num_machines"), _flag(cmd, "--machine_rank")) == \
        ("4", "2", "1")
    assert (_flag(cmd, "--main_process_ip"), _flag(cmd, "--main_process_port")) == ("10.0.0.5", "29555")
    assert _flag(cmd, "--rdzv_backend") == "static" and "--multi_gpu" in cmd
    assert spec.processes_here == 2


@pytest.mark.parametrize("spec, field, words", [
    (LaunchSpec(num_processes=3, num_machines=2, main_process_ip="h", main_process_port=1), "num_processes",
     "do not divide evenly"),
    (LaunchSpec(num_processes=2, num_machines=2, machine_rank=2, main_process_ip="h", main_process_port=1),
     "machine_rank", "not in 0..1"),
    (LaunchSpec(num_processes=2, num_machines=2, main_process_port=1), "main_process_ip", "rank 0's address"),
    (LaunchSpec(num_processes=2, num_machines=2, main_process_ip="bad host!", main_process_port=1),
     "main_process_ip", "not a host name"),
    (LaunchSpec(num_processes=2, num_machines=2, main_process_ip="h"), "main_process_port", "rendezvous port"),
    (LaunchSpec(main_process_port=70000), "main_process_port", "not a TCP port"),
    (LaunchSpec(num_processes=0), "num_processes", "below 1"),
])
def test_a_spec_that_cannot_launch_names_its_field(spec, field, words):
    found = problems(spec)
    assert any(f == field and words in m for f, m in found), found
    with pytest.raises(ValueError, match=field):
        accelerate_command(spec, [])


def test_cli_and_server_build_the_same_command(tmp_path):
    """There is one builder: the CLI's --num_processes and the server's job launch agree flag for flag."""
    from simpletuner.server.broker import EventBroker
    from simpletuner.server.db import Database, JobRow
    from simpletuner.server.queue import JobManager
    from simpletuner.training.cli import launch_command
    from tests.helpers import namespace
    from tests.server.helpers import make_settings

    settings = make_settings(tmp_path, tmp_path, job_command=None, run_scheduler=False)
    settings.data_dir.mkdir(parents=True)
    db = Database(settings.resolved_db_url())
    db.create_all()
    mgr = JobManager(settings, db, EventBroker())
    job = JobRow(id=7, attempt=1, num_processes=2, train_config={}, data_backends=[])
    server_cmd = mgr.plan(job, []).cmd
    config = str(tmp_path / "data" / "runs" / "job-7" / "config.json")
    cli_cmd = launch_command(namespace(num_processes=2, config=config, data_backend_config=None, set=[],
                                       config_flags=[]))
    assert server_cmd == cli_cmd
