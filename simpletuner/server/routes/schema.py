"""JSON schemas the web UI builds its forms from: the train config and the two data backend kinds."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..schemas import ERRORS

router = APIRouter(prefix="/api/schema", tags=["schema"], responses=ERRORS)

# The order and labels of the train config's field groups (each field names its group in the schema).
GROUPS = [
    ("model", "Model"),
    ("training", "Training"),
    ("lora", "LoRA"),
    ("memory", "Memory (quantization, offload)"),
    ("tread", "TREAD"),
    ("validation", "Validation"),
    ("logging", "Logging"),
    ("data", "Data"),
]


@router.get("/train-config", response_model=dict[str, Any], summary="TrainConfig's JSON schema and field groups")
def train_config_schema() -> dict[str, Any]:
    from simpletuner.config import TrainConfig

    from simpletuner.config.families import all_flavours, all_lora_targets, family_names

    schema = TrainConfig.model_json_schema()
    # the choices come from the family table as it is now (a family added at run time shows up too)
    props = schema["properties"]
    props["model_family"]["enum"] = family_names()
    props["model_flavour"]["enum"] = all_flavours()
    props["lora_target"]["enum"] = all_lora_targets()
    known = {g for g, _ in GROUPS}
    extra = sorted({p.get("group") for p in schema["properties"].values() if p.get("group") not in known} - {None})
    groups = [{"id": g, "label": label} for g, label in GROUPS] + [{"id": g, "label": g.title()} for g in extra]
    return {"schema": schema, "groups": groups}


@router.get("/data-backends", response_model=dict[str, Any],
            summary="JSON schemas of a dataset entry and of the text-embeds entry of multidatabackend.json")
def data_backends_schema() -> dict[str, Any]:
    from simpletuner.config.data import DatasetBackend, TextEmbedsBackend

    return {"dataset": DatasetBackend.model_json_schema(), "text_embeds": TextEmbedsBackend.model_json_schema()}
