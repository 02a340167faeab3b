"""The path-escape matrix: every path field of both configs x every trick, each refused with its field path.

Path fields are the ones the schemas mark (``simpletuner.config.paths.path_fields``), so a new path field joins
the matrix by being marked; ``test_every_path_like_field_is_marked`` catches one that is not.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from simpletuner.config import (ConfigError, DatasetBackend, TextEmbedsBackend, TrainConfig, load_data_backends,
                                load_train_config)
from tests.server.helpers import data_backends, train_config

ROOTS_ENV = "SIMPLETUNER_ALLOWED_ROOTS"
# every path field of config.json: (kind, where a relative path is read from); the schemas must mark exactly these
TRAIN_FIELDS = {
    "pretrained_model_name_or_path": ("model", "workdir"),
    "pretrained_transformer_model_name_or_path": ("model", "workdir"),
    "pretrained_transformer_subfolder": ("subfolder", "workdir"),
    "pretrained_vae_model_name_or_path": ("model", "workdir"),
    "output_dir": ("dir", "workdir"),
    "resume_from_checkpoint": ("dir", "either"),
    "data_backend_config": ("file", "workdir"),
    "init_lora": ("file", "workdir"),
    "group_offload_to_disk_path": ("dir", "workdir"),
    "user_prompt_library": ("file", "workdir"),
    "pretrained_evaluation_model_name_or_path": ("model", "workdir"),
    "tracker_run_name": ("subfolder", "workdir"),
    "logging_dir": ("dir", "output_dir"),
    "webhook_config": ("webhook", "workdir"),
    "lycoris_config": ("json", "workdir"),
    "deepspeed_config": ("json", "workdir"),
    "cache_manifest": ("file", "workdir"),
}
DATA_FIELDS = [("d", "instance_data_dir"), ("d", "cache_dir_vae"), ("te", "cache_dir")]

# trick -> value for a field read from ``base``: ``up`` climbs from that base to the sandbox's top (the working dir
# is tmp/work; a job's output folder, from which logging_dir is read, is tmp/data/runs/job-N/output)
TRICKS = {
    "dotdot": lambda sb, up, link: f"{up}outside/x",
    "absolute": lambda sb, up, link: str(sb.outside / "x"),
    "tilde": lambda sb, up, link: "~/x",  # HOME is the outside folder
    "url": lambda sb, up, link: f"s3://bucket/../../{up}outside/x",  # a local path to the trainer: s3:/bucket/..
    "brace": lambda sb, up, link: f"{{/../{up}outside/x",
    "bracket": lambda sb, up, link: f"[/../{up}outside/x",
    "symlink": lambda sb, up, link: link,
    "nul": lambda sb, up, link: f"imgs\x00/../{up}outside/x",
    "lookalike-dots": lambda sb, up, link: f"{up}".replace("..", "\u2025") + "outside/x",  # NFKC: ".."
    "fullwidth": lambda sb, up, link: up.replace(".", "\uff0e").replace("/", "\uff0f") + "outside\uff0fx",
}


def _value(sb, trick: str, base: str = "workdir") -> str:
    up = "../../../../" if base == "output_dir" else "../"
    link = str(sb.work / "link" / "x") if base == "output_dir" else "link/x"
    return TRICKS[trick](sb, up, link)


def _tricks_for(kind: str) -> list[str]:
    # a subfolder is judged by its spelling (its parent folder by realpath), so a link inside is the parent's matter
    return [t for t in TRICKS if not (kind == "subfolder" and t == "symlink")]


TRAIN_CASES = [(name, trick) for name, (kind, _) in TRAIN_FIELDS.items() for trick in _tricks_for(kind)]
DATA_CASES = [(entry, name, trick) for entry, name in DATA_FIELDS for trick in TRICKS]


def _errors(response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {e["path"]: e["message"] for e in response.json()["errors"]}


@pytest.mark.parametrize("name, trick", TRAIN_CASES, ids=[f"{n}-{t}" for n, t in TRAIN_CASES])
def test_train_config_path_tricks_are_refused(api, sandbox, monkeypatch, name, trick):
    monkeypatch.setenv("HOME", str(sandbox.outside))
    before = sandbox.outside_files()
    value = _value(sandbox, trick, TRAIN_FIELDS[name][1])
    r = api.post("/api/jobs", json={"train_config": train_config(**{f"--{name}": value}),
                                    "data_backends": data_backends()})
    assert f"train_config.{name}" in _errors(r)
    assert api.get("/api/jobs").json()["total"] == 0
    assert sandbox.outside_files() == before


@pytest.mark.parametrize("entry, name, trick", DATA_CASES, ids=[f"{e}.{n}-{t}" for e, n, t in DATA_CASES])
def test_data_backend_path_tricks_are_refused(api, sandbox, monkeypatch, entry, name, trick):
    monkeypatch.setenv("HOME", str(sandbox.outside))
    backends = data_backends()
    next(b for b in backends if b["id"] == entry)[name] = _value(sandbox, trick)
    r = api.post("/api/jobs", json={"train_config": train_config(), "data_backends": backends})
    assert f"data_backends[{entry}].{name}" in _errors(r)


def test_a_dataset_id_cannot_steer_its_default_cache_folder_outside(api):
    backends = data_backends()
    del backends[0]["cache_dir_vae"]
    backends[0]["id"] = "../../../outside"  # the default cache_dir_vae is cache/vae/<id>
    r = api.post("/api/jobs", json={"train_config": train_config(), "data_backends": backends})
    assert "data_backends[../../../outside].cache_dir_vae" in _errors(r)


@pytest.mark.parametrize("remote", ["aws", "s3", "hf", "huggingface", "csv_url"])
def test_a_remote_type_is_refused_not_an_escape(api, sandbox, remote):
    # today's check skipped any object with a remote "type", anywhere in either config
    cfg = train_config(type=remote, output_dir=str(sandbox.outside), init_lora=str(sandbox.outside / "x"))
    errors = _errors(api.post("/api/jobs", json={"train_config": cfg, "data_backends": data_backends()}))
    assert {"train_config.output_dir", "train_config.init_lora"} <= set(errors)
    backends = data_backends()
    backends[0].update(type=remote, instance_data_dir=str(sandbox.outside))
    errors = _errors(api.post("/api/jobs", json={"train_config": train_config(), "data_backends": backends}))
    assert "data_backends[d].instance_data_dir" in errors and "data_backends[d].type" in errors


@pytest.mark.parametrize("spelling", [
    {"TRAINER_EXTRA_ARGS": "--init_lora={outside}/x --lora_rank=4"},
    {"init-lora": "{outside}/x"},
    {"--init-lora": "{outside}/x"},
])
def test_every_spelling_of_a_key_is_checked(api, sandbox, spelling):
    cfg = train_config(**{k: v.format(outside=sandbox.outside) for k, v in spelling.items()})
    errors = _errors(api.post("/api/jobs", json={"train_config": cfg, "data_backends": data_backends()}))
    assert "train_config.init_lora" in errors


def test_overrides_are_checked_too(api, sandbox):
    api.post("/api/configs", json={"name": "ok", "train_config": train_config(), "data_backends": data_backends()})
    r = api.post("/api/jobs", json={"config_name": "ok", "overrides": {"init_lora": str(sandbox.outside / "x")}})
    assert "train_config.init_lora" in _errors(r)


def test_logging_dir_is_judged_from_the_output_folder(api):
    # logging_dir is relative to output_dir (RUN_DIR/output), not to the working dir
    r = api.post("/api/jobs", json={"train_config": train_config(logging_dir="../../../../outside"),
                                    "data_backends": data_backends()})
    assert "train_config.logging_dir" in _errors(r)


def test_an_outside_webhook_config_is_refused_without_being_read(api, sandbox):
    fifo = sandbox.outside / "hooks.json"
    os.mkfifo(fifo)  # opening it to read blocks until a writer comes: we see whether anyone tried
    opened = []

    def watch():
        deadline = time.time() + 10
        while time.time() < deadline and not stop.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only while a reader has it open
            except OSError:
                time.sleep(0.005)
                continue
            opened.append(True)
            os.write(fd, b"[]")
            os.close(fd)
            return

    stop = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for value in (str(fifo), "../outside/hooks.json", "link/hooks.json"):
            r = api.post("/api/jobs", json={"train_config": train_config(webhook_config=value),
                                            "data_backends": data_backends()})
            assert "train_config.webhook_config" in _errors(r)
    finally:
        stop.set()
        watcher.join()
    assert not opened, "the server opened a webhook_config file outside the allowed roots"
    r = api.post("/api/jobs", json={"train_config": train_config(webhook_config=str(sandbox.outside / "secret.json")),
                                    "data_backends": data_backends()})
    assert "do-not-leak" not in r.text


def test_an_inside_webhook_file_is_read_from_where_it_resolves(api, sandbox):
    (sandbox.work / "hooks.json").write_text(json.dumps({"webhook_type": "raw", "callback_url": "http://x/h"}))
    r = api.post("/api/jobs", json={"train_config": train_config(webhook_config="hooks.json"),
                                    "data_backends": data_backends()})
    assert r.status_code == 201, r.text
    frozen = api.get(f"/api/jobs/{r.json()['id']}").json()["train_config"]
    assert frozen["webhook_config"][0]["callback_url"] == "http://x/h"  # inlined: the trainer opens no file


ACCEPTED = {  # odd but harmless: each resolves inside the roots
    "url-like": "cache/s3://bucket/vae",
    "brace": "cache/{vae}",
    "bracket": "cache/[vae]",
    "dotdot-inside": "imgs/../cache/vae",
    "unicode": "cache/donn\u00e9es",
    "fullwidth-name": "cache/\uff56\uff41\uff45",
}


@pytest.mark.parametrize("trick", ACCEPTED)
def test_odd_paths_inside_the_roots_are_accepted(api, trick):
    backends = data_backends()
    backends[0]["cache_dir_vae"] = ACCEPTED[trick]
    r = api.post("/api/jobs", json={"train_config": train_config(), "data_backends": backends})
    assert r.status_code == 201, r.text


def test_hub_ids_are_not_paths(api):
    r = api.post("/api/jobs", json={"train_config": train_config(
        pretrained_vae_model_name_or_path="black-forest-labs/FLUX.1-dev",
        pretrained_evaluation_model_name_or_path="openai/clip-vit-large-patch14"), "data_backends": data_backends()})
    assert r.status_code == 201, r.text


# ---- the trainer checks again when it opens the paths (symlinks swapped in after the submit) ----------------
def _loaded(sandbox, train_values: dict, backends: list):
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", **train_values}).config
    return config, load_data_backends(backends, config=config)


# webhook and json files are read as the config loads: test_a_json_file_swapped_after_submit_is_refused_as_it_loads
TRAIN_SWAPS = [n for n, (kind, _) in TRAIN_FIELDS.items() if kind not in ("subfolder", "webhook", "json")]


@pytest.mark.parametrize("name", TRAIN_SWAPS)
def test_a_symlink_swapped_in_after_submit_is_refused_at_open_time(api, sandbox, monkeypatch, name):
    from simpletuner.config.paths import PathOutsideRoots
    from simpletuner.training.paths import check_run_paths

    later = sandbox.work / "later"
    later.mkdir()
    (later / "x").write_text('{"cat": "a cat"}')  # a prompt library, when the field is one
    values = {"output_dir": str(sandbox.data / "runs" / "job-1" / "output"),
              name: str(later / "x") if name == "logging_dir" else "later/x"}
    r = api.post("/api/jobs", json={"train_config": train_config(**{name: values[name]}),
                                    "data_backends": data_backends()})
    assert r.status_code == 201, r.text  # nothing wrong at submit time
    (later / "x").unlink()
    later.rmdir()
    later.symlink_to(sandbox.outside)  # ...swapped for a link before the trainer starts
    monkeypatch.chdir(sandbox.work)
    monkeypatch.setenv(ROOTS_ENV, json.dumps([str(sandbox.work), str(sandbox.data)]))
    config, backends = _loaded(sandbox, values, data_backends())
    with pytest.raises(PathOutsideRoots) as info:
        check_run_paths(config, backends)
    assert info.value.field == name


def test_a_json_file_swapped_after_submit_is_refused_as_it_loads(api, sandbox, monkeypatch):
    later = sandbox.work / "later"
    later.mkdir()
    (later / "lyco.json").write_text('{"algo": "lokr", "factor": 4}')
    monkeypatch.chdir(sandbox.work)  # the server reads it (from its working dir) to validate the config
    r = api.post("/api/jobs", json={"train_config": train_config(lora_type="lycoris", lycoris_config="later/lyco.json"),
                                    "data_backends": data_backends()})
    assert r.status_code == 201, r.text
    (later / "lyco.json").unlink()
    later.rmdir()
    later.symlink_to(sandbox.outside)
    (sandbox.outside / "lyco.json").write_text('{"algo": "full"}')
    monkeypatch.setenv(ROOTS_ENV, json.dumps([str(sandbox.work), str(sandbox.data)]))
    with pytest.raises(ConfigError) as info:
        load_train_config({"model_family": "flux", "model_flavour": "tiny", "lora_type": "lycoris",
                           "lycoris_config": "later/lyco.json"})
    assert "lycoris_config" in str(info.value) and "outside" in str(info.value)
    monkeypatch.delenv(ROOTS_ENV)  # the CLI on its own reads the user's own files
    assert load_train_config({"model_family": "flux", "model_flavour": "tiny", "lora_type": "lycoris",
                              "lycoris_config": "later/lyco.json"}).config.lycoris_config.algo == "full"


@pytest.mark.parametrize("entry, name", DATA_FIELDS)
def test_a_swapped_data_folder_is_refused_at_open_time(sandbox, monkeypatch, entry, name):
    from simpletuner.config.paths import PathOutsideRoots
    from simpletuner.training.paths import check_run_paths

    (sandbox.work / "later").symlink_to(sandbox.outside)
    backends = data_backends()
    next(b for b in backends if b["id"] == entry)[name] = "later/x"
    monkeypatch.chdir(sandbox.work)
    monkeypatch.setenv(ROOTS_ENV, json.dumps([str(sandbox.work), str(sandbox.data)]))
    config, loaded = _loaded(sandbox, {"output_dir": str(sandbox.data / "out")}, backends)
    with pytest.raises(PathOutsideRoots) as info:
        check_run_paths(config, loaded)
    assert info.value.field == f"datasets[{entry}].{name}"


def test_without_roots_the_cli_trainer_checks_nothing(sandbox, monkeypatch):
    from simpletuner.training.paths import check_run_paths

    monkeypatch.delenv(ROOTS_ENV, raising=False)
    config, backends = _loaded(sandbox, {"output_dir": str(sandbox.outside / "out")}, data_backends())
    check_run_paths(config, backends)  # the user's own machine: their own files


def test_the_schemas_mark_exactly_these_path_fields():
    from simpletuner.config.paths import path_fields

    assert {n: (f.kind, f.base) for n, f in path_fields(TrainConfig).items()} == TRAIN_FIELDS
    marked = [("d", n) for n in path_fields(DatasetBackend)] + [("te", n) for n in path_fields(TextEmbedsBackend)]
    assert marked == DATA_FIELDS


def test_every_path_like_field_is_marked():
    """A field whose name says it holds a path must be marked, or the checks above would not see it."""
    from simpletuner.config.paths import path_fields

    suffixes = ("_dir", "_path", "_file", "_folder", "_or_path", "_config", "_library", "_checkpoint", "_lora")
    not_paths = {"tread_config", "data_backend_config_version", "optimizer_config"}  # settings, not files
    for model in (TrainConfig, DatasetBackend, TextEmbedsBackend):
        marked = path_fields(model)
        for name in model.model_fields:
            if name.endswith(suffixes) or name.startswith("cache_dir"):
                assert name in marked or name in not_paths, f"{model.__name__}.{name} holds a path but is not marked"
