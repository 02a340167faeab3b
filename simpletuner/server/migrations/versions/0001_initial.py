"""The schema as it was before migrations: configs, config versions, jobs, job events.

A SQLite file from before migrations already has these tables, with or without the job columns added later
(``max_retries``, ``retries``, ``start_over``): this revision creates only what is missing, so such a file is
taken over as it is.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _jobs_columns() -> list[sa.Column]:
    return [
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("config_name", sa.String(200), nullable=True),
        sa.Column("config_version", sa.Integer(), nullable=True),
        sa.Column("train_config", sa.JSON(), nullable=False),
        sa.Column("data_backends", sa.JSON(), nullable=False),
        sa.Column("prompt_library", sa.JSON(), nullable=True),
        sa.Column("num_processes", sa.Integer(), nullable=False),
        sa.Column("retry_on_restart", sa.Boolean(), nullable=False),
        sa.Column("max_retries", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("retries", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("start_over", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("submitted_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=True),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("owner_host", sa.String(200), nullable=True),
        sa.Column("owner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pgid", sa.Integer(), nullable=True),
        sa.Column("devices", sa.String(200), nullable=True),
        sa.Column("webhook_secret", sa.String(100), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("log_tail", sa.Text(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("results", sa.JSON(), nullable=True),
    ]


def upgrade() -> None:
    have = set(sa.inspect(op.get_bind()).get_table_names())
    if "configs" not in have:
        op.create_table(
            "configs",
            sa.Column("id", sa.Integer(), primary_key=True),
            sa.Column("name", sa.String(200), nullable=False),
            sa.Column("description", sa.Text(), nullable=False),
            sa.Column("current_version", sa.Integer(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("updated_at", sa.Float(), nullable=False),
        )
        op.create_index("ix_configs_name", "configs", ["name"], unique=True)
    if "config_versions" not in have:
        op.create_table(
            "config_versions",
            sa.Column("id", sa.Integer(), primary_key=True),
            sa.Column("config_id", sa.Integer(), sa.ForeignKey("configs.id", ondelete="CASCADE"), nullable=False),
            sa.Column("version", sa.Integer(), nullable=False),
            sa.Column("schema_version", sa.Integer(), nullable=True),
            sa.Column("train_config", sa.JSON(), nullable=False),
            sa.Column("data_backends", sa.JSON(), nullable=False),
            sa.Column("prompt_library", sa.JSON(), nullable=True),
            sa.Column("comment", sa.Text(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.UniqueConstraint("config_id", "version", name="uq_config_version"),
        )
        op.create_index("ix_config_versions_config_id", "config_versions", ["config_id"])
    if "jobs" not in have:
        op.create_table("jobs", *_jobs_columns())
        op.create_index("ix_jobs_status", "jobs", ["status"])
        op.create_index("ix_jobs_status_priority", "jobs", ["status", "priority", "id"])
    else:  # a file from before migrations: add the columns later versions added
        present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("jobs")}
        for column in _jobs_columns():
            if column.name not in present:
                op.add_column("jobs", column)
    if "job_events" not in have:
        op.create_table(
            "job_events",
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("source", sa.String(16), nullable=False),
            sa.Column("seq", sa.Integer(), nullable=False),
            sa.Column("type", sa.String(32), nullable=False),
            sa.Column("time", sa.Float(), nullable=False),
            sa.Column("data", sa.JSON(), nullable=False),
            sa.Column("received_at", sa.Float(), nullable=False),
            sa.UniqueConstraint("job_id", "attempt", "source", "seq", name="uq_job_event_seq"),
        )
        op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"])


def downgrade() -> None:
    for table in ("job_events", "jobs", "config_versions", "configs"):
        op.drop_table(table)
