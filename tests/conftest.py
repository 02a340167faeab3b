"""Shared fixtures: one tiny-checkpoint folder per test session, shared with subprocesses via the env."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def tiny_dir(tmp_path_factory):
    """Tiny checkpoints are written once per session here (and inherited by subprocesses)."""
    folder = os.environ.get("SIMPLETUNER_TEST_TINY_DIR") or str(tmp_path_factory.mktemp("tiny"))
    os.environ["SIMPLETUNER_TINY_DIR"] = folder
    yield Path(folder)


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_dir) -> Path:
    from simpletuner.models.flux import FluxAdapter
    from tests.helpers import flux_config

    return FluxAdapter(flux_config()).ensure_tiny_checkpoint()


@pytest.fixture
def sample_dataset(tmp_path) -> Path:
    """A private copy of the shipped sample dataset (tests may modify it)."""
    target = tmp_path / "sample"
    shutil.copytree(REPO / "datasets" / "sample", target)
    return target
