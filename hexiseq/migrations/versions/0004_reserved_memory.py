"""Runtime measurements record the CUDA caching allocator's reserved peak and the device memory
used outside it (CUDA context, library workspaces, communication buffers), so that the memory
model's reserve term can be checked against what a GPU really held; and byte counts become
64-bit integers (PostgreSQL's INTEGER stops at 2 GiB, below any GPU peak; SQLite's INTEGER
is 64-bit already). `schema_version` stays 2: the new columns are nullable and every row a
store held stays.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TABLE = "runtime_measurements"
_NEW = ("reserved_peak_bytes", "outside_allocator_bytes")


def upgrade() -> None:
    bind = op.get_bind()
    present = {column["name"] for column in sa.inspect(bind).get_columns(_TABLE)}
    with op.batch_alter_table(_TABLE, recreate="always" if _is_sqlite(bind) else "auto") as batch:
        batch.alter_column(
            "peak_memory_bytes", type_=sa.BigInteger, existing_type=sa.Integer, nullable=False
        )
        for name in _NEW:
            if name not in present:
                batch.add_column(sa.Column(name, sa.BigInteger))


def _is_sqlite(bind) -> bool:
    return bind.dialect.name == "sqlite"


def downgrade() -> None:
    raise NotImplementedError("hexiseq stores are never downgraded; open them with this hexiseq")
