"""Alembic migrations of the server's database (SQLite and PostgreSQL alike).

``upgrade(engine)`` brings any database to the newest revision: an empty one is created from the first revision
on, and a SQLite file written before migrations existed (its tables there, no ``alembic_version``) is taken as it
is: the first revision only creates what such a file lacks, then the later ones run. Every schema change is a new
file in ``versions/`` (``tests/server/test_migrations.py`` checks that the revisions add up to the tables in
``db.py``).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

HERE = Path(__file__).resolve().parent


def config(connection=None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(config()).get_current_head()


def current(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run every migration not yet applied, in one transaction per revision."""
    from alembic import command

    with engine.begin() as conn:
        command.upgrade(config(conn), revision)
