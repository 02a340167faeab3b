"""JSON schemas the web UI builds its forms from: the train config and the two data backend kinds."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..schemas import ERRORS

router = APIRouter(prefix="/api/schema", tags=["schema"], responses=ERRORS)


@router.get("/train-config", response_model=dict[str, Any], summary="TrainConfig's JSON schema and field groups")
def train_config_schema() -> dict[str, Any]:
    from simpletuner.config import TrainConfig
    from simpletuner.config.families import all_flavours, all_lora_targets, family_names
    from simpletuner.config.labels import BASIC_TRAIN, TRAIN_LABELS, label_schema
    from simpletuner.config.train import GROUPS

    schema = label_schema(TrainConfig.model_json_schema(), TRAIN_LABELS, BASIC_TRAIN)
    # the choices come from the family table as it is now (a family added at run time shows up too)
    props = schema["properties"]
    props["model_family"]["enum"] = family_names()
    props["model_flavour"]["enum"] = all_flavours()
    props["lora_target"]["enum"] = all_lora_targets()
    return {"schema": schema, "groups": [{"id": g, "label": label} for g, label in GROUPS.items()]}


@router.get("/data-backends", response_model=dict[str, Any],
            summary="JSON schemas of a dataset entry and of the text-embeds entry of multidatabackend.json")
def data_backends_schema() -> dict[str, Any]:
    from simpletuner.config.data import DatasetBackend, TextEmbedsBackend
    from simpletuner.config.labels import BASIC_DATASET, DATASET_LABELS, label_schema

    return {"dataset": label_schema(DatasetBackend.model_json_schema(), DATASET_LABELS, BASIC_DATASET),
            "text_embeds": label_schema(TextEmbedsBackend.model_json_schema(), DATASET_LABELS, BASIC_DATASET)}
