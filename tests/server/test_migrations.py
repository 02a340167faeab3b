"""Alembic migrations: they build exactly the tables of db.py on SQLite and PostgreSQL, and a SQLite file written
before migrations existed is taken over with its rows."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine, inspect

from simpletuner.server import migrations
from simpletuner.server.db import Base, Database, JobRow


def _drift(engine) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from simpletuner.server import workers  # noqa: F401 (its tables)

    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


@pytest.fixture(scope="module")
def postgres_url():
    pytest.importorskip("psycopg", reason="the psycopg driver is part of the test extras")
    from tests.server.postgres import running_postgres

    with running_postgres() as url:
        yield url


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_migrations_build_the_models_tables(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    engine = create_engine(url)
    if backend == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    migrations.upgrade(engine)
    assert migrations.current(engine) == migrations.head() == "0004"
    assert _drift(engine) == []  # a model change without a revision fails here
    migrations.upgrade(engine)  # idempotent
    engine.dispose()


def test_a_sqlite_file_from_before_migrations_keeps_loading(tmp_path):
    """The schema of the first release, written by its create_all (no alembic_version, no columns added since)."""
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE configs (id INTEGER NOT NULL, name VARCHAR(200) NOT NULL, description TEXT NOT NULL,
            current_version INTEGER NOT NULL, created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, PRIMARY KEY (id));
        CREATE UNIQUE INDEX ix_configs_name ON configs (name);
        CREATE TABLE jobs (id INTEGER NOT NULL, name VARCHAR(200) NOT NULL, status VARCHAR(16) NOT NULL,
            priority INTEGER NOT NULL, config_name VARCHAR(200), config_version INTEGER, train_config JSON NOT NULL,
            data_backends JSON NOT NULL, prompt_library JSON, num_processes INTEGER NOT NULL,
            retry_on_restart BOOLEAN NOT NULL, submitted_at FLOAT NOT NULL, started_at FLOAT, finished_at FLOAT,
            attempt INTEGER NOT NULL, run_dir TEXT, owner VARCHAR(200), owner_host VARCHAR(200), owner_pid INTEGER,
            heartbeat_at FLOAT, pid INTEGER, pgid INTEGER, devices VARCHAR(200), webhook_secret VARCHAR(100),
            cancel_requested BOOLEAN NOT NULL, exit_code INTEGER, reason TEXT, error TEXT, log_tail TEXT,
            progress JSON, results JSON, PRIMARY KEY (id));
        CREATE INDEX ix_jobs_status ON jobs (status);
        CREATE INDEX ix_jobs_status_priority ON jobs (status, priority, id);
        INSERT INTO jobs (name, status, priority, train_config, data_backends, num_processes, retry_on_restart,
            submitted_at, attempt, cancel_requested)
            VALUES ('old', 'succeeded', 0, '{"seed": 1}', '[]', 1, 0, 1.0, 1, 0);
    """)
    con.close()
    db = Database(f"sqlite:///{path}")
    db.create_all()
    assert migrations.current(db.engine) == migrations.head()
    with db.session() as s:
        job = s.get(JobRow, 1)
    assert (job.name, job.status, job.train_config, job.retries, job.max_retries, job.num_machines) == \
        ("old", "succeeded", {"seed": 1}, 0, 0, 1)
    tables = set(inspect(db.engine).get_table_names())
    assert {"config_versions", "job_events", "workers", "worker_tokens", "job_assignments"} <= tables
    assert _drift(db.engine) == []
    db.dispose()
