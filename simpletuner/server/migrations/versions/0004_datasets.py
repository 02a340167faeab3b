"""The web UI's datasets: a folder of uploads under the data dir, or a folder the user allowed (inside the
server's allowed roots).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("uploaded", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_datasets_name", "datasets", ["name"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_datasets_name", table_name="datasets")
    op.drop_table("datasets")
