"""Split training on the server: a job's kind ("train", or "cache" for stage 1) and the cache job a train job
waits for (``depends_on``).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="train"))
        batch.add_column(sa.Column("depends_on", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("depends_on")
        batch.drop_column("kind")
