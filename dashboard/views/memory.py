"""Memory headroom views: each device's predicted peak by term against its capacity and the
95 % limit the planner keeps, and what the baselines would need (OOM shown as such)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from hexiseq.catalog import GiB
from hexiseq.costmodel.memory import MEMORY_LIMIT_FRACTION, estimate_memory
from hexiseq.dashboard.views.plan import rank_label
from hexiseq.plan import InfeasiblePlan, Plan

MEMORY_TERMS = {
    "model_states": "model states",
    "activations": "activations held (checkpoints, saved)",
    "working_set": "working set at the peak phase",
    "sharding_buffers": "sharding buffers",
    "workspaces": "kernel workspaces",
    "reserve": "reserve (context, fragmentation)",
}
"""Memory terms in stacking order, with their legend names; they add up to the peak."""

OOM_COLOR = "#d62728"


def memory_terms_bytes(plan: Plan) -> list[dict[str, int]]:
    """Per rank, the peak split by `MEMORY_TERMS`: as the plan carries it, or recomputed with
    the closed-form memory model for plans saved without it."""
    if all(rank.memory_terms for rank in plan.predicted.ranks):
        return [dict(rank.memory_terms) for rank in plan.predicted.ranks]
    if plan.data_parallel:  # each replica's ranks by their own mesh
        terms: list[dict[str, int]] = [{} for _ in plan.assignments]
        for index, replica in enumerate(plan.replicas):
            for rank, own in zip(replica.ranks, memory_terms_bytes(plan.replica_plan(index))):
                terms[rank] = own
        return terms
    fractions = [a.state_fraction for a in plan.assignments]
    breakdowns = estimate_memory(
        plan.cluster, plan.model, plan.train, plan.attention_layout, fractions
    )
    return [breakdown.terms() for breakdown in breakdowns]


def memory_frame(plan: Plan) -> pd.DataFrame:
    """One row per rank: GiB per term, used, capacity, the 95 % limit, headroom to the limit."""
    rows = []
    for rank, terms in enumerate(memory_terms_bytes(plan)):
        predicted = plan.predicted.ranks[rank]
        capacity = predicted.memory_capacity_bytes
        row = {"rank": rank, "label": rank_label(plan, rank)}
        row.update({f"{term}_GiB": terms.get(term, 0) / GiB for term in MEMORY_TERMS})
        row.update(
            used_GiB=predicted.memory_bytes / GiB,
            capacity_GiB=capacity / GiB,
            limit_GiB=MEMORY_LIMIT_FRACTION * capacity / GiB,
            used_pct=100 * predicted.memory_fraction,
            headroom_to_limit_GiB=(MEMORY_LIMIT_FRACTION * capacity - predicted.memory_bytes)
            / GiB,
        )
        rows.append(row)
    return pd.DataFrame(rows)


def memory_figure(plan: Plan) -> go.Figure:
    """Stacked bars of each rank's peak by term, with its capacity and 95 % limit marked."""
    frame = memory_frame(plan)
    figure = go.Figure(
        [
            go.Bar(
                y=frame["label"],
                x=frame[f"{term}_GiB"],
                orientation="h",
                name=name,
                hovertemplate="%{y}: %{x:.3g} GiB<extra>" + name + "</extra>",
            )
            for term, name in MEMORY_TERMS.items()
        ]
    )
    _add_capacity_markers(figure, frame)
    _rank_axis(figure, frame)
    figure.update_layout(
        title=f"Predicted peak memory per device: {plan.name} "
        f"(fullest at {frame['used_pct'].max():.1f} % of capacity)",
        xaxis_title="GiB",
        barmode="stack",
    )
    return figure


