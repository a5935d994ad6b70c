"""Store records as tables: saved plans, and which saved baselines belong to a saved plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from hexiseq.units import format_tokens

BEST_LABEL = "best"
"""The label `hexiseq plan` saves its searched plan under; baselines carry their own names."""


def plans_frame(records: Sequence[Any]) -> pd.DataFrame:
    """One row per saved plan (newest first, as the store lists them)."""
    rows = [
        {
            "id": record.id,
            "saved_utc": record.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "label": record.label,
            "cluster": record.cluster_name,
            "model": record.model_name,
            "seq_len": format_tokens(record.seq_len),
            "tokens_per_s": record.tokens_per_s,
            "step_time_s": record.step_time_s,
            "cost_model": record.cost_model,
        }
        for record in records
    ]
    columns = [
        "id",
        "saved_utc",
        "label",
        "cluster",
        "model",
        "seq_len",
        "tokens_per_s",
        "step_time_s",
        "cost_model",
    ]
    return pd.DataFrame(rows, columns=columns)


def plan_choice_label(record: Any) -> str:
    """`#12 best: llama-30b on h100x8-a100x8, 512K` — how a saved plan is offered in a list."""
    return (
        f"#{record.id} {record.label}: {record.model_name} on {record.cluster_name}, "
        f"{format_tokens(record.seq_len)}"
    )


def baseline_ids_of(plan_id: int, records: Sequence[Any]) -> dict[str, int]:
    """The saved baselines of saved plan `plan_id`: `hexiseq plan` saves the best plan, then its
    feasible baselines, in one transaction, so they are the next ids with the same cluster,
    model and sequence length, up to the next best plan. Returns baseline name -> plan id."""
    by_id = {record.id: record for record in records}
    if plan_id not in by_id:
        return {}
    anchor, found = by_id[plan_id], {}
    for record_id in sorted(i for i in by_id if i > plan_id):
        record = by_id[record_id]
        same_problem = (record.cluster_name, record.model_name, record.seq_len) == (
            anchor.cluster_name,
            anchor.model_name,
            anchor.seq_len,
        )
        if record.label == BEST_LABEL or not same_problem or record.label in found:
            break
        found[record.label] = record_id
    return found
