"""How long the default `plan_search` takes as clusters grow in GPUs and in GPU types.

The default search (the greedy stage's short list, each candidate's heads and loads solved by
the local stage, the polish, plus the baselines) must stay interactive: the goals (issue 13)
are at most 0.1 s for every cluster up to 128 GPUs and at most 1 s at 1024 GPUs of any mix.

Clusters: nodes of 8 GPUs, GPU types assigned round-robin by node from `GPU_CYCLE` (the first
k for k types); where nodes of 8 would leave a type out, nodes shrink to 4 or 2 GPUs (16 GPUs
of 4 / 8 types: 4 / 2 per node; 32 GPUs of 8 types: 4 per node), marked in the table.
50 GB/s between nodes except the first two nodes, joined at 25 GB/s, so the ring order matters.
Llama-3-8B at 1M tokens, falling back to 512K (said in the row) where no plan fits.

Beside the grid, the 20 random clusters of `plan_quality.py` (seed 2024: 2-4 nodes of 1-6
GPUs, 5-12 in all, 2-3 types, four models at 64K-512K tokens), timed the same way: the goal
holds for every cluster up to 128 GPUs, and small irregular clusters are where the polish
evaluates the most neighbours.

Wall time is the median of 5 searches after one warm-up search of the same cluster (the
warm-up fills the per-cluster ring-order cache; its time is shown as "first run s").

Run: `.venv/bin/python benchmarks/planner_scaling.py [--quick] [--sizes N ...] [--types K ...]
[--no-random | --random-only] [--no-write]` (prints the tables and the goal checks, and
updates the "Planner scaling" section of benchmarks/RESULTS.md unless `--no-write`, and the
random clusters' own section where they were timed; `--quick` leaves them out).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from _results import replace_section

from hexiseq import Cluster, InfeasibleError, InfeasiblePlan, Plan, plan_search
from hexiseq.search import SearchResult
from hexiseq.units import format_tokens

GPU_CYCLE = ("H100-SXM", "A100-80G", "H200", "L40S", "A800-80G", "H800", "B200", "V100-32G")
GPUS_PER_NODE = 8
INTER_NODE_GBPS = 50.0
SLOW_PAIR_GBPS = 25.0  # the first two nodes: a slower link the ring order should route around
MODEL = "llama3-8b"
SEQ_LENS = ("1M", "512K")  # the target, then the fallback where nothing fits at 1M
SIZES = (16, 32, 64, 128, 256, 512, 1024)
TYPE_COUNTS = (1, 2, 4, 8)
QUICK_SIZES, QUICK_TYPE_COUNTS = (16, 128, 1024), (1, 4, 8)
REPEATS, QUICK_REPEATS = 5, 3
GOAL_UP_TO_128_S, GOAL_1024_S = 0.1, 1.0
RANDOM_SEED, RANDOM_COUNT = 2024, 20  # plan_quality.py's 20 random clusters
CALIBRATION_LOOPS = 3_000_000
QUIET_CALIBRATION_S = 0.13
"""A plain Python loop of CALIBRATION_LOOPS steps (`calibration_s`) took about this long on
this 2-core machine when nothing else ran on its host; the same loop has read 0.15-0.42 s
within minutes of that, and the cells' times move with it. Each run reports the loop before
and after its cells."""


@dataclass(frozen=True)
class CellResult:
    """One (GPUs, types) cell: wall times in seconds and what the best plan achieved."""

    gpus: int
    type_count: int
    gpus_per_node: int
    seq_len: str
    times_s: list[float]
    first_run_s: float
    tokens_per_s: float | None  # None: no plan fits even at the fallback length
    speedup: str
    hp_degrees: str


@dataclass(frozen=True)
class RandomResult:
    """One of plan_quality.py's random clusters: what it is and its wall times in seconds."""

    index: int
    cluster: str
    gpus: int
    nodes: int
    model: str
    seq_len: int
    times_s: list[float]


def gpus_per_node(gpus: int, type_count: int) -> int:
    """8, or the largest smaller power of two that still gives every type a node."""
    size = GPUS_PER_NODE
    while size > 1 and gpus // size < type_count:
        size //= 2
    if gpus % size or gpus // size < type_count:
        raise ValueError(f"{gpus} GPUs cannot hold {type_count} GPU types node by node")
    return size


