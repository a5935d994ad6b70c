"""Where do data-parallel replicas beat one CP-HP mesh over the whole cluster? (issue 15)

For each cluster, model and sequence length: the best plan of one mesh
(`plan_search(..., data_parallel=False)`) and the best plan the default search returns,
which may split the cluster by nodes into replicas (each GPU type's nodes cut into replicas of
its own size, each its own mesh on its own sequences per step, gradients reduced across
replicas). Throughput is the simulator's (datasheet cost model), so is the step; "seq/step"
is the whole step's batch (a mesh takes one sequence). "-" where no plan of that kind fits.

Run: `.venv/bin/python benchmarks/replicas.py [--no-write]` (prints the table and updates
the "Replicas vs one mesh" section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone

from _results import replace_section

from hexiseq import InfeasibleError, plan_search

CASES = [
    ("mix4-32", "llama3.2-3b"),
    ("mix4-128", "llama3.2-3b"),
    ("mix2-128", "llama3-8b"),
    ("h100x8-a100x24", "llama-30b"),
    ("mix4-128", "llama3-70b"),
]
SEQ_LENS = ("32k", "128k", "512k")


def best(cluster: str, model: str, seq_len: str, data_parallel: bool):
    """The best plan and the search's wall seconds (None for the plan where none fits)."""
    started = time.perf_counter()
    try:
        plan = plan_search(cluster, model, seq_len, data_parallel=data_parallel).best
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
        str(chosen.train.micro_batches) if chosen else "-",
        f"{mesh_s:.2f} / {chosen_s:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    headers = [
        "cluster", "model", "seq", "one mesh tokens/s", "default tokens/s", "gain", "picked",
        "replicas", "seq/step", "search s (mesh / default)",
    ]  # fmt: skip
    rows = [row(c, m, s) for c, m in CASES for s in SEQ_LENS]
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
            "datasheet cost model; simulated throughput, not measured).",
            "",
            *lines,
        ]
    )
    print(body)
    if not args.no_write:
        replace_section("replicas", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
