"""Stored configs: versions, validation (422 with field paths), allowed roots."""

import json

import pytest

from simpletuner.config import CURRENT_CONFIG_VERSION
from tests.server.helpers import data_backends, train_config


def _create(client, name="tiny", **extra):
    body = {"name": name, "train_config": train_config(), "data_backends": data_backends(), **extra}
    return client.post("/api/configs", json=body)


def test_create_get_list_versions(client):
    r = _create(client, description="tiny flux", comment="first")
    assert r.status_code == 201, r.text
    assert r.json()["current_version"] == 1
    assert r.json()["latest"]["schema_version"] == CURRENT_CONFIG_VERSION
    r = client.put("/api/configs/tiny", json={"train_config": train_config(max_train_steps=7),
                                              "data_backends": data_backends(), "comment": "more steps"})
    assert r.status_code == 200 and r.json()["current_version"] == 2
    assert client.get("/api/configs/tiny").json()["latest"]["train_config"]["max_train_steps"] == 7
    v1 = client.get("/api/configs/tiny/versions/1").json()
    assert v1["train_config"]["max_train_steps"] == 3 and v1["comment"] == "first"
    assert [v["version"] for v in client.get("/api/configs/tiny/versions").json()] == [2, 1]
    listed = client.get("/api/configs").json()
    assert [(c["name"], c["current_version"], c["model_family"]) for c in listed] == [("tiny", 2, "flux")]


def test_duplicate_and_missing(client):
    assert _create(client).status_code == 201
    assert _create(client).status_code == 409
    assert client.get("/api/configs/nope").status_code == 404
    assert client.get("/api/configs/tiny/versions/9").status_code == 404
    assert client.delete("/api/configs/nope").status_code == 404


def test_put_creates_and_delete(client):
    r = client.put("/api/configs/new", json={"train_config": train_config(), "data_backends": data_backends()})
    assert r.status_code == 201
    assert client.delete("/api/configs/new").status_code == 204
    assert client.get("/api/configs/new").status_code == 404


def test_data_backends_and_prompt_library_read_from_named_files(client, workdir):
    (workdir / "mdb.json").write_text(json.dumps(data_backends()))
    (workdir / "prompts.json").write_text(json.dumps({"cat": "a photo of a cat"}))
    cfg = train_config(data_backend_config="mdb.json", user_prompt_library="prompts.json")
    r = client.post("/api/configs", json={"name": "files", "train_config": cfg})
    assert r.status_code == 201, r.text
    assert r.json()["latest"]["data_backends"][0]["id"] == "d"
    assert r.json()["latest"]["prompt_library"] == {"cat": "a photo of a cat"}


BAD_CONFIGS = [
    ({"model_family": "nope"}, None, "train_config.model_family"),
    ({"model_family": "flux", "learning_rate": "fast"}, None, "train_config.learning_rate"),
    ({"model_family": "flux", "lora_rank": 0}, None, "train_config.lora_rank"),
    ({"model_family": "flux", "mixed_precision": "fp8"}, None, "train_config.mixed_precision"),
    ({"model_family": "flux", "optimizer": "sgd"}, None, "train_config.optimizer"),
    ({"model_family": "flux", "train_batch_size": -1}, None, "train_config.train_batch_size"),
    ({"model_family": "flux", "lora_dropout": 1.5}, None, "train_config.lora_dropout"),
    ({"model_flavour": "tiny"}, None, "train_config.model_family"),
    ({"model_family": "flux", "output_dir": "/etc/evil"}, None, "train_config.output_dir"),
    ({"model_family": "flux", "--init_lora": "../../outside/l.safetensors"}, None, "train_config.init_lora"),
    ({"model_family": "flux"}, [{"id": "d", "instance_data_dir": "/etc"}], "data_backends[d].instance_data_dir"),
    ({"model_family": "flux"}, [{"id": "d", "instance_data_dir": "imgs", "resolution": "big"}],
     "data_backends[d].resolution"),
    ({"model_family": "flux"}, [{"id": "d", "instance_data_dir": "imgs", "caption_strategy": "telepathy"}],
     "data_backends[d].caption_strategy"),
    ({"model_family": "flux"}, [{"id": "d", "instance_data_dir": "imgs", "cache_dir_vae": "/tmp/../etc/x"}],
     "data_backends[d].cache_dir_vae"),
    ({"model_family": "flux", "validation_steps": "often"}, None, "train_config.validation_steps"),
]


@pytest.mark.parametrize("cfg,backends,path", BAD_CONFIGS, ids=[p for _, _, p in BAD_CONFIGS])
def test_bad_configs_are_422_with_field_paths(client, cfg, backends, path):
    body = {"name": "bad", "train_config": cfg, "data_backends": backends if backends is not None else data_backends()}
    r = client.post("/api/configs", json=body)
    assert r.status_code == 422, r.text
    paths = [e["path"] for e in r.json()["errors"]]
    assert path in paths, paths
    assert all(e["message"] for e in r.json()["errors"])
    # the same through job submission and the validate endpoint
    job = client.post("/api/jobs", json={"train_config": body["train_config"], "data_backends": body["data_backends"]})
    assert job.status_code == 422 and path in [e["path"] for e in job.json()["errors"]]
    v = client.post("/api/configs/validate", json=body).json()
    assert v["valid"] is False and path in [e["path"] for e in v["errors"]]


def test_symlink_out_of_root_is_refused(client, workdir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (workdir / "link").symlink_to(outside)
    r = client.post("/api/configs/validate", json={"train_config": train_config(),
                                                   "data_backends": data_backends("link")})
    assert r.json()["valid"] is False
    assert r.json()["errors"][0]["path"] == "data_backends[d].instance_data_dir"


def test_request_shape_errors_use_the_same_shape(client):
    r = client.post("/api/configs", json={"name": "bad name!", "train_config": {}})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "name"
    r = client.post("/api/configs", json={"name": "x"})
    assert r.json()["errors"][0]["path"] == "train_config"


def test_prompt_library_must_be_strings(client):
    r = client.post("/api/configs", json={"name": "p", "train_config": train_config(),
                                          "data_backends": data_backends(), "prompt_library": {"cat": ""}})
    assert r.status_code == 422 and r.json()["errors"][0]["path"] == "prompt_library.cat"


def test_model_families_come_from_the_family_table(client):
    from simpletuner.config.families import FAMILIES

    families = client.get("/api/system/model-families").json()
    assert sorted(families) == sorted(FAMILIES)
    flux = families["flux"]
    assert flux["lora_targets"] == list(FAMILIES["flux"].lora_targets) and flux["default_lora_target"] == "all"
    assert flux["objectives"] == ["flow_matching"] and flux["guidance_embeds"] is True
    assert flux["default_weights"]["dev"] == "black-forest-labs/FLUX.1-dev" and flux["default_weights"]["tiny"] is None


def test_family_options_are_checked_against_the_family(client):
    body = {"train_config": {"model_family": "flux", "model_flavour": "tiny", "lora_target": "attention"},
            "data_backends": [{"id": "text", "dataset_type": "text_embeds", "cache_dir": "cache/text"}]}
    v = client.post("/api/configs/validate", json=body).json()
    errors = {e["path"]: e["message"] for e in v["errors"]}
    assert v["valid"] is False
    assert errors["train_config.lora_target"] == ("'attention' is not a flux LoRA preset; one of all, mmdit, context, "
                                                  "context+ffs, all+ffs, tiny, nano")
