"""Runtime runs record their status: running, finished, or failed and why (schema version 2).

`status` is "running" when a run starts and "finished" or "failed" when it ends; `failure` says
why a run failed, `finished_at` when it ended, and `launch_id` ties the run to the `hexiseq run`
that launched it, so that the launcher can mark it failed when its ranks died unrecorded.
Runs from before: "finished" where every planned step was measured, else "unknown" (nothing
recorded then says whether they failed or were cut short).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 2


def upgrade() -> None:
    op.add_column(
        "runtime_runs",
        sa.Column("status", sa.String, nullable=False, server_default="unknown"),
    )
    op.add_column("runtime_runs", sa.Column("failure", sa.Text))
    op.add_column("runtime_runs", sa.Column("finished_at", sa.DateTime(timezone=True)))
    op.add_column("runtime_runs", sa.Column("launch_id", sa.String))
    op.execute(
        "UPDATE runtime_runs SET status = 'finished' WHERE steps <= ("
        "SELECT COUNT(DISTINCT step) FROM runtime_measurements "
        "WHERE runtime_measurements.run_id = runtime_runs.id)"
    )
    meta = sa.table("store_meta", sa.column("key", sa.String), sa.column("value", sa.String))
    op.execute(
        meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
    )


def downgrade() -> None:
    raise NotImplementedError("hexiseq stores are never downgraded; open them with this hexiseq")
