"""Alembic's entry point: migrations run on the connection ``upgrade`` hands over (never a URL from a file)."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through simpletuner.server.migrations.upgrade(engine)")
context.configure(connection=connection, target_metadata=None, render_as_batch=True,
                  transaction_per_migration=True)
with context.begin_transaction():
    context.run_migrations()
