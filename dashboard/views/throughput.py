"""Throughput views: the plan against the baselines, the search's history and Pareto front,
and predicted against measured runs of the runtime."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import median
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from hexiseq.catalog import GiB
from hexiseq.dashboard.views.memory import OOM_COLOR
from hexiseq.plan import InfeasiblePlan, Plan


def throughput_frame(
    best: Plan, baselines: dict[str, Plan | InfeasiblePlan], replicas: Any = None
) -> pd.DataFrame:
    """The plan, then each baseline: tokens/s, step time, the plan's speedup over it, and
    `fits` / `OOM` / `infeasible` with the reason; then, given a search's data-parallel
    replicas baseline (`SearchResult.data_parallel`), that too."""
    rows = [_throughput_row(best.name, best, best)]
    if replicas is not None:
        rows += [_replicas_row(replicas, best)]
    for name, candidate in baselines.items():
        if isinstance(candidate, Plan):
            rows.append(_throughput_row(name, candidate, best))
            continue
        status = "OOM" if candidate.missing_bytes else "infeasible"
        rows.append(
            {
                "candidate": name,
                "tokens_per_s": None,
                "step_time_s": None,
                "plan_speedup": None,
                "status": status,
                "reason": candidate.reason,
            }
        )
    return pd.DataFrame(rows)


def _replicas_row(replicas: Any, best: Plan) -> dict[str, Any]:
    return {
        "candidate": replicas.name,
        "tokens_per_s": replicas.tokens_per_s,
        "step_time_s": replicas.step_time_s,
        "plan_speedup": best.predicted.tokens_per_s / replicas.tokens_per_s,
        "status": "fits",
        "reason": f"{replicas.describe()}; a batch of {replicas.sequences} sequences per step "
        "(plan that batch, micro-batches, and hexiseq plans its own replicas sharing it)",
    }


def _throughput_row(name: str, candidate: Plan, best: Plan) -> dict[str, Any]:
    tokens_per_s = candidate.predicted.tokens_per_s
    return {
        "candidate": name,
        "tokens_per_s": tokens_per_s,
        "step_time_s": candidate.predicted.step_time_s,
        "plan_speedup": best.predicted.tokens_per_s / tokens_per_s,
        "status": "fits",
        "reason": "",
    }


def throughput_figure(frame: pd.DataFrame) -> go.Figure:
    """Bars of predicted tokens/s; a candidate that cannot run gets an empty slot saying why
    (OOM or infeasible) instead of a bar."""
    runs = frame["status"] == "fits"
    values = frame["tokens_per_s"].where(runs, 0.0).astype(float)
    labels = [
        f"{value:,.0f} ({speedup:.2f}x)" if ok else status
        for value, speedup, ok, status in zip(values, frame["plan_speedup"], runs, frame["status"])
    ]
    figure = go.Figure(
        go.Bar(
            x=frame["candidate"],
            y=values,
            text=labels,
            textposition="outside",
            marker_color=["#1f77b4" if ok else OOM_COLOR for ok in runs],
            hovertext=frame["reason"],
        )
    )
    figure.update_layout(
        title="Predicted throughput: plan vs baselines (plan speedup in brackets)",
        yaxis_title="tokens/s",
        showlegend=False,
    )
    return figure


def search_history_frame(values: Sequence[float | None]) -> pd.DataFrame:
    """Trial number, tokens/s (None: infeasible) and the best feasible tokens/s so far."""
    best, rows = None, []
    for number, value in enumerate(values):
        if value is not None and value > 0:
            best = value if best is None else max(best, value)
        feasible = value is not None and value > 0
        rows.append(
            {"trial": number, "tokens_per_s": value if feasible else None, "best_so_far": best}
        )
    return pd.DataFrame(rows, columns=["trial", "tokens_per_s", "best_so_far"])


def study_values(trials: Iterable[Any]) -> list[tuple[float, ...] | None]:
    """The objective values of an Optuna study's trials (None when a trial did not complete).

    Takes anything with `.state.name` and `.values`, like `optuna.trial.FrozenTrial`."""
    return [
        tuple(trial.values) if trial.state.name == "COMPLETE" and trial.values else None
        for trial in trials
    ]


def search_history_figure(frame: pd.DataFrame, title: str = "Search history") -> go.Figure:
    """Each trial's tokens/s and the best so far; infeasible trials marked on the x axis."""
    infeasible = frame[frame["tokens_per_s"].isna()]
    figure = go.Figure(
        [
            go.Scatter(x=frame["trial"], y=frame["tokens_per_s"], mode="markers", name="trial"),
            go.Scatter(
                x=frame["trial"],
                y=frame["best_so_far"],
                mode="lines",
                line_shape="hv",
                name="best so far",
            ),
            go.Scatter(
                x=infeasible["trial"],
                y=[0] * len(infeasible),
                mode="markers",
                marker={"symbol": "x", "color": OOM_COLOR},
                name="infeasible",
            ),
        ]
    )
    figure.update_layout(title=title, xaxis_title="trial", yaxis_title="tokens/s")
    return figure


