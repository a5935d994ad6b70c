"""Where do data-parallel replicas beat one CP-HP mesh over the whole cluster? (issue 15)

For each cluster, model and sequence length, a step of BATCH sequences: the best plan of one
mesh taking them one after another (`plan_search(..., micro_batches=BATCH,
data_parallel=False)`) and the best plan the default search returns, which may split the
cluster by nodes into replicas sharing the batch (each GPU type's nodes cut into replicas of
its own size, each its own mesh on its own share of the sequences, gradients reduced across
replicas). Throughput is the simulator's (datasheet cost model); "-" where no plan of that
kind fits.

Then the planner at internet scale: 16,384 GPUs of four types (512 nodes of 8 each) and a
batch of 4,096 sequences of 32K tokens, planned as replicas (each mesh once per node shape;
one mesh over them is not planned): the median wall time of REPEATS warm searches.

Run: `.venv/bin/python benchmarks/replicas.py [--no-write]` (prints the table and updates
the "Replicas vs one mesh" section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

from _results import replace_section

from hexiseq import Cluster, InfeasibleError, plan_search

CASES = [
    ("mix4-32", "llama3.2-3b"),
    ("mix4-128", "llama3.2-3b"),
    ("mix2-128", "llama3-8b"),
    ("h100x8-a100x24", "llama-30b"),
    ("mix4-128", "llama3-70b"),
]
SEQ_LENS = ("32k", "128k", "512k")
BATCH = 32
REPEATS = 3


def internet_scale() -> tuple[float, int, int]:
    """Median seconds to plan 16,384 mixed GPUs, the plan's replicas and ranks."""
    types = ("H200", "H100-SXM", "A100-80G", "L40S")
    nodes = [{"name": f"{g.lower()}-{i}", "gpu": g, "count": 8} for g in types for i in range(512)]
    network = {"inter_node_GBps": 25, "inter_node_latency_us": 5}
    cluster = Cluster.from_dict({"name": "mix4-16384", "nodes": nodes, "network": network})
    walls = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        plan = plan_search(cluster, "llama3.2-3b", "32k", micro_batches=4096).best
        walls.append(time.perf_counter() - started)
    return statistics.median(walls), len(plan.replicas), plan.cluster.world_size


def best(cluster: str, model: str, seq_len: str, data_parallel: bool):
    """The best plan and the search's wall seconds (None for the plan where none fits)."""
    started = time.perf_counter()
    try:
        plan = plan_search(
            cluster, model, seq_len, micro_batches=BATCH, data_parallel=data_parallel
        ).best
    except InfeasibleError:
        plan = None
    return plan, time.perf_counter() - started


def row(cluster: str, model: str, seq_len: str) -> list[str]:
    mesh, mesh_s = best(cluster, model, seq_len, False)
    chosen, chosen_s = best(cluster, model, seq_len, True)
    mesh_rate = mesh.predicted.tokens_per_s if mesh else None
    rate = chosen.predicted.tokens_per_s if chosen else None
    replicas = len(chosen.replicas) if chosen else 0
    winner = "-" if chosen is None else ("replicas" if chosen.data_parallel else "one mesh")
    gain = f"{rate / mesh_rate:.2f}x" if rate and mesh_rate else "-"
    return [
        cluster,
        model,
        seq_len,
        f"{mesh_rate:,.0f}" if mesh_rate else "-",
        f"{rate:,.0f}" if rate else "-",
        gain,
        winner,
        str(replicas),
        " ".join(str(r.sequences) for r in chosen.replicas) if chosen else "-",
        f"{mesh_s:.2f} / {chosen_s:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    headers = [
        "cluster", "model", "seq", "one mesh tokens/s", "default tokens/s", "gain", "picked",
        "replicas", "sequences per replica", "search s (mesh / default)",
    ]  # fmt: skip
    rows = [row(c, m, s) for c, m in CASES for s in SEQ_LENS]
    scale_s, replicas, ranks = internet_scale()
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = "\n".join(
        [
            "## Replicas vs one mesh",
            "",
            f"`.venv/bin/python benchmarks/replicas.py` ({stamp}, {platform.machine()}, "
            f"datasheet cost model; simulated throughput, not measured; a step of {BATCH} "
            "sequences).",
            "",
            *lines,
            "",
            f"16,384 GPUs (4 types x 512 nodes x 8), llama3.2-3b, 32K tokens, a batch of 4,096: "
            f"planned in {scale_s:.2f} s (median of {REPEATS} warm runs; goal 5 s) as "
            f"{replicas:,} replicas over {ranks:,} ranks.",
        ]
    )
    print(body)
    if not args.no_write:
        replace_section("replicas", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
