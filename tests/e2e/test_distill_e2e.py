"""End to end: a distillation job through the real server (uvicorn subprocess, the trainer under its launcher,
webhooks back over HTTP), and ``simpletuner distill-pairs`` on two real ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
PROMPTS = ["a red circle", "a blue square"]


def tiny_distillation(tmp: Path, **distillation) -> dict:
    return {"model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0,
            "max_train_steps": 3, "checkpointing_steps": 2, "resolution": 32, "resolution_type": "pixel",
            "validation_steps": 3, "validation_num_inference_steps": 4, "lora_rank": 4,
            "distillation": {"prompts": PROMPTS, "validation_num_samples": 1,
                             "pairs_cache_dir": str(tmp / "pairs"), **distillation}}


def test_a_distillation_job_runs_through_the_server(tmp_path):
    server = ServerProcess(tmp_path / "data", tmp_path).start()
    try:
        job = {"name": "distill", "train_config": tiny_distillation(tmp_path, objective="dmd",
                                                                     generator_update_ratio=2),
               "data_backends": [{"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "text")}]}
        created = server.http.post("/api/jobs", json=job)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        done = server.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=600)
        log = server.http.get(f"/api/jobs/{job_id}/log", params={"tail": 60}).text
        assert done["status"] == "succeeded", log
        assert done["results"]["steps"] == 3 and isinstance(done["results"]["final_loss"], float)
        lora = Path(done["results"]["lora_path"])
        assert lora.is_file() and (lora.parent / "distillation.json").is_file()

        progress = [e["data"]["step"] for e in server.events(job_id, "progress")]
        assert progress == [1, 2, 3]
        scores = server.events(job_id, "scores")
        assert scores and {"distill/teacher_mse_1step", "distill/teacher_mse_4step"} <= set(scores[-1]["data"]
                                                                                          ["metrics"])
        images = server.events(job_id, "image")
        assert images and images[-1]["data"]["kind"] == "validation" and images[-1]["data"]["step"] == 3
        assert [e["data"]["step"] for e in server.events(job_id, "checkpoint")] == [2, 3]
        checkpoint = Path(done["run_dir"]) / "output" / "checkpoint-3"
        assert (checkpoint / "trainable-critic.safetensors").is_file() and (checkpoint / "critic_optimizer.pt").is_file()
    finally:
        server.stop()


def test_distill_pairs_on_two_ranks_makes_each_trajectory_once_and_resumes(tmp_path):
    config = tiny_distillation(tmp_path, objective="ode_regression", teacher_num_inference_steps=3,
                               ode_pairs_per_prompt=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "multidatabackend.json").write_text(json.dumps(
        [{"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "text")}]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_") or k == "SIMPLETUNER_TINY_DIR"}
    command = [sys.executable, "-m", "simpletuner.cli", "distill-pairs", "--config", str(tmp_path / "config.json")]
    first = subprocess.run([*command, "--num_processes", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    # one report per rank, each made its half of the 4. Not split into lines: the ranks share the pipe, and with
    # PYTHONUNBUFFERED set print() writes a message and its newline separately, so two reports can share a line
    made = re.findall(r"(\d+) teacher trajectories made; 4 stored", first.stdout)
    assert sorted(made) == ["2", "2"], first.stdout
    assert len(list((tmp_path / "pairs").rglob("*.safetensors"))) == 4
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 teacher trajectories made; 4 stored" in again.stdout

    wrong = dict(config, distillation={**config["distillation"], "objective": "dmd"})
    del wrong["distillation"]["teacher_num_inference_steps"], wrong["distillation"]["ode_pairs_per_prompt"]
    (tmp_path / "dmd.json").write_text(json.dumps(wrong))
    refused = subprocess.run([*command[:-1], str(tmp_path / "dmd.json")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=1200)
    assert refused.returncode == 1 and "distillation.objective" in refused.stderr
