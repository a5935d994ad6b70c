"""Plain-text tables of a plan and of a search result (pure: strings in, strings out)."""

from __future__ import annotations

from typing import Any

from hexiseq.catalog import GiB
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.units import format_tokens


def format_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Columns padded to their widest cell; columns in `right` are right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def format_plan(plan: Plan) -> str:
    """Header line and one row per device: GPU, group, heads, tokens, time and memory (and
    the replica, for a plan of several data-parallel replicas)."""
    header = (
        f"{plan.name}: {plan.model.name} on {plan.cluster.name} ({plan.cluster.world_size} "
        f"devices), {format_tokens(plan.train.seq_len)} tokens, "
        f"{plan.predicted.tokens_per_s:,.1f} tokens/s, step {plan.predicted.step_time_s:,.2f} s "
        f"[{plan.cost_model_summary}]"
    )
    if plan.data_parallel:
        sequences = ", ".join(str(r.sequences) for r in plan.replicas)
        header += (
            f"\n{len(plan.replicas)} data-parallel replicas taking {sequences} sequences per "
            f"step ({plan.train.micro_batches} in all); gradients reduced across replicas in "
            f"{plan.knobs.get('gradient_sync_s', 0.0):.2f} s"
        )
    replica = plan.data_parallel
    rows = [_device_row(a, r, replica) for a, r in zip(plan.assignments, plan.predicted.ranks)]
    headers = [
        "rank",
        *(["replica"] if replica else []),
        "node",
        "GPU",
        "group",
        "heads",
        "tokens",
        "compute s",
        "comm s",
        "idle s",
        "memory GiB used/cap",
        "used",
    ]
    right = {0, 3, 5, 6, 7, 8, 9, 10}
    if replica:
        right = {0, 1} | {column + 1 for column in right - {0}}
    return header + "\n" + format_table(headers, rows, right=right)


def _device_row(assignment: Any, rank: Any, replica: bool = False) -> list[str]:
    low, high = assignment.head_range
    comm = rank.all_to_all_s + rank.ring_exposed_comm_s + rank.sharding_exposed_comm_s
    compute = rank.busy_s - comm  # GEMMs, attention, elementwise, casts, loss, optimizer, launches
    return [
        str(assignment.rank),
        *([str(assignment.replica)] if replica else []),
        assignment.node,
        assignment.gpu,
        str(assignment.group),
        f"{high - low} [{low},{high})",
        f"{assignment.tokens:,}",
        f"{compute:,.2f}",
        f"{comm:,.2f}",
        f"{rank.idle_s:,.2f}",
        f"{rank.memory_bytes / GiB:.1f} / {rank.memory_capacity_bytes / GiB:.1f}",
        f"{100 * rank.memory_fraction:.1f}%",
    ]


def format_baselines(best: Plan, baselines: dict[str, Plan | InfeasiblePlan]) -> str:
    """The plan against each baseline: tokens/s and the plan's speedup, or why it cannot run."""
    rows = [[best.name, f"{best.predicted.tokens_per_s:,.1f}", "1.00x", _memory_cell(best)]]
    for name, other in baselines.items():
        if isinstance(other, InfeasiblePlan):
            rows.append([name, "-", "-", f"infeasible: {other.reason}"])
            continue
        ratio = best.predicted.tokens_per_s / other.predicted.tokens_per_s
        label = other.name if other.name == name else f"{name}: {other.name}"
        rows.append(
            [label, f"{other.predicted.tokens_per_s:,.1f}", f"{ratio:.2f}x", _memory_cell(other)]
        )
    table = format_table(
        ["plan", "tokens/s", "hexiseq speedup", "peak memory"], rows, right={1, 2}
    )
    feasible = [b for b in baselines.values() if isinstance(b, Plan)]
    if not feasible:
        return table + "\n\nno baseline can run: hexiseq's plan is the only one that fits"
    strongest = max(feasible, key=lambda b: b.predicted.tokens_per_s)
    ratio = best.predicted.tokens_per_s / strongest.predicted.tokens_per_s
    return table + f"\n\nagainst the strongest feasible baseline ({strongest.name}): {ratio:.2f}x"


def _memory_cell(plan: Plan) -> str:
    return f"max {100 * plan.predicted.max_memory_fraction:.1f}% of a device"


def format_search_result(result: Any) -> str:
    """The best plan's device table, its knobs, the comparison with the baselines and, for a
    multi-objective search, the Pareto front."""
    text = (
        format_plan(result.best)
        + f"\nknobs: {_format_knobs(result.best.knobs)}"
        + f"\nsearch: {_format_trials(result.trials)}"
        + "\n\nplan vs baselines (same simulator, same cost model):\n"
        + format_baselines(result.best, result.baselines)
        + format_data_parallel(result)
    )
    if result.pareto:
        text += "\n\nPareto front (throughput vs memory headroom of the fullest device):\n"
        text += format_pareto(result.pareto)
    return text


def format_data_parallel(result: Any) -> str:
    """The data-parallel-replicas baseline, and a plain note where it beats the plan."""
    replicas = getattr(result, "data_parallel", None)
    if replicas is None:
        return ""
    ratio = result.best.predicted.tokens_per_s / replicas.tokens_per_s
    text = (
        f"\n{replicas.describe()}: {replicas.tokens_per_s:,.1f} tokens/s "
        f"(gradient all-reduce {replicas.gradient_sync_s:.2f} s per step); hexiseq {ratio:.2f}x"
    )
    if ratio < 1.0 and result.best.train.micro_batches == 1:
        text += (
            "\nnote: running each GPU type as its own data-parallel replica (on a batch of "
            f"{replicas.sequences} sequences per step) is predicted faster than this plan; "
            "give the step's batch (--micro-batches N) and hexiseq plans data-parallel "
            "replicas sharing it"
        )
    elif ratio < 1.0:
        text += (
            "\nnote: running each GPU type as its own data-parallel replica is predicted "
            "faster than this plan"
        )
    return text


def format_pareto(plans: list[Plan]) -> str:
    rows = [
        [
            f"{p.predicted.tokens_per_s:,.1f}",
            f"{100 * (1 - p.predicted.max_memory_fraction):.1f}%",
            _format_knobs(p.knobs),
        ]
        for p in sorted(plans, key=lambda p: -p.predicted.tokens_per_s)
    ]
    return format_table(["tokens/s", "headroom", "knobs"], rows, right={0, 1})


def _format_knobs(knobs: dict) -> str:
    shown = {k: v for k, v in knobs.items() if k != "hp_group_sizes"}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _format_trials(trials: list) -> str:
    feasible = sum(1 for t in trials if t.tokens_per_s is not None)
    return f"{len(trials)} candidates scored ({feasible} feasible), baselines included"
