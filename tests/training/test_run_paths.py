"""``simpletuner.training.paths.check_run_paths``: the trainer's own check, at open time, in a server's job."""

from __future__ import annotations

import json

import pytest

from simpletuner.config import load_data_backends, load_train_config, paths
from simpletuner.training.paths import check_run_paths
from tests.server.helpers import data_backends


@pytest.fixture
def job(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "imgs").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    monkeypatch.chdir(root)
    monkeypatch.setenv(paths.ROOTS_ENV, json.dumps([str(root)]))
    return root, outside


def _loaded(backends=None, **train):
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", **train}).config
    return config, load_data_backends(backends or data_backends(), config=config)


def test_inside_paths_pass_and_every_outside_one_is_listed(job):
    root, outside = job
    check_run_paths(*_loaded(output_dir="out"))
    backends = data_backends()
    backends[0]["cache_dir_vae"] = "link/vae"
    backends[1]["cache_dir"] = str(outside / "text")
    config, loaded = _loaded(backends, output_dir="link/out")
    with pytest.raises(paths.PathOutsideRoots) as caught:
        check_run_paths(config, loaded)
    assert caught.value.field == "output_dir"  # the first one names the error
    message = caught.value.message
    assert message.startswith(f"'link/out' resolves to {outside / 'out'}, outside the allowed roots")
    assert f"; datasets[d].cache_dir_vae: 'link/vae' resolves to {outside / 'vae'}" in message
    assert f"; datasets[te].cache_dir: '{outside / 'text'}' resolves to" in message
    assert f"; logging_dir: " in message and message.count("; ") == 3  # the logs default to output_dir/logs


def test_logging_dir_is_read_from_the_resolved_output_folder(job):
    root, outside = job
    (root / "runs").mkdir()
    (root / "runs" / "out").symlink_to(root / "imgs")  # output_dir is resolved before logging_dir is read from it
    check_run_paths(*_loaded(output_dir="runs/out", logging_dir="../logs"))  # root/logs: inside
    config, loaded = _loaded(output_dir="runs/out", logging_dir="../../logs")  # from root/imgs: tmp/logs
    with pytest.raises(paths.PathOutsideRoots) as caught:
        check_run_paths(config, loaded)
    assert caught.value.field == "logging_dir"


def test_without_roots_nothing_is_checked(job, monkeypatch):
    _, outside = job
    monkeypatch.delenv(paths.ROOTS_ENV)
    check_run_paths(*_loaded(output_dir=str(outside / "out")))
