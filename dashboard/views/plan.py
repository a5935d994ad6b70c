"""Plan views: who owns which tokens and heads, and where each rank's step time goes."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from hexiseq.catalog import GiB
from hexiseq.plan import Plan

TIME_PARTS = {
    "linear_s": "linear",
    "attention_s": "attention",
    "elementwise_s": "elementwise",
    "cast_s": "casts",
    "loss_s": "loss",
    "optimizer_s": "optimizer",
    "launch_s": "launch overhead",
    "all_to_all_s": "all-to-all",
    "ring_exposed_comm_s": "exposed ring comm",
    "sharding_exposed_comm_s": "exposed sharding comm",
    "idle_s": "idle (waiting on peers)",
}
"""RankTime fields in stacking order, with their legend names; they add up to the step."""

_GROUP_COLORS = px.colors.qualitative.Plotly


def rank_label(plan: Plan, rank: int) -> str:
    """`r3 A100-80G` style label of a rank, used as the y category in every per-rank figure."""
    return f"r{rank} {plan.cluster.devices[rank].gpu}"


def assignments_frame(plan: Plan, ranks: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per rank (of `ranks`, default all): node, GPU, HP group, heads, token ranges,
    tokens, predicted step part."""
    rows = []
    for rank in _ranks(plan, ranks):
        assignment, predicted = plan.assignments[rank], plan.predicted.ranks[rank]
        layout, local = plan.rank_layout(rank)
        low, high = assignment.head_range
        rows.append(
            {
                "rank": assignment.rank,
                **({"replica": assignment.replica} if plan.data_parallel else {}),
                "node": assignment.node,
                "gpu": assignment.gpu,
                "group": assignment.group,
                "heads": high - low,
                "head_range": f"[{low}, {high})",
                "tokens": assignment.tokens,
                "token_ranges": " ".join(f"[{s}, {e})" for s, e in layout.token_ranges[local]),
                "state_fraction": assignment.state_fraction,
                "busy_s": predicted.busy_s,
                "memory_GiB": predicted.memory_bytes / GiB,
            }
        )
    return pd.DataFrame(rows)


