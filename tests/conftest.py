"""Shared fixtures: one tiny-checkpoint folder per test session (shared with subprocesses via the env), a tiny
Flux adapter and transformer, and a run setup with an eval dataset."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Two xdist workers and the trainers they start share two cores: one intra-op thread per process, or torch's
# OpenMP threads oversubscribe the cores (set before anything imports torch; subprocesses inherit it)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers import flux_config, left_unchanged  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


_OWN_TINY_DIR: list[str] = []


def pytest_configure(config):
    """Tiny checkpoints are written once per session into one folder, set in the environment before any test module
    is imported, so every subprocess (even one whose env a module built at import) shares it."""
    if hasattr(config, "workerinput") and os.environ.get("SIMPLETUNER_TINY_DIR"):
        return  # a pytest-xdist worker shares its controller's folder (checkpoints appear there atomically)
    if not os.environ.get("SIMPLETUNER_TEST_TINY_DIR"):
        _OWN_TINY_DIR.append(tempfile.mkdtemp(prefix="simpletuner-tiny-"))
    os.environ["SIMPLETUNER_TINY_DIR"] = os.environ.get("SIMPLETUNER_TEST_TINY_DIR") or _OWN_TINY_DIR[0]


def pytest_unconfigure(config):
    for folder in _OWN_TINY_DIR:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def tiny_dir():
    """The session's tiny-checkpoint folder (see pytest_configure)."""
    return Path(os.environ["SIMPLETUNER_TINY_DIR"])


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_dir) -> Path:
    from simpletuner.models.flux import FluxAdapter

    return FluxAdapter(flux_config()).ensure_tiny_checkpoint()


@pytest.fixture
def sample_dataset(tmp_path) -> Path:
    """A private copy of the shipped sample dataset (tests may modify it)."""
    target = tmp_path / "sample"
    shutil.copytree(REPO / "datasets" / "sample", target)
    return target


@pytest.fixture(scope="session")
def tiny_adapter(tiny_flux_path):
    from simpletuner.models.flux import FluxAdapter

    adapter = FluxAdapter(flux_config())
    with left_unchanged(adapter=adapter, what="the session's tiny_adapter"):
        yield adapter


@pytest.fixture(scope="session")
def tiny_transformer(tiny_adapter):
    transformer = tiny_adapter.load_transformer()
    transformer.requires_grad_(False)
    with left_unchanged(model=transformer, what="the session's tiny_transformer"):
        yield transformer


@pytest.fixture
def make_setup(tmp_path):
    """(config, backends) for a run in tmp_path with an eval dataset of two sample images."""
    from tests.helpers import sample_run

    return lambda **overrides: sample_run(tmp_path, **overrides)
