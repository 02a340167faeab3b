"""A throwaway PostgreSQL server for tests: Debian's postgresql package (installed with apt when missing and
running as root), a fresh cluster in a temp folder, trust auth on a free loopback port."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import free_port


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def ensure_postgres() -> Path | None:
    """The folder holding initdb/pg_ctl, installing Debian's postgresql first if we may; None if unavailable."""
    if _pg_bin() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"]
        if subprocess.run(install, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            subprocess.run(install, capture_output=True)
    return _pg_bin()


@contextmanager
def running_postgres() -> Iterator[str]:
    """Start a cluster; yields a SQLAlchemy URL; stops and deletes it afterwards."""
    bin_dir = ensure_postgres()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed and cannot be installed here (needs root and apt-get)")
    root = Path(tempfile.mkdtemp(prefix="simpletuner-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as the package's postgres user
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()
    try:
        subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "simpletuner"],
                       check=True, capture_output=True)
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-w", "-l",
                        str(root / "log"), "start"], check=True, capture_output=True)
        try:
            yield f"postgresql+psycopg://simpletuner@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