def pareto_frame(points: Sequence[tuple[float, float]]) -> pd.DataFrame:
    """Points (tokens/s, headroom fraction of the fullest device), with `on_front` marking the
    non-dominated ones (both objectives maximized)."""
    rows = []
    for i, (tokens, headroom) in enumerate(points):
        dominated = any(
            t >= tokens and h >= headroom and (t > tokens or h > headroom)
            for j, (t, h) in enumerate(points)
            if j != i
        )
        rows.append(
            {"tokens_per_s": tokens, "headroom_pct": 100 * headroom, "on_front": not dominated}
        )
    return pd.DataFrame(rows, columns=["tokens_per_s", "headroom_pct", "on_front"])


def pareto_figure(frame: pd.DataFrame) -> go.Figure:
    """Throughput against memory headroom; the front drawn as a line through its points."""
    front = frame[frame["on_front"]].sort_values("tokens_per_s")
    others = frame[~frame["on_front"]]
    figure = go.Figure(
        [
            go.Scatter(
                x=others["tokens_per_s"],
                y=others["headroom_pct"],
                mode="markers",
                marker={"color": "lightgrey"},
                name="dominated",
            ),
            go.Scatter(
                x=front["tokens_per_s"],
                y=front["headroom_pct"],
                mode="lines+markers",
                name="Pareto front",
            ),
        ]
    )
    figure.update_layout(
        title="Pareto front: throughput vs memory headroom of the fullest device",
        xaxis_title="tokens/s",
        yaxis_title="headroom (% of capacity)",
    )
    return figure


def runs_frame(
    runs: Sequence[dict[str, Any]],
    measurements: dict[int, Sequence[Any]],
    plans: dict[int, Plan | None],
) -> pd.DataFrame:
    """One row per runtime run: its status (running, finished, failed and why), measured
    median step time (steps after the first when there are several: the first includes
    warm-up) against the plan's prediction, and peak memory."""
    rows = []
    for run in runs:
        rows_of_run = measurements.get(run["id"], [])
        plan = plans.get(run["id"])
        measured_s = _median_step_time_s(rows_of_run)
        predicted_s = plan.predicted.step_time_s if plan else None
        rows.append(
            {
                "run": run["id"],
                "plan": run["plan_name"],
                "ranks": run["world_size"],
                "device": run["device"],
                "emulation": bool(run["emulation"]),
                "status": run["status"],
                "failure": run["failure"] or "",
                "steps_measured": len({m.step for m in rows_of_run}),
                "predicted_step_s": predicted_s,
                "measured_step_s": measured_s,
                "measured_over_predicted": measured_s / predicted_s
                if measured_s and predicted_s
                else None,
                "measured_peak_GiB": max((m.peak_memory_bytes for m in rows_of_run), default=0)
                / GiB,
            }
        )
    return pd.DataFrame(rows)


def _median_step_time_s(measurements: Sequence[Any]) -> float | None:
    by_step = {m.step: m.step_time_s for m in measurements}
    steps = sorted(by_step)
    kept = steps[1:] if len(steps) > 1 else steps
    return median(by_step[s] for s in kept) if kept else None


def rank_measured_frame(plan: Plan, measurements: Sequence[Any]) -> pd.DataFrame:
    """Per rank of one run: predicted busy time and peak memory against the measured medians
    (rank time: from the step's opening barrier to the rank's optimizer step)."""
    rows = []
    for rank, predicted in enumerate(plan.predicted.ranks):
        mine = [m for m in measurements if m.rank == rank]
        rows.append(
            {
                "rank": rank,
                "predicted_busy_s": predicted.busy_s,
                "measured_rank_s": median(m.rank_time_s for m in mine) if mine else None,
                "predicted_memory_GiB": predicted.memory_bytes / GiB,
                "measured_peak_GiB": max(m.peak_memory_bytes for m in mine) / GiB
                if mine
                else None,
            }
        )
    return pd.DataFrame(rows)


def predicted_vs_measured_figure(frame: pd.DataFrame) -> go.Figure:
    """Measured against predicted step time per run, with the y = x line of a perfect model."""
    known = frame.dropna(subset=["predicted_step_s", "measured_step_s"])
    values = known[["predicted_step_s", "measured_step_s"]].to_numpy(dtype=float)
    top = float(values.max()) if values.size else 1.0
    figure = go.Figure(
        [
            go.Scatter(
                x=known["predicted_step_s"],
                y=known["measured_step_s"],
                mode="markers+text",
                text=[f"run {r}" for r in known["run"]],
                textposition="top center",
                name="runs",
            ),
            go.Scatter(
                x=[0, top],
                y=[0, top],
                mode="lines",
                line={"dash": "dot"},
                name="measured = predicted",
            ),
        ]
    )
    figure.update_layout(
        title="Runtime runs: measured vs predicted step time",
        xaxis_title="predicted step time (s)",
        yaxis_title="measured step time (s)",
    )
    return figure
