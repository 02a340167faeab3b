"""Shared builders for config tests: a SimpleTuner-style config.json and a multidatabackend.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def simpletuner_config(**extra) -> dict:
    """A config.json as SimpleTuner users write it: --keys, string values, TRAINER_EXTRA_ARGS."""
    config = {
        "--model_family": "flux",
        "--model_flavour": "dev",
        "--model_type": "lora",
        "--pretrained_model_name_or_path": "black-forest-labs/FLUX.1-dev",
        "--output_dir": "output/models",
        "--learning_rate": "1e-4",
        "--max_train_steps": "1000",
        "--num_train_epochs": "0",
        "--lr_scheduler": "constant_with_warmup",
        "--lr_warmup_steps": "100",
        "--train_batch_size": "1",
        "--gradient_checkpointing": "true",
        "--mixed_precision": "bf16",
        "--base_model_precision": "int8-quanto",
        "--lora_rank": "16",
        "--flux_lora_target": "all",
        "--seed": "42",
        "--checkpointing_steps": "250",
        "--checkpoints_total_limit": "5",
        "--resume_from_checkpoint": "latest",
        "--validation_steps": "250",
        "--validation_prompt": "a photo of a cat",
        "--validation_resolution": "1024x1024,1280x768",
        "--validation_guidance": "3.5",
        "--report_to": "none",
        "--data_backend_config": "config/multidatabackend.json",
        "--flux_schedule_shift": "1",
        "TRAINER_EXTRA_ARGS": "--lora_alpha=16 --validation_on_startup --vae_batch_size 8",
    }
    config.update(extra)
    return config


def data_backends(folder: str = "datasets/pics", **extra) -> list:
    dataset = {
        "id": "pics",
        "type": "local",
        "instance_data_dir": folder,
        "caption_strategy": "textfile",
        "resolution": 1024,
        "resolution_type": "pixel_area",
        "crop": "false",
        "repeats": "2",
    }
    dataset.update(extra)
    return [
        dataset,
        {"id": "text-embeds", "dataset_type": "text_embeds", "type": "local", "default": True},
    ]


@pytest.fixture
def make_config():
    """``make_config(**extra)``: a SimpleTuner-style config.json dict."""
    return simpletuner_config


@pytest.fixture
def make_backends():
    """``make_backends(folder, **dataset_keys)``: a multidatabackend.json list (one dataset + text embeds)."""
    return data_backends


@pytest.fixture
def write_json(tmp_path: Path):
    def write(name: str, content) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2))
        return path

    return write
