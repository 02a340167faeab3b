"""End to end, with the real server and real tiny-Flux trainers: paths that look odd but resolve inside the roots
train and write nothing outside them; a symlink swapped in after the submit is refused by the trainer when it
opens the path (the job carries its roots), and nothing is written where the link points."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.server_process import REPO, ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _tree(root: Path, skip: list[Path]) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        found.update(str(here / n) for n in dirnames + filenames)
    return found


def test_odd_inside_paths_train_and_a_swapped_symlink_is_refused_at_open_time(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    data = root / "data"
    odd_dataset = root / "sets" / "[sample] donn\u00e9es {1}"
    shutil.copytree(REPO / "datasets" / "sample", odd_dataset)
    outside.mkdir()
    (outside / "keep.txt").write_text("untouched")
    swap = root / "swap"
    swap.mkdir()
    before = _tree(tmp_path, skip=[root])
    repo_before = {p.name for p in REPO.iterdir()}  # the server's working dir is not a root here either

    cfg = json.loads((REPO / "config" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k.lstrip("-") not in ("data_backend_config", "output_dir")}
    cfg.update({"--max_train_steps": 4, "--checkpointing_steps": 2, "--lr_warmup_steps": 0,
                "--logging_dir": "logs/s3://bucket/{run}"})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(instance_data_dir=str(odd_dataset), resolution=64,
                       cache_dir_vae=f"{root}/cache/s3://bucket/[vae]")  # '://' is just a folder name here
    backends[1].update(cache_dir=f"{root}/cache/{{text}}/../{{text}}")
    logs = root / "logs"
    logs.mkdir()
    server = ServerProcess(data, logs, roots=[root]).start()
    try:
        odd = server.http.post("/api/jobs", json={"name": "odd", "train_config": cfg, "data_backends": backends})
        assert odd.status_code == 201, odd.text
        swapped = [dict(b) for b in backends]
        swapped[0]["cache_dir_vae"] = str(swap / "vae")
        later = server.http.post("/api/jobs", json={"name": "swapped", "train_config": cfg, "data_backends": swapped})
        assert later.status_code == 201, later.text  # nothing wrong when it was submitted...
        swap.rmdir()
        swap.symlink_to(outside, target_is_directory=True)  # ...then the folder becomes a link outside

        done = server.wait_status(odd.json()["id"], "succeeded", "failed")
        assert done["status"] == "succeeded", server.http.get(f"/api/jobs/{done['id']}/log").text[-3000:]
        assert list((root / "cache" / "s3:" / "bucket" / "[vae]").rglob("*.safetensors"))
        assert list((root / "cache" / "{text}").rglob("*.safetensors"))

        refused = server.wait_status(later.json()["id"], "succeeded", "failed")
        assert refused["status"] == "failed"
        assert "datasets[sample].cache_dir_vae" in (refused["error"] or ""), refused
        assert "outside the allowed roots" in refused["error"]
    finally:
        server.stop()
    assert _tree(tmp_path, skip=[root]) == before  # not one file appeared outside the root
    assert {p.name for p in REPO.iterdir()} == repo_before
    assert (outside / "keep.txt").read_text() == "untouched"
