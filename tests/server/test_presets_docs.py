"""Presets over the API (every one a valid config, filled with a chosen dataset) and the API docs page served
with no internet (Swagger UI's files from the package, nothing from another host)."""

from __future__ import annotations

import re

from simpletuner.config import family_names, load_data_backends, load_train_config
from simpletuner.config.presets import presets
from simpletuner.config.scan import setting_problems


def test_every_preset_is_a_valid_config_with_nothing_that_does_nothing():
    ids = [p.id for p in presets()]
    assert ids[:4] == ["tiny-cpu-demo", "flux-lora-24gb", "flux-lora-16gb", "flux-lora-12gb"]
    assert {f"{name}-lora" for name in family_names()} <= set(ids)  # one per family of the table
    for preset in presets():
        loaded = load_train_config(preset.train_config)
        backends = load_data_backends(preset.data_backends(), config=loaded.config)
        assert loaded.warnings == [] and backends.warnings == [], preset.id
        assert setting_problems(loaded.config, backends) == ([], []), preset.id
    memory = {p.id: p.train_config for p in presets()}
    assert memory["flux-lora-24gb"]["base_model_precision"] == "int8-quanto"
    assert memory["flux-lora-12gb"]["base_model_precision"] == "int4-quanto"


def test_presets_route_fills_in_a_dataset(client, workdir):
    assert client.post("/api/datasets", json={"name": "mine", "path": "imgs"}).status_code == 201
    listed = client.get("/api/presets", params={"dataset": "mine"}).json()
    tiny = next(p for p in listed if p["id"] == "tiny-cpu-demo")
    assert tiny["data_backends"][0]["instance_data_dir"] == str(workdir / "imgs")
    assert tiny["data_backends"][0]["id"] == "mine"
    r = client.post("/api/configs/validate", json={"train_config": tiny["train_config"],
                                                   "data_backends": tiny["data_backends"]})
    assert r.json()["valid"], r.json()
    assert client.get("/api/presets", params={"dataset": "nope"}).status_code == 404


def test_api_docs_need_no_internet(client):
    page = client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    urls = re.findall(r'(?:src|href)="([^"]+)"', page.text) + re.findall(r"url: '([^']+)'", page.text)
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    for url in urls:
        assert client.get(url).status_code == 200, url
    assert client.get("/redoc").status_code == 404  # FastAPI's ReDoc page loads from a CDN: not served


def test_every_field_has_a_readable_label(client):
    """The form's labels come from simpletuner/config/labels.py, never from pydantic's title-cased keys."""
    from simpletuner.config import TrainConfig
    from simpletuner.config.data import DatasetBackend, TextEmbedsBackend
    from simpletuner.config.labels import DATASET_LABELS, TRAIN_LABELS

    assert set(TRAIN_LABELS) == set(TrainConfig.model_fields)
    assert set(DatasetBackend.model_fields) | set(TextEmbedsBackend.model_fields) <= set(DATASET_LABELS)
    schema = client.get("/api/schema/train-config").json()["schema"]["properties"]
    assert schema["max_train_steps"]["title"] == "Training steps" and schema["max_train_steps"]["basic"] is True
    assert schema["lora_dropout"]["basic"] is False
    backends = client.get("/api/schema/data-backends").json()
    assert backends["dataset"]["properties"]["instance_data_dir"]["title"] == "Folder"
