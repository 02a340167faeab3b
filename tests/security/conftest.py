"""A sandbox for path-escape tests: the allowed roots (a working dir and a data dir) beside an ``outside`` folder
that nothing may touch, with a symlink from inside to outside."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from tests.server.helpers import LOOPBACK, PNG, make_settings


@dataclass
class Sandbox:
    tmp: Path
    work: Path  # allowed root, the server's working dir
    data: Path  # allowed root, the server's data dir
    outside: Path

    def outside_files(self) -> set[str]:
        """Every file and folder under tmp that is not inside an allowed root."""
        found = set()
        for dirpath, dirnames, filenames in os.walk(self.tmp):
            here = Path(dirpath)
            if here in (self.work, self.data):
                dirnames.clear()
                continue
            found.update(str(here / n) for n in dirnames + filenames if here / n not in (self.work, self.data))
        return found


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    work, data, outside = tmp_path / "work", tmp_path / "data", tmp_path / "outside"
    (work / "imgs").mkdir(parents=True)
    for i in range(2):
        (work / "imgs" / f"{i}.png").write_bytes(PNG)
        (work / "imgs" / f"{i}.txt").write_text("a cat")
    data.mkdir()
    (outside / "x").mkdir(parents=True)
    (outside / "secret.json").write_text('{"secret": "do-not-leak"}')
    (work / "link").symlink_to(outside)
    return Sandbox(tmp_path, work, data, outside)


@pytest.fixture
def api(sandbox):
    """The server in-process (scheduler off: submitted jobs stay queued), from loopback."""
    app = create_app(make_settings(sandbox.tmp, sandbox.work, data_dir=sandbox.data, run_scheduler=False))
    with TestClient(app, client=LOOPBACK, base_url="http://127.0.0.1") as c:
        yield c
