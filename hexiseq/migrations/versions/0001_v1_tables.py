"""The store's tables as schema version 1 left them (the last layout before migrations).

Stores from before migrations have no revision and run this one: it creates only the tables
they lack (version 1 grew by whole tables, e.g. `runtime_attention_kernels`), so every row they
hold stays. A new store gets every table and its `schema_version`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_NOW = sa.DateTime(timezone=True)


def _tables() -> dict[str, list[sa.SchemaItem]]:
    """Each version-1 table's columns and constraints, as that version created them."""
    return {
        "store_meta": [
            sa.Column("key", sa.String, primary_key=True),
            sa.Column("value", sa.String, nullable=False),
        ],
        "plans": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("created_at", _NOW, nullable=False),
            sa.Column("label", sa.String, nullable=False),
            sa.Column("cluster_name", sa.String, nullable=False),
            sa.Column("model_name", sa.String, nullable=False),
            sa.Column("seq_len", sa.Integer, nullable=False),
            sa.Column("tokens_per_s", sa.Float),
            sa.Column("step_time_s", sa.Float),
            sa.Column("cost_model", sa.String, nullable=False),
            sa.Column("plan_json", sa.Text, nullable=False),
        ],
        "runtime_runs": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("created_at", _NOW, nullable=False),
            sa.Column("plan_hash", sa.String, nullable=False),
            sa.Column("plan_id", sa.Integer),
            sa.Column("plan_name", sa.String, nullable=False),
            sa.Column("model_name", sa.String, nullable=False),
            sa.Column("seq_len", sa.Integer, nullable=False),
            sa.Column("world_size", sa.Integer, nullable=False),
            sa.Column("steps", sa.Integer, nullable=False),
            sa.Column("backend", sa.String, nullable=False),
            sa.Column("device", sa.String, nullable=False),
            sa.Column("dtype", sa.String, nullable=False),
            sa.Column("emulation", sa.Boolean, nullable=False),
            sa.Column("torch_version", sa.String, nullable=False),
            sa.Column("plan_json", sa.Text, nullable=False),
        ],
        "runtime_measurements": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.Integer, sa.ForeignKey("runtime_runs.id"), nullable=False),
            sa.Column("rank", sa.Integer, nullable=False),
            sa.Column("step", sa.Integer, nullable=False),
            sa.Column("step_time_s", sa.Float, nullable=False),
            sa.Column("rank_time_s", sa.Float, nullable=False),
            sa.Column("peak_memory_bytes", sa.Integer, nullable=False),
            sa.Column("memory_measure", sa.String, nullable=False),
            sa.Column("device", sa.String, nullable=False),
            sa.Column("loss", sa.Float, nullable=False),
            sa.Column("emulation_slowdown", sa.Float, nullable=False),
            sa.Column("emulation_label", sa.String, nullable=False),
        ],
        "runtime_attention_kernels": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.Integer, sa.ForeignKey("runtime_runs.id"), nullable=False),
            sa.Column("rank", sa.Integer, nullable=False),
            sa.Column("step", sa.Integer, nullable=False),
            sa.Column("attention_kernels", sa.String, nullable=False),
        ],
        "profile_runs": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("started_at", _NOW, nullable=False),
            sa.Column("kind", sa.String, nullable=False),
            sa.Column("device_type", sa.String, nullable=False),
            sa.Column("device_name", sa.String, nullable=False),
            sa.Column("torch_version", sa.String, nullable=False),
            sa.Column("cuda_version", sa.String),
            sa.Column("host", sa.String, nullable=False),
            sa.Column("command", sa.Text, nullable=False),
            sa.Column("grid_name", sa.String, nullable=False),
            sa.Column("quick", sa.Boolean, nullable=False),
        ],
        "profile_measurements": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.Integer, sa.ForeignKey("profile_runs.id"), nullable=False),
            sa.Column("device_type", sa.String, nullable=False),
            sa.Column("op", sa.String, nullable=False),
            sa.Column("params_json", sa.String, nullable=False),
            sa.Column("dtype", sa.String, nullable=False),
            sa.Column("link_class", sa.String, nullable=False),
            sa.Column("emulation_slowdown", sa.Float, nullable=False),
            sa.Column("flops", sa.Float, nullable=False),
            sa.Column("bytes_moved", sa.Float, nullable=False),
            sa.Column("status", sa.String, nullable=False),
            sa.Column("median_s", sa.Float),
            sa.Column("p10_s", sa.Float),
            sa.Column("p90_s", sa.Float),
            sa.Column("samples", sa.Integer, nullable=False),
            sa.Column("device_name", sa.String, nullable=False),
            sa.Column("torch_version", sa.String, nullable=False),
            sa.Column("cuda_version", sa.String),
            sa.Column("clocks", sa.String),
            sa.Column("error", sa.Text),
            sa.Column("host", sa.String, nullable=False),
            sa.Column("extra_json", sa.Text, nullable=False),
            sa.UniqueConstraint(
                "device_type",
                "op",
                "params_json",
                "dtype",
                "link_class",
                "emulation_slowdown",
                name="uq_profile_measurement_identity",
            ),
        ],
        "fitted_models": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("created_at", _NOW, nullable=False),
            sa.Column("document_json", sa.Text, nullable=False),
        ],
    }


_RUN_ID_INDEXES = ("profile_measurements", "runtime_measurements", "runtime_attention_kernels")


def upgrade() -> None:
    present = set(sa.inspect(op.get_bind()).get_table_names())
    for name, items in _tables().items():
        if name in present:
            continue
        op.create_table(name, *items)
        if name in _RUN_ID_INDEXES:
            op.create_index(f"ix_{name}_run_id", name, ["run_id"])
    meta = sa.table("store_meta", sa.column("key", sa.String), sa.column("value", sa.String))
    known = op.get_bind().execute(sa.select(meta.c.key).where(meta.c.key == "schema_version"))
    if known.first() is None:
        op.bulk_insert(meta, [{"key": "schema_version", "value": "1"}])


def downgrade() -> None:
    raise NotImplementedError("hexiseq stores are never downgraded; open them with this hexiseq")
