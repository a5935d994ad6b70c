"""Re-plans views: what each re-plan of a `hexiseq run` launch changed, why, and the gain it was
predicted to bring against the gain measured once the new plan ran."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from hexiseq.errors import HexiseqError
from hexiseq.plan import Plan

REPLAN_COLUMNS = [
    "replan",
    "when_utc",
    "launch",
    "step",
    "reason",
    "detail",
    "plan_change",
    "predicted_old_step_s",
    "predicted_new_step_s",
    "predicted_gain",
    "measured_before_step_s",
    "measured_after_step_s",
    "measured_gain",
    "planning_s",
]
PREDICTED_COLOR = "#1f77b4"
MEASURED_COLOR = "#2ca02c"
_SIZES_SHOWN = 8


@lru_cache(maxsize=64)  # a page redraws every re-plan's two plans on each rerun
def plan_shape(plan_json: str) -> str:
    """A plan's shape in a few words: its ranks and HP groups (sizes in ring order), per replica
    when it has several, e.g. "8 ranks, 2 HP groups of 4", "7 ranks, 2 HP groups (4+3)" or
    "8 ranks, 2 replicas: 2 HP groups of 2 | 2 HP groups of 2".

    Never raises: text that is not a plan this hexiseq reads is "unreadable plan (why)"."""
    try:
        plan = Plan.from_json_text(plan_json, source="plan")
    except HexiseqError as error:
        return f"unreadable plan ({error})"
    groups = " | ".join(
        _groups_text([len(group) for group in replica.layout.groups]) for replica in plan.replicas
    )
    replicas = f"{len(plan.replicas)} replicas: " if plan.data_parallel else ""
    return f"{plan.cluster.world_size} ranks, {replicas}{groups}"


def _groups_text(sizes: list[int]) -> str:
    """ "16 HP groups of 1", or "3 HP groups (4+2+2)" (the first `_SIZES_SHOWN` sizes)."""
    count = f"{len(sizes)} HP group{'s' if len(sizes) > 1 else ''}"
    if len(set(sizes)) == 1:
        return f"{count} of {sizes[0]}"
    shown = "+".join(str(size) for size in sizes[:_SIZES_SHOWN])
    return f"{count} ({shown}{'+...' if len(sizes) > _SIZES_SHOWN else ''})"


def replans_frame(records: Sequence[Any]) -> pd.DataFrame:
    """One row per re-plan (in the order given; the store lists newest first): when (UTC),
    the launch, the first step of the new plan, why, the old plan's shape -> the new one's
    (`plan_shape`), predicted step times and gain, measured step times and gain (None while
    unknown), and the search time.

    Takes records like `hexiseq.store.ReplanRecord`."""
    rows = [_replan_row(record) for record in records]
    return pd.DataFrame(rows, columns=REPLAN_COLUMNS)


def _replan_row(record: Any) -> dict[str, Any]:
    return {
        "replan": record.id,
        "when_utc": record.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        "launch": record.launch_id,
        "step": record.step,
        "reason": record.reason,
        "detail": record.detail,
        "plan_change": f"{plan_shape(record.old_plan_json)} -> {plan_shape(record.new_plan_json)}",
        "predicted_old_step_s": record.predicted_old_step_s,
        "predicted_new_step_s": record.predicted_new_step_s,
        "predicted_gain": record.predicted_gain,
        "measured_before_step_s": record.measured_before_step_s,
        "measured_after_step_s": record.measured_after_step_s,
        "measured_gain": record.measured_gain,
        "planning_s": record.planning_s,
    }


def replan_gain_figure(frame: pd.DataFrame) -> go.Figure:
    """Predicted against measured gain (old step time over new) per re-plan, side by side,
    with the line of no gain at 1; a re-plan whose gain was not measured says so instead of a
    measured bar."""
    order = frame.iloc[::-1]  # oldest first, left to right
    labels = [f"#{r} step {s} ({why})" for r, s, why in zip(order["replan"], order["step"],
                                                           order["reason"])]  # fmt: skip
    figure = go.Figure(
        [
            _gain_bars(labels, order["predicted_gain"], "predicted gain", PREDICTED_COLOR,
                       missing="old plan lost a device"),
            _gain_bars(labels, order["measured_gain"], "measured gain", MEASURED_COLOR,
                       missing="not measured"),
        ]
    )  # fmt: skip
    figure.add_hline(y=1.0, line_dash="dot", annotation_text="no gain")
    figure.update_layout(
        title="Re-plans: predicted vs measured gain (old step time / new step time)",
        yaxis_title="gain (x)",
        barmode="group",
    )
    return figure


def _gain_bars(labels: list[str], gains: pd.Series, name: str, color: str, missing: str) -> go.Bar:
    """One bar per re-plan; a gain that is not known is a bar of 0 saying why."""
    values = gains.astype(float)
    return go.Bar(
        x=labels,
        y=values.fillna(0.0),
        name=name,
        marker_color=color,
        text=[missing if pd.isna(g) else f"{g:.2f}x" for g in values],
        textposition="outside",
    )
