"""SQL tables (configs, config versions, jobs, job events, datasets) and session helpers (SQLAlchemy 2)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import (
    JSON,
    inspect,
    false,
    text,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

logger = logging.getLogger("simpletuner.server.db")

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")


class DatabaseDamaged(ValueError):
    """The database file fails its integrity check."""


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class ConfigRow(Base):
    """A named config; its contents live in versions (the newest is ``current_version``)."""

    __tablename__ = "configs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True, index=True)
    description: Mapped[str] = mapped_column(Text, default="")
    current_version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    updated_at: Mapped[float] = mapped_column(Float, default=now)


class ConfigVersionRow(Base):
    __tablename__ = "config_versions"
    __table_args__ = (UniqueConstraint("config_id", "version", name="uq_config_version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    config_id: Mapped[int] = mapped_column(ForeignKey("configs.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    schema_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    train_config: Mapped[dict] = mapped_column(JSON)
    data_backends: Mapped[list] = mapped_column(JSON)
    prompt_library: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    comment: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float, default=now)


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_priority", "status", "priority", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    config_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    config_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # What the job trains on, frozen at submission (a later config edit does not change it).
    train_config: Mapped[dict] = mapped_column(JSON)
    data_backends: Mapped[list] = mapped_column(JSON)
    prompt_library: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    num_processes: Mapped[int] = mapped_column(Integer, default=1)  # over all machines, as accelerate counts
    # A job on several machines runs on that many workers at once (gang-scheduled, one machine rank each);
    # rank 0's rendezvous address is set when the gang is formed.
    num_machines: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    main_process_ip: Mapped[str | None] = mapped_column(String(200), nullable=True)
    main_process_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    retry_on_restart: Mapped[bool] = mapped_column(Boolean, default=False)
    # Automatic retries after a trainer crash (each resumes from the newest checkpoint), and how many were used.
    max_retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The next attempt starts over (the previous output is kept aside) instead of resuming.
    start_over: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    submitted_at: Mapped[float] = mapped_column(Float, default=now)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    run_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Process bookkeeping for the server that owns a running job.
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    owner_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    owner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pgid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    devices: Mapped[str | None] = mapped_column(String(200), nullable=True)
    webhook_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it failed / was cancelled
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # trainer-reported error message
    log_tail: Mapped[str | None] = mapped_column(Text, nullable=True)
    progress: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    results: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Split training: a "cache" job runs stage 1 (`simpletuner cache`); a "train" job may wait for one (depends_on)
    kind: Mapped[str] = mapped_column(String(16), default="train", server_default=text("'train'"))
    depends_on: Mapped[int | None] = mapped_column(Integer, nullable=True)


JOB_KINDS = ("train", "cache")


class JobEventRow(Base):
    """One event of a job; ``id`` is global and monotonic, so it doubles as the SSE event id."""

    __tablename__ = "job_events"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "source", "seq", name="uq_job_event_seq"),
        Index("ix_job_events_job_id_id", "job_id", "id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    source: Mapped[str] = mapped_column(String(16))  # "trainer" (webhook) or "server" (lifecycle)
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    time: Mapped[float] = mapped_column(Float)
    data: Mapped[dict] = mapped_column(JSON)
    received_at: Mapped[float] = mapped_column(Float, default=now)


class DatasetRow(Base):
    """A dataset the web UI shows: a folder of uploads under the data dir, or a folder the user allowed (inside
    the server's allowed roots)."""

    __tablename__ = "datasets"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True, index=True)
    path: Mapped[str] = mapped_column(Text)
    uploaded: Mapped[bool] = mapped_column(Boolean, default=True)  # False: the user's own folder, added by path
    created_at: Mapped[float] = mapped_column(Float, default=now)


class Database:
    """Engine + two session factories: plain (reads) and write (``BEGIN IMMEDIATE`` on SQLite)."""

    def __init__(self, url: str, busy_timeout: float = 30.0):
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": busy_timeout}
        self.engine: Engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            _configure_sqlite(self.engine, busy_timeout)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False)

    def create_all(self) -> None:
        """Bring the database to the newest schema with the Alembic migrations (a database is never rebuilt; a
        SQLite file from before migrations is taken over as it is). Tables or columns a model declares that no
        migration creates yet are added too, with a warning naming them."""
        from . import migrations, workers  # noqa: F401 (workers: its tables join Base.metadata)

        migrations.upgrade(self.engine)
        before = {t: {c["name"] for c in inspect(self.engine).get_columns(t)}
                  for t in inspect(self.engine).get_table_names()}
        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        after = {t: {c["name"] for c in inspect(self.engine).get_columns(t)}
                 for t in inspect(self.engine).get_table_names()}
        drift = sorted({f"{t}.{c}" for t, cols in after.items() for c in cols - before.get(t, set())})
        if drift:
            logger.warning("schema: %s created outside the migrations; add a revision under "
                           "simpletuner/server/migrations/versions", ", ".join(drift))

    def _add_missing_columns(self) -> None:
        inspector = inspect(self.engine)
        with self.engine.begin() as conn:
            for table in Base.metadata.sorted_tables:
                have = {c["name"] for c in inspector.get_columns(table.name)}
                for column in table.columns:
                    if column.name in have:
                        continue
                    kind = column.type.compile(dialect=self.engine.dialect)
                    default = column.server_default.arg if column.server_default is not None else None
                    if default is not None and not isinstance(default, str):
                        default = default.compile(dialect=self.engine.dialect)
                    clause = f" NOT NULL DEFAULT {default}" if default is not None else ""
                    conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}{clause}"))

    def check_integrity(self) -> None:
        """DatabaseDamaged naming the file when SQLite's quick_check finds a damaged page (start-up)."""
        if not self.is_sqlite:
            return
        try:
            with self.engine.connect() as conn:
                rows = [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]
        except DBAPIError as exc:
            rows = [str(exc.orig)]
        if rows != ["ok"]:
            raise DatabaseDamaged(
                f"database {self.engine.url.database} is damaged ({'; '.join(rows[:3])}). Restore it from a backup, "
                "or recover what is readable: sqlite3 OLD.db .recover | sqlite3 NEW.db")

    @contextmanager
    def session(self, write: bool = False) -> Iterator[Session]:
        """A session committed on success, rolled back on error. Use ``write=True`` for anything that
        writes: on SQLite it takes the write lock up front, so a read-then-write transaction never fails
        with "database is locked" halfway through."""
        factory = self._write if write else self._read
        with factory() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()

    def probe(self) -> None:
        """Read a little of every table (raises the driver's error when the database is unusable)."""
        with self.engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                conn.execute(text(f"SELECT count(*) FROM {table.name}")).scalar()


def _configure_sqlite(engine: Engine, busy_timeout: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised by every test
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # pragma: no cover
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")
