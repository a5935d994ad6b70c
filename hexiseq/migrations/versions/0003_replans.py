"""Re-plans of `hexiseq run` launches (`runtime_replans`, `hexiseq.store.replans`): a new table,
so every row a store held stays and `schema_version` stays 2 (an older hexiseq could read the
rest; it refuses the store for its unknown revision all the same).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TABLE = "runtime_replans"


def upgrade() -> None:
    if _TABLE in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        _TABLE,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("launch_id", sa.String, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("reason", sa.String, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("old_plan_json", sa.Text, nullable=False),
        sa.Column("new_plan_json", sa.Text, nullable=False),
        sa.Column("measured_slowdowns_json", sa.Text, nullable=False),
        sa.Column("lost_ranks_json", sa.Text, nullable=False),
        sa.Column("predicted_old_step_s", sa.Float),
        sa.Column("predicted_new_step_s", sa.Float, nullable=False),
        sa.Column("planning_s", sa.Float, nullable=False),
        sa.Column("measured_before_step_s", sa.Float),
        sa.Column("measured_after_step_s", sa.Float),
    )
    op.create_index(f"ix_{_TABLE}_launch_id", _TABLE, ["launch_id"])


def downgrade() -> None:
    raise NotImplementedError("hexiseq stores are never downgraded; open them with this hexiseq")
