"""How fast `simulate_step` predicts one step on large mixed clusters.

The plan search calls the simulator for every candidate, on clusters of up to 1024 GPUs and
up to one HP group per GPU, so its wall time bounds how many candidates a search can try.
Clusters: nodes of 8 GPUs, H100-SXM / A100-80G / L40S / RTX-4090 alternating by node,
50 GB/s between nodes; Llama-3-8B at 1M tokens; uniform and uneven zigzag layouts.

Besides, the simulations a search really asks for: every `simulate_step` call of the default
searches of plan_quality.py's 20 random clusters (seed 2024; 5-12 GPUs, helper process off),
recorded and replayed in order, each search's with a fresh `shared` dict as the search starts
with (its tables of layout structures fill up as they would in the search).

Run: `.venv/bin/python benchmarks/simulator_speed.py` (prints a table and updates the
"Step simulator speed" section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time

import numpy as np
from _results import replace_section
from planner_scaling import calibration_s, machine_line

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout, build_zigzag_layout
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.layout import AttentionLayout, zigzag_segment_lengths

GPU_CYCLE = ("H100-SXM", "A100-80G", "L40S", "RTX-4090")
GPUS_PER_NODE = 8
SEQ_LEN = 1 << 20
REPEATS = 5
# (GPUs, ranks per HP group, target median ms): the plan search's budget per simulation.
CASES = ((128, 8, 5.0), (1024, 8, 40.0), (1024, 1, 300.0))


def mixed_cluster(gpus: int) -> Cluster:
    """`gpus` GPUs in nodes of 8, the GPU model changing from node to node."""
    nodes = [
        {"name": f"node{i}", "gpu": GPU_CYCLE[i % len(GPU_CYCLE)], "count": GPUS_PER_NODE}
        for i in range(gpus // GPUS_PER_NODE)
    ]
    return Cluster.from_dict(
        {"name": f"mixed-{gpus}", "nodes": nodes, "network": {"inter_node_GBps": 50}}
    )


def uneven_layout(model: ModelSpec, gpus: int, group_size: int, seed: int) -> AttentionLayout:
    """A zigzag layout with random segment weights, token weights and head counts."""
    rng = random.Random(seed)
    groups = [list(range(g, g + group_size)) for g in range(0, gpus, group_size)]
    segments = zigzag_segment_lengths(SEQ_LEN, [rng.uniform(0.5, 2.0) for _ in groups])
    token_weights = [[rng.uniform(0.5, 2.0) for _ in members] for members in groups]
    head_counts = [_random_split(rng, model.heads, len(members)) for members in groups]
    return build_zigzag_layout(
        SEQ_LEN, model.heads, model.kv_heads, groups, segments, token_weights, head_counts
    )


def _random_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def median_ms(cluster: Cluster, model: ModelSpec, layout: AttentionLayout) -> float:
    """Median wall time of `REPEATS` simulations, in milliseconds."""
    train, cost = TrainSpec(seq_len=SEQ_LEN), DatasheetCostModel()
    simulate_step(cluster, model, train, layout, cost)  # warm-up: imports, catalog cache
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        simulate_step(cluster, model, train, layout, cost)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure() -> list[tuple[int, int, str, float, float]]:
    """(GPUs, groups, layout kind, median ms, target ms) for every case."""
    model = ModelSpec.preset("llama3-8b")
    rows = []
    for gpus, group_size, target_ms in CASES:
        cluster = mixed_cluster(gpus)
        uniform = build_uniform_layout(
            SEQ_LEN, model.heads, model.kv_heads, [group_size] * (gpus // group_size)
        )
        uneven = uneven_layout(model, gpus, group_size, seed=gpus + group_size)
        for kind, layout in (("uniform", uniform), ("uneven zigzag", uneven)):
            ms = median_ms(cluster, model, layout)
            rows.append((gpus, len(layout.groups), kind, ms, target_ms))
    return rows


def search_replay() -> tuple[int, float]:
    """(simulations, median ms per simulation over `REPEATS` replays) of the default
    searches of plan_quality.py's 20 random clusters (module doc)."""
    os.environ["HEXISEQ_SEARCH_HELPER"] = "off"  # every simulation in this process
    import plan_quality

    import hexiseq.search._evaluate as evaluate
    from hexiseq import plan_search

    calls, simulate = [], evaluate.simulate_step

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return simulate(*args, **kwargs)

    cases, _ = plan_quality.draw_cases(20, 2024)
    evaluate.simulate_step = recorded
    try:
        for case in cases:
            plan_search(case.cluster, case.model, case.seq_len)
    finally:
        evaluate.simulate_step = simulate
    per_simulation_ms = []
    for _ in range(REPEATS + 1):  # the first a warm-up
        fresh: dict[int, dict] = {}  # a search's shared dict -> this replay's
        replayed = [
            (args, {**kwargs, "shared": fresh.setdefault(id(kwargs["shared"]), {})})
            for args, kwargs in calls
        ]
        started = time.perf_counter()
        for args, kwargs in replayed:
            simulate(*args, **kwargs)
        per_simulation_ms.append((time.perf_counter() - started) * 1e3 / len(calls))
    return len(calls), statistics.median(per_simulation_ms[1:])


def format_table(rows: list[tuple[int, int, str, float, float]]) -> str:
    lines = ["| GPUs | HP groups | layout | median ms | target ms |", "|---:|---:|---|---:|---:|"]
    lines += [
        f"| {gpus} | {groups} | {kind} | {ms:.1f} | {target:.0f} |"
        for gpus, groups, kind, ms, target in rows
    ]
    return "\n".join(lines)


def format_replay(simulations: int, ms: float) -> str:
    return (
        f"The default searches of plan_quality.py's 20 random clusters (seed 2024): "
        f"{simulations} simulations, replayed in {ms:.2f} ms each (median of {REPEATS} "
        "replays after one warm-up)."
    )


def update_results(table: str) -> None:
    """Replace this benchmark's section of RESULTS.md (between its markers), or append it."""
    section = "\n".join(
        [
            "## Step simulator speed",
            "",
            f"`simulate_step`, median of {REPEATS} runs after one warm-up "
            f"({os.cpu_count()} CPU cores, {platform.machine()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}). "
            "Mixed clusters of 8-GPU nodes (H100-SXM / A100-80G / L40S / RTX-4090 by node), "
            "Llama-3-8B, 1M tokens, datasheet cost model.",
            "",
            table,
            "",
            "Produced by `.venv/bin/python benchmarks/simulator_speed.py`.",
        ]
    )
    replace_section("simulator_speed", section)


def main() -> int:
    before_s = calibration_s()
    table = format_table(measure()) + "\n\n" + format_replay(*search_replay())
    table += "\n\n" + machine_line(before_s, calibration_s())
    print(table)
    update_results(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