def _add_capacity_markers(figure: go.Figure, frame: pd.DataFrame) -> None:
    """Per rank a tick at 95 % of its capacity (the planner's limit) and one at capacity."""
    percent = round(100 * MEMORY_LIMIT_FRACTION)
    for column, name, color in (
        ("limit_GiB", f"{percent} % limit", "black"),
        ("capacity_GiB", "capacity", "grey"),
    ):
        figure.add_trace(
            go.Scatter(
                y=frame["label"],
                x=frame[column],
                mode="markers",
                marker={"symbol": "line-ns", "size": 22, "line": {"width": 3, "color": color}},
                name=name,
                hovertemplate="%{y}: %{x:.3g} GiB<extra>" + name + "</extra>",
            )
        )


def _rank_axis(figure: go.Figure, frame: pd.DataFrame) -> None:
    labels = list(dict.fromkeys(frame["label"]))
    figure.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed")
    figure.update_layout(height=160 + 24 * len(labels), legend_title_text="")


def baseline_memory_frame(plan: Plan, baselines: dict[str, Plan | InfeasiblePlan]) -> pd.DataFrame:
    """Per candidate (the plan, then each baseline) and rank, the memory it needs in GiB.

    A feasible candidate needs its predicted peak (status `fits`). An out-of-memory baseline
    needs the 95 % limit plus the bytes the search found missing, on each rank that is short
    (status `OOM`); its other ranks fit and are not listed. A baseline that breaks a rule of
    its system (e.g. heads not divisible) has one row with no rank and the reason.
    """
    limits = [MEMORY_LIMIT_FRACTION * r.memory_capacity_bytes for r in plan.predicted.ranks]
    rows = _fitting_rows(plan.name, plan, plan)
    for name, candidate in baselines.items():
        if isinstance(candidate, Plan):
            rows += _fitting_rows(name, candidate, plan)
        elif candidate.missing_bytes:
            rows += [
                _row(name, rank, plan, (limits[rank] + missing) / GiB, "OOM", candidate.reason)
                for rank, missing in sorted(candidate.missing_bytes.items())
            ]
        else:
            rows.append(
                {
                    "candidate": name,
                    "rank": None,
                    "label": None,
                    "memory_GiB": None,
                    "status": "infeasible",
                    "reason": candidate.reason,
                }
            )
    return pd.DataFrame(rows)


def _fitting_rows(name: str, candidate: Plan, plan: Plan) -> list[dict]:
    return [
        _row(name, rank, plan, predicted.memory_bytes / GiB, "fits", "")
        for rank, predicted in enumerate(candidate.predicted.ranks)
    ]


def _row(name: str, rank: int, plan: Plan, memory_GiB: float, status: str, reason: str):
    return {
        "candidate": name,
        "rank": rank,
        "label": rank_label(plan, rank),
        "memory_GiB": memory_GiB,
        "status": status,
        "reason": reason,
    }


def baseline_memory_figure(plan: Plan, baselines: dict[str, Plan | InfeasiblePlan]) -> go.Figure:
    """Grouped bars per device: what the plan and each baseline need; OOM bars in red and
    labelled OOM; the 95 % limit and capacity ticks as in `memory_figure`."""
    frame = baseline_memory_frame(plan, baselines).dropna(subset=["rank"])
    figure = go.Figure()
    for name, part in frame.groupby("candidate", sort=False):
        oom = part["status"] == "OOM"
        figure.add_trace(
            go.Bar(
                y=part["label"],
                x=part["memory_GiB"],
                orientation="h",
                name=f"{name} (OOM)" if oom.any() else name,
                text=["OOM" if flag else "" for flag in oom],
                textposition="inside",
                marker_pattern_shape=["x" if flag else "" for flag in oom],
                marker_line_color=[OOM_COLOR if flag else "rgba(0,0,0,0)" for flag in oom],
                marker_line_width=2,
                hovertemplate="%{y}: needs %{x:.3g} GiB<extra>" + str(name) + "</extra>",
            )
        )
    _add_capacity_markers(figure, memory_frame(plan))
    _rank_axis(figure, memory_frame(plan))
    figure.update_layout(
        title="Memory needed per device: plan vs baselines (OOM: over the 95 % limit)",
        xaxis_title="GiB",
        barmode="group",
    )
    return figure