def build_cluster(gpus: int, type_count: int) -> Cluster:
    """`gpus` GPUs, the first `type_count` types of `GPU_CYCLE` round-robin by node."""
    size = gpus_per_node(gpus, type_count)
    nodes = [
        {"name": f"node{i}", "gpu": GPU_CYCLE[i % type_count], "count": size}
        for i in range(gpus // size)
    ]
    network = {
        "inter_node_GBps": INTER_NODE_GBPS,
        "overrides": [{"a": "node0", "b": "node1", "GBps": SLOW_PAIR_GBPS}],
    }
    name = f"scaling-{gpus}x{type_count}"
    return Cluster.from_dict({"name": name, "nodes": nodes, "network": network})


def timed_search(
    cluster: Cluster, seq_len: str | int, model: str = MODEL
) -> tuple[float, SearchResult | None]:
    """Wall seconds of one default `plan_search`, and its result (None: nothing fits)."""
    started = time.perf_counter()
    try:
        result = plan_search(cluster, model, seq_len)
    except InfeasibleError:
        result = None
    return time.perf_counter() - started, result


def measure_cell(gpus: int, type_count: int, repeats: int) -> CellResult:
    """Warm up (choosing 1M or the fallback length), then time `repeats` searches."""
    cluster = build_cluster(gpus, type_count)
    for seq_len in SEQ_LENS:
        first_run_s, result = timed_search(cluster, seq_len)
        if result is not None:
            break
    times_s = [timed_search(cluster, seq_len)[0] for _ in range(repeats)]
    return CellResult(
        gpus,
        type_count,
        gpus_per_node(gpus, type_count),
        seq_len,
        times_s,
        first_run_s,
        result.best.predicted.tokens_per_s if result else None,
        describe_speedup(result),
        describe_hp_degrees(result.best) if result else "-",
    )


def measure_random(repeats: int) -> list[RandomResult]:
    """plan_quality.py's random clusters (each warmed up once), `repeats` searches each."""
    from plan_quality import describe_cluster, draw_cases

    results = []
    for case in draw_cases(RANDOM_COUNT, RANDOM_SEED)[0]:
        timed_search(case.cluster, case.seq_len, case.model)
        times_s = [timed_search(case.cluster, case.seq_len, case.model)[0] for _ in range(repeats)]
        cluster = case.cluster
        results.append(
            RandomResult(
                case.index,
                describe_cluster(cluster),
                cluster.world_size,
                len(cluster.nodes),
                case.model,
                case.seq_len,
                times_s,
            )
        )
    return results


def describe_speedup(result: SearchResult | None) -> str:
    """Best plan over the strongest feasible baseline (homogeneous subset and data-parallel
    replicas per GPU type included), or why there is no ratio."""
    if result is None:
        return "-"
    feasible = [b.predicted.tokens_per_s for b in result.baselines.values() if isinstance(b, Plan)]
    replicas = result.data_parallel.tokens_per_s if result.data_parallel else 0.0
    if feasible or replicas:
        baseline = max([*feasible, replicas])
        marker = " (DP replicas)" if replicas and replicas >= max(feasible, default=0.0) else ""
        return f"{result.best.predicted.tokens_per_s / baseline:.2f}x{marker}"
    baselines = result.baselines.values()
    out_of_memory = any(isinstance(b, InfeasiblePlan) and b.missing_bytes for b in baselines)
    return "baselines OOM" if out_of_memory else "baselines infeasible"


def describe_hp_degrees(plan: Plan) -> str:
    """HP degree per GPU type ("8 (all)" when equal), or a baseline's uniform degree."""
    by_gpu = plan.knobs.get("hp_degree_by_gpu")
    if by_gpu is None:  # a baseline won: one uniform degree
        return f"{plan.name}: {plan.knobs['hp_degree']}"
    if len(set(by_gpu.values())) == 1:
        return f"{next(iter(by_gpu.values()))} (all)"
    return " ".join(f"{gpu.split('-')[0]}:{degree}" for gpu, degree in by_gpu.items())


def format_row(cell: CellResult) -> str:
    node_note = "" if cell.gpus_per_node == GPUS_PER_NODE else f" ({cell.gpus_per_node}/node)"
    seq_note = "" if cell.seq_len == SEQ_LENS[0] else f" at {cell.seq_len} (1M: nothing fits)"
    throughput = "no plan fits" if cell.tokens_per_s is None else f"{cell.tokens_per_s:,.0f}"
    return (
        f"| {cell.gpus}{node_note} | {cell.type_count} | {statistics.median(cell.times_s):.3f} "
        f"| {min(cell.times_s):.3f}-{max(cell.times_s):.3f} | {cell.first_run_s:.3f} "
        f"| {throughput}{seq_note} | {cell.speedup} | {cell.hp_degrees} |"
    )


def format_table(cells: list[CellResult]) -> str:
    # min-max, not p10-p90: 5 (or 3) runs do not define deciles.
    lines = [
        "| GPUs | types | median s | min-max s | first run s | best plan tokens/s "
        "| speedup vs strongest baseline | HP degrees |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    return "\n".join(lines + [format_row(cell) for cell in cells])


def format_random_table(results: list[RandomResult]) -> str:
    lines = [
        "| # | cluster (inter-node GB/s) | model @ tokens | GPUs | nodes | median s | min-max s |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.index} | {r.cluster} | {r.model} @ {format_tokens(r.seq_len)} | {r.gpus} "
            f"| {r.nodes} | {statistics.median(r.times_s):.3f} "
            f"| {min(r.times_s):.3f}-{max(r.times_s):.3f} |"
        )
    return "\n".join(lines)


def check_random_goal(results: list[RandomResult]) -> str:
    """The <= 0.1 s goal over the random clusters."""
    medians = {r.index: statistics.median(r.times_s) for r in results}
    slowest = max(medians, key=medians.get)
    over = sum(1 for s in medians.values() if s > GOAL_UP_TO_128_S)
    verdict = "met" if not over else f"not met in {over} of {len(medians)}"
    return (
        f"- Goal <= {GOAL_UP_TO_128_S} s on plan_quality.py's {len(medians)} random clusters: "
        f"{verdict} (slowest {medians[slowest]:.3f} s, #{slowest}; median of the medians "
        f"{statistics.median(medians.values()):.3f} s)"
    )


def check_goals(cells: list[CellResult]) -> list[str]:
    """One line per goal: met / not met, with the measured medians."""
    medians = {(c.gpus, c.type_count): statistics.median(c.times_s) for c in cells}
    lines = []
    if not cells:
        return lines
    small = {key: s for key, s in medians.items() if key[0] <= 128}
    if small:
        slowest = max(small, key=small.get)
        over = sum(1 for s in small.values() if s > GOAL_UP_TO_128_S)
        verdict = "met" if not over else f"not met in {over} of {len(small)} cells"
        lines.append(
            f"- Goal <= {GOAL_UP_TO_128_S} s for every cluster up to 128 GPUs: {verdict} "
            f"(slowest {small[slowest]:.3f} s at {slowest[0]} GPUs / {slowest[1]} types; "
            f"fastest {min(small.values()):.3f} s)"
        )
    else:
        lines.append(f"- Goal <= {GOAL_UP_TO_128_S} s up to 128 GPUs: not measured in this run")
    at_1024 = {k: s for (g, k), s in medians.items() if g == 1024}
    if at_1024:
        worst_types = max(at_1024, key=at_1024.get)
        verdict = "met" if at_1024[worst_types] <= GOAL_1024_S else "not met"
        lines.append(
            f"- Goal <= {GOAL_1024_S} s at 1024 GPUs (any types): {verdict} (slowest "
            f"{at_1024[worst_types]:.3f} s with {worst_types} types; "
            f"types measured: {', '.join(str(k) for k in sorted(at_1024))})"
        )
    else:
        lines.append(f"- Goal <= {GOAL_1024_S} s at 1024 GPUs: not measured in this run")
    return lines


def calibration_s() -> float:
    """Median seconds of three runs of a plain Python loop: the machine's speed just now."""
    times_s = []
    for _ in range(3):
        started, total = time.perf_counter(), 0
        for i in range(CALIBRATION_LOOPS):
            total += i * i
        times_s.append(time.perf_counter() - started)
    return statistics.median(times_s)


def machine_line(before_s: float, after_s: float) -> str:
    return (
        f"- Machine speed: a plain Python loop ({CALIBRATION_LOOPS:,} steps) took "
        f"{before_s:.3f} s before the cells and {after_s:.3f} s after them "
        f"({QUIET_CALIBRATION_S} s when the host is quiet; the cells' times move with it)"
    )


def update_results(
    table: str,
    random_table: str,
    goals: list[str],
    random_goals: list[str],
    repeats: int,
    command: str,
) -> None:
    """Replace this benchmark's sections of RESULTS.md (between their markers), or append
    them: the grid's (`planner_scaling`) where the grid was timed, the random clusters'
    (`planner_scaling_random`) where they were, each with its own goal lines; a run that
    leaves one out leaves its section as it was."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    timing = (
        f"median of {repeats} runs after one warm-up per cluster ({os.cpu_count()} CPU "
        f"cores, {platform.machine()}, Python {platform.python_version()}; {date})"
    )
    produced = ["", f"Produced by `{command}`."]
    if table:
        lines = ["## Planner scaling", "", GRID_INTRO % timing, "", table, "", *goals]
        replace_section("planner_scaling", "\n".join([*lines, *produced]))
    if random_table:
        lines = [RANDOM_TITLE, "", f"Default `plan_search`, {timing}.", "", random_table, ""]
        replace_section("planner_scaling_random", "\n".join([*lines, *random_goals, *produced]))


GRID_INTRO = (
    "Default `plan_search` (screened short list + local stage + polish below 512 devices + "
    "baselines), %s. Nodes of 8 GPUs, or of 4 / 2 where 8 would leave a type out (marked "
    f"n/node), types round-robin by node from {', '.join(GPU_CYCLE)}; {INTER_NODE_GBPS:g} "
    f"GB/s between nodes, node0-node1 {SLOW_PAIR_GBPS:g} GB/s. Llama-3-8B at 1M tokens "
    '(512K where marked), datasheet cost model. "first run s" is the warm-up search '
    "(ring-order cache empty)."
)
RANDOM_TITLE = "## Planner scaling: plan_quality's random clusters"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_SIZES} GPUs x {QUICK_TYPE_COUNTS} types, {QUICK_REPEATS} repeats",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", choices=SIZES, metavar="GPUS", help=f"from {SIZES}"
    )
    parser.add_argument(
        "--types",
        type=int,
        nargs="+",
        choices=TYPE_COUNTS,
        metavar="K",
        help=f"from {TYPE_COUNTS}",
    )
    random = parser.add_mutually_exclusive_group()
    random.add_argument(
        "--no-random", action="store_true", help="leave plan_quality.py's random clusters out"
    )
    random.add_argument(
        "--random-only", action="store_true", help="time plan_quality.py's random clusters only"
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    type_counts = args.types or (QUICK_TYPE_COUNTS if args.quick else TYPE_COUNTS)
    repeats = QUICK_REPEATS if args.quick else REPEATS
    # Imports (Optuna, SciPy's HiGHS) load on the first search: pay for them outside any cell.
    timed_search(Cluster.from_dict(_import_warmup_cluster()), "64K")
    before_s = calibration_s()
    cells = []
    for gpus in sorted(sizes) if not args.random_only else ():
        for type_count in sorted(type_counts):
            cells.append(measure_cell(gpus, type_count, repeats))
            print(f"measured {gpus} GPUs x {type_count} types", file=sys.stderr, flush=True)
    with_random = args.random_only or not (args.quick or args.no_random)
    random_results = measure_random(repeats) if with_random else []
    table = format_table(cells) if cells else ""
    random_table = format_random_table(random_results) if random_results else ""
    machine = machine_line(before_s, calibration_s())
    goals = [*check_goals(cells), machine] if cells else []
    random_goals = [check_random_goal(random_results), machine] if random_results else []
    print(table, random_table, *dict.fromkeys([*goals, *random_goals]), sep="\n")
    if not args.no_write:
        command = shlex.join([".venv/bin/python", "benchmarks/planner_scaling.py", *argv])
        update_results(table, random_table, goals, random_goals, repeats, command)
    return 0


def _import_warmup_cluster() -> dict:
    """A small cluster no cell uses, so the warm-up fills no cell's caches."""
    nodes = [{"name": f"w{i}", "gpu": GPU_CYCLE[i % 2], "count": 4} for i in range(2)]
    return {"name": "import-warmup", "nodes": nodes, "network": {"inter_node_GBps": 50}}


if __name__ == "__main__":
    sys.exit(main())
