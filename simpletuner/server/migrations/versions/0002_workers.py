"""Workers on other machines: worker tokens, registered workers with their leases, and the per-machine
assignments of a job (one per machine rank); jobs learn how many machines they span and where rank 0 listens.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "worker_tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_worker_tokens_token_hash", "worker_tokens", ["token_hash"], unique=True)
    op.create_table(
        "workers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("worker_tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("address", sa.String(200), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("reserved", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
        sa.Column("info", sa.JSON(), nullable=True),
    )
    op.create_index("ix_workers_status", "workers", ["status"])
    op.create_table(
        "job_assignments",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("machine_rank", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(64), sa.ForeignKey("workers.id", ondelete="CASCADE"), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("cost", sa.Integer(), nullable=False),
        sa.Column("devices", sa.String(200), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("assigned_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.UniqueConstraint("job_id", "attempt", "machine_rank", name="uq_assignment_rank"),
    )
    op.create_index("ix_job_assignments_worker_status", "job_assignments", ["worker_id", "status"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("num_machines", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("main_process_ip", sa.String(200), nullable=True))
        batch.add_column(sa.Column("main_process_port", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("main_process_port")
        batch.drop_column("main_process_ip")
        batch.drop_column("num_machines")
    op.drop_table("job_assignments")
    op.drop_table("workers")
    op.drop_table("worker_tokens")