def segments_frame(plan: Plan, ranks: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per owned token range (of `ranks`, default all): rank, group, start, end
    (half-open), tokens."""
    rows = [
        {
            "rank": rank,
            "label": rank_label(plan, rank),
            "group": plan.assignments[rank].group,
            "start": start,
            "end": end,
            "tokens": end - start,
        }
        for rank in _ranks(plan, ranks)
        for start, end in _token_ranges(plan, rank)
    ]
    return pd.DataFrame(rows)


def segments_figure(plan: Plan, ranks: Sequence[int] | None = None) -> go.Figure:
    """The zigzag chunks on the sequence axis: one row per rank (of `ranks`, default all), one
    bar per owned token range, colored by HP group (one trace per group)."""
    frame = segments_frame(plan, ranks)
    figure = go.Figure()
    for group, part in frame.groupby("group", sort=True):
        figure.add_trace(
            go.Bar(
                y=part["label"],
                x=part["tokens"],
                base=part["start"],
                orientation="h",
                name=f"group {group}",
                marker_color=_GROUP_COLORS[group % len(_GROUP_COLORS)],
                customdata=part[["start", "end"]].to_numpy(),
                hovertemplate="%{y}: tokens [%{customdata[0]:,}, %{customdata[1]:,})"
                "<extra>group " + str(group) + "</extra>",
            )
        )
    _per_rank_axis(figure, plan, ranks)
    figure.update_layout(
        title=f"Sequence segments ({plan.train.seq_len:,} tokens, generalized zigzag)",
        xaxis_title="token position",
        xaxis_range=[0, plan.train.seq_len],
        barmode="overlay",
    )
    return figure


def heads_figure(plan: Plan, ranks: Sequence[int] | None = None) -> go.Figure:
    """Each rank's (of `ranks`, default all) query-head range inside attention, colored by HP
    group."""
    layout = plan.attention_layout
    shown = _ranks(plan, ranks)
    figure = go.Figure()
    for group in sorted({plan.assignments[r].group for r in shown}):
        members = [r for r in shown if plan.assignments[r].group == group]
        figure.add_trace(
            go.Bar(
                y=[rank_label(plan, r) for r in members],
                x=[plan.assignments[r].heads for r in members],
                base=[plan.assignments[r].head_range[0] for r in members],
                orientation="h",
                name=f"group {group}",
                marker_color=_GROUP_COLORS[group % len(_GROUP_COLORS)],
                hovertemplate="%{y}: %{x} heads from %{base}<extra></extra>",
            )
        )
    _per_rank_axis(figure, plan, ranks)
    figure.update_layout(
        title=f"Query heads per rank ({layout.num_heads} heads, {layout.num_kv_heads} K/V)",
        xaxis_title="query head",
        xaxis_range=[0, layout.num_heads],
        barmode="overlay",
    )
    return figure


def _token_ranges(plan: Plan, rank: int) -> tuple[tuple[int, int], ...]:
    layout, local = plan.rank_layout(rank)
    return layout.token_ranges[local]


def time_breakdown_frame(plan: Plan, ranks: Sequence[int] | None = None) -> pd.DataFrame:
    """Per rank (of `ranks`, default all), the predicted seconds of each `TIME_PARTS` term and
    their total (the step)."""
    rows = []
    for rank in _ranks(plan, ranks):
        predicted = plan.predicted.ranks[rank]
        row = {"rank": rank, "label": rank_label(plan, rank)}
        row.update({field: getattr(predicted, field) for field in TIME_PARTS})
        row["step_s"] = predicted.step_s
        rows.append(row)
    return pd.DataFrame(rows)


def time_breakdown_figure(plan: Plan, ranks: Sequence[int] | None = None) -> go.Figure:
    """Stacked bars of `time_breakdown_frame`: one bar per rank, one trace per term."""
    frame = time_breakdown_frame(plan, ranks)
    figure = go.Figure(
        [
            go.Bar(
                y=frame["label"],
                x=frame[field],
                orientation="h",
                name=name,
                hovertemplate="%{y}: %{x:.4g} s<extra>" + name + "</extra>",
            )
            for field, name in TIME_PARTS.items()
        ]
    )
    _per_rank_axis(figure, plan, ranks)
    figure.update_layout(
        title=f"Predicted step time per rank: {plan.predicted.step_time_s:.4g} s "
        f"[{plan.cost_model_summary}]",
        xaxis_title="seconds per step",
        barmode="stack",
    )
    return figure


def _ranks(plan: Plan, ranks: Sequence[int] | None) -> list[int]:
    return list(range(plan.cluster.world_size)) if ranks is None else sorted(ranks)


def _per_rank_axis(figure: go.Figure, plan: Plan, ranks: Sequence[int] | None = None) -> None:
    """Ranks top to bottom in rank order, rows tall enough to read."""
    labels = [rank_label(plan, rank) for rank in _ranks(plan, ranks)]
    figure.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed")
    figure.update_layout(height=160 + 22 * len(labels), legend_title_text="")


DETAIL_RANKS = 32
"""Plans of more ranks show one row per node, and the per-rank figures of one node at a time
(a 128-rank plan made the Plan page 13,500 px tall)."""


def node_ranks(plan: Plan) -> dict[str, list[int]]:
    """Each node's ranks, in node order."""
    ranks: dict[str, list[int]] = {node.name: [] for node in plan.cluster.nodes}
    for device in plan.cluster.devices:
        ranks[device.node].append(device.rank)
    return ranks


def node_summary_frame(plan: Plan) -> pd.DataFrame:
    """One row per node: its GPU type and ranks, the tokens and heads its ranks hold, their
    slowest predicted busy time and their memory (GiB, least and most, and the most as a
    fraction of the device)."""
    rows = []
    for node, ranks in node_ranks(plan).items():
        predicted = [plan.predicted.ranks[r] for r in ranks]
        heads = [plan.assignments[r].heads for r in ranks]
        memory_GiB = [p.memory_bytes / GiB for p in predicted]
        rows.append(
            {
                "node": node,
                "gpu": plan.cluster.devices[ranks[0]].gpu,
                "ranks": f"{ranks[0]}..{ranks[-1]}",
                "devices": len(ranks),
                "tokens": sum(plan.assignments[r].tokens for r in ranks),
                "heads_per_rank": f"{min(heads)}-{max(heads)}" if min(heads) != max(heads)
                else str(heads[0]),
                "slowest_busy_s": max(p.busy_s for p in predicted),
                "memory_GiB_min": min(memory_GiB),
                "memory_GiB_max": max(memory_GiB),
                "memory_fraction_max": max(
                    p.memory_bytes / p.memory_capacity_bytes for p in predicted
                ),
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


def cost_model_kind(label: str) -> str:
    """ "fitted" or "datasheet": the kind of cost model behind a `Prediction.cost_model` label
    ("fitted (profile run 3, ...)", "datasheet estimate", "measured CPU peak" - a datasheet
    roofline whose CPU peak was measured)."""
    return "fitted" if label.startswith("fitted") else "datasheet"


def prediction_source_line(plan: Plan) -> str:
    """The one line every page with predictions shows: whether the plan's numbers come from the
    datasheet or a fitted cost model, per GPU type where the types differ (from the plan's
    `predicted.cost_model`)."""
    described = {
        gpu: label if label.startswith(cost_model_kind(label)) else f"datasheet: {label}"
        for gpu, label in plan.predicted.cost_model.items()
    }
    if not described:
        return f"Predictions of {plan.name}: cost model not recorded in the plan"
    if len(set(described.values())) == 1:
        return f"Predictions of {plan.name}: {next(iter(described.values()))}"
    per_type = "; ".join(f"{gpu} {text}" for gpu, text in described.items())
    return f"Predictions of {plan.name}: {per_type}"


def plan_summary(plan: Plan) -> dict[str, object]:
    """The headline numbers of a plan, for metrics and side-by-side comparison."""
    layouts = [replica.layout for replica in plan.replicas]
    return {
        "name": plan.name,
        "cluster": plan.cluster.name,
        "model": plan.model.name,
        "seq_len": plan.train.seq_len,
        "devices": plan.cluster.world_size,
        "replicas": len(plan.replicas),
        "sequences_per_step": plan.train.micro_batches,
        "hp_groups": sum(len(layout.groups) for layout in layouts),
        "hp_group_sizes": " | ".join(
            " ".join(str(len(g)) for g in layout.groups) for layout in layouts
        ),
        "tokens_per_s": plan.predicted.tokens_per_s,
        "step_time_s": plan.predicted.step_time_s,
        "max_memory_used_pct": 100 * plan.predicted.max_memory_fraction,
        "activation_checkpointing": plan.train.activation_checkpointing,
        "cost_model": plan.cost_model_summary,
    }


def compare_plans_frame(plans: dict[str, Plan]) -> pd.DataFrame:
    """`plan_summary` of each plan as a column, rows the quantities (side-by-side table)."""
    return pd.DataFrame({title: plan_summary(plan) for title, plan in plans.items()}).astype(str)
