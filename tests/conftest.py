"""Shared fixtures: one tiny-checkpoint folder per test session (shared with subprocesses via the env), a tiny
Flux adapter and transformer, and a run setup with an eval dataset."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
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


# A test that takes longer than this (setup + call + teardown, seconds) is named as it finishes, with the time since
# the session started: a run stopped from outside (CI's time limit) still shows where its time went, which pytest's
# --durations (printed at the very end) cannot.
SLOW_TEST_S = float(os.environ.get("SIMPLETUNER_TEST_SLOW_S", "60"))
_SESSION: dict = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):  # only the controller writes (a worker's output is hidden)
        return
    _SESSION.update(start=time.monotonic(), config=session.config, spent={})
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        # CI's time limit is for a healthy machine: this line tells a slow machine from a slow suite
        reporter.write_line(f"memory: {_page_touch_us():.1f} us to first touch a 4 KiB page (1-2 us is usual; tens "
                            "of us mean imports and every memory-bound test run tens of times slower)")


def _page_touch_us(size: int = 64 << 20) -> float:
    """Microseconds to fault in and write one fresh page of anonymous memory, over ``size`` bytes."""
    import mmap

    block = mmap.mmap(-1, size)
    start = time.perf_counter()
    for offset in range(0, size, 4096):
        block[offset] = 1
    took = time.perf_counter() - start
    block.close()
    return took / (size // 4096) * 1e6


def pytest_runtest_logreport(report):
    config = _SESSION.get("config")
    if config is None:  # a worker (see pytest_sessionstart)
        return
    spent = _SESSION["spent"]
    spent[report.nodeid] = spent.get(report.nodeid, 0.0) + report.duration
    if report.when != "teardown":
        return
    took = spent.pop(report.nodeid)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if took >= SLOW_TEST_S and reporter is not None:
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
        elapsed = time.monotonic() - _SESSION["start"]
        reporter.write_line(f"slow: {took:.0f}s {report.nodeid} {worker} (at {elapsed:.0f}s)")


# How `--dist loadfile` (test.sh) hands work to the two workers. A file is one unit, so its module fixtures run
# once, except the family e2e files, whose cases share nothing and each take minutes: one unit a case, so both
# workers share them. Units run slowest kind first (end-to-end, then browser, then the rest), since a unit never
# moves to the other worker once sent: xdist's own order (most tests first) left the few-test e2e files for last,
# and one worker ran the family file (about 2 000 s on a slow machine) while the other had nothing left to do.
EACH_CASE_A_UNIT = ("tests/e2e/test_families_e2e.py", "tests/e2e/test_video_families_e2e.py")
SLOWEST_FIRST = ("tests/e2e/", "tests/browser/")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest -p no:xdist (scripts/mutation.sh) must still run
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadFileScheduling

    class SlowestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in EACH_CASE_A_UNIT else path

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda scope: next(  # the first unit of the slowest kind left
                (i for i, prefix in enumerate(SLOWEST_FIRST) if scope.startswith(prefix)), len(SLOWEST_FIRST)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return SlowestFirst(config, log)


# The end-to-end and browser tests start processes that import torch, diffusers and transformers (minutes each on a
# slow machine) and train: their hang guard is longer than the suite's 900 s (pyproject), unless a file sets its own
E2E_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None and (item.get_closest_marker("e2e") or
                                                           item.get_closest_marker("browser")):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


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
