"""Fixtures for the evaluation tests: a tiny Flux adapter and transformer, a recording reporter, a CPU accelerator."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.helpers import flux_config


class RecordingReporter:
    """Stands in for WebhookReporter: records image and scores events."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: list[tuple] = []

    def image(self, kind, step, path, prompt=None, nickname=None, resolution=None, inference_step=None):
        self.events.append(("image", kind, step, Path(path), nickname, inference_step))

    def scores(self, step, metrics):
        self.events.append(("scores", step, dict(metrics)))


class CpuAccelerator:
    """The few Accelerator members the evaluator uses, for one CPU process."""

    is_main_process = True
    device = torch.device("cpu")

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self):
        pass

    def autocast(self):
        return contextlib.nullcontext()


@pytest.fixture(scope="session")
def tiny_adapter(tiny_flux_path):
    from simpletuner.models.flux import FluxAdapter

    return FluxAdapter(flux_config())


@pytest.fixture(scope="session")
def tiny_transformer(tiny_adapter):
    transformer = tiny_adapter.load_transformer()
    transformer.requires_grad_(False)
    return transformer


@pytest.fixture
def make_setup(tmp_path):
    """(config, backends) for a run in tmp_path with an eval dataset of two sample images."""

    def make(*, eval_dataset: bool = True, **overrides):
        from simpletuner.config import load_data_backends

        dataset = tmp_path / "sample"
        if not dataset.exists():
            shutil.copytree(REPO / "datasets" / "sample", dataset)
            (tmp_path / "eval").mkdir()
            for name in ("00_orange_circle", "01_red_square"):
                for ext in (".png", ".txt"):
                    shutil.copy(dataset / f"{name}{ext}", tmp_path / "eval" / f"{name}{ext}")
        values = {"output_dir": str(tmp_path / "output"), "validation_resolution": "32",
                  "validation_num_inference_steps": 2, **overrides}
        config = flux_config(**values)
        backends = [{"id": "sample", "instance_data_dir": str(dataset), "caption_strategy": "textfile",
                     "resolution": 32, "resolution_type": "pixel", "cache_dir_vae": str(tmp_path / "cache/vae")},
                    {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "cache/text")}]
        if eval_dataset:
            backends.insert(1, {"id": "held-out", "dataset_type": "eval", "instance_data_dir": str(tmp_path / "eval"),
                                "caption_strategy": "textfile", "resolution": 32, "resolution_type": "pixel",
                                "cache_dir_vae": str(tmp_path / "cache/vae-eval")})
        (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))
        return config, load_data_backends(backends, config=config)

    return make
