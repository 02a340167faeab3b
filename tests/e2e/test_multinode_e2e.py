"""A 2-machine job as two workers on this machine (gloo, one process each): the server gang-schedules it, each
worker launches its machine rank with rank 0's rendezvous address, and the losses equal a 2-process single-machine
run of the same config; killed mid-save, the whole gang re-queues and resumes from the newest checkpoint with the
same world size, and the losses still equal the uninterrupted run's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.fleet import WorkerProcess, worker_token, workers_of
from tests.e2e.server_process import REPO, ServerProcess

pytestmark = pytest.mark.e2e
STEPS, INTERVAL = 8, 4


def _losses(output) -> dict[int, float]:
    out = {}
    for line in (output / "training_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["loss"]  # a resumed run logs its redone steps again: the newest wins
    return out


def test_two_machine_job_matches_a_two_process_run_and_resumes(tmp_path, tiny_flux_path):
    cfg = json.loads((REPO / "config" / "config.json").read_text())
    cfg = {k.lstrip("-"): v for k, v in cfg.items() if k.lstrip("-") not in ("data_backend_config", "output_dir")}
    cfg.update(max_train_steps=STEPS, checkpointing_steps=INTERVAL, checkpoints_total_limit=None, lr_warmup_steps=0,
               resume_from_checkpoint=None)
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(resolution=64, cache_dir_vae=str(tmp_path / "cache" / "vae"),
                       instance_data_dir=str(REPO / "datasets" / "sample"))
    backends[1].update(cache_dir=str(tmp_path / "cache" / "text"))

    # the reference: one machine, two processes, from the command line
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "multidatabackend.json").write_text(json.dumps(backends))
    (ref / "config.json").write_text(json.dumps({**cfg, "output_dir": str(ref / "output"),
                                                 "data_backend_config": str(ref / "multidatabackend.json")}))
    done = subprocess.run([sys.executable, "-m", "simpletuner.cli", "train", "--config", str(ref / "config.json"),
                           "--num_processes", "2"], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _losses(ref / "output")
    assert sorted(expected) == list(range(1, STEPS + 1))

    runs = tmp_path / "shared-runs"
    server = ServerProcess(tmp_path / "server-data", tmp_path, "--no-local-worker", "--runs-dir", str(runs),
                           "--worker-lease", "20").start()
    workers = []
    try:
        token = worker_token(server, tmp_path)
        # machine 0 dies once, halfway through writing checkpoint-8: the gang must resume from checkpoint-4
        env = {"SIMPLETUNER_FAILPOINT": f"checkpoint.save:{STEPS}",
               "SIMPLETUNER_FAILPOINT_ONCE": str(tmp_path / "failpoint-fired")}
        workers = [WorkerProcess(server, token, name, tmp_path, env=env).start() for name in ("node-a", "node-b")]
        r = server.http.post("/api/jobs", json={"name": "two-machines", "train_config": cfg,
                                                 "data_backends": backends, "num_machines": 2, "num_processes": 2,
                                                 "max_retries": 1})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = server.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=700)
        assert job["status"] == "succeeded", (job, server.http.get(f"/api/jobs/{job_id}/log").text[-3000:])
        assert (tmp_path / "failpoint-fired").is_file() and job["attempt"] == 2
        machines = workers_of(server, job_id)
        for attempt in (1, 2):  # both machines ran both attempts, one rank each
            ranks = sorted((rank, name) for a, name, rank in machines if a == attempt)
            assert [rank for rank, _ in ranks] == [0, 1] and {n for _, n in ranks} == {"node-a", "node-b"}
        output = runs / f"job-{job_id}" / "output"
        assert json.loads((output / "run_summary.json").read_text())["global_step"] == STEPS
        state = json.loads((output / f"checkpoint-{STEPS}" / "training_state.json").read_text())
        assert state["world_size"] == 2
        log = (runs / f"job-{job_id}" / "train.log").read_text()
        assert f"resumed from {output / f'checkpoint-{INTERVAL}'}" in log
        assert _losses(output) == expected  # same losses as one machine with two processes, through the resume
    finally:
        for w in workers:
            w.stop()
        server.stop()
