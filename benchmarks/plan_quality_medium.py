"""How close the default search comes to a long Optuna search on clusters of 24-64 GPUs.

`plan_quality.py` checks small clusters (up to 12 GPUs, against the exhaustive optimum) and one
128-GPU cluster. Between them the polish's cap on full evaluations (`polish_evaluations`: 12 at
32 GPUs, 6 at 64) and the screen's estimates decide the plan, and the space is too large to
enumerate. Here each cluster's default `plan_search` is set against `plan_search(...,
n_trials=TRIALS, seed=0)` (the short list, then Optuna's trials, then the same polish):

- the 8 planner-scaling cells of 32 and 64 GPUs (`planner_scaling.build_cluster`: 1, 2, 4, 8
  types round-robin by node, one slower link), Llama-3-8B at 1M tokens (512K where nothing
  fits);
- RANDOM_COUNT random clusters (seed SEED) of 24-64 GPUs in nodes of 4 or 8, 2-4 GPU types,
  25-100 GB/s, a random model and length (falling back to shorter lengths where nothing fits).

Gap = 1 - default / best, best being the faster of the two searches' plans. Every number is a
prediction of the datasheet cost model, not a measurement.

Run: `.venv/bin/python benchmarks/plan_quality_medium.py [--trials N] [--no-write]` (prints the
table and updates the "Plan quality, 24-64 GPUs" section of benchmarks/RESULTS.md unless
`--no-write`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass

from _results import cpu_seconds, replace_section
from plan_quality import GPU_TYPES, describe_plan
from planner_scaling import build_cluster

from hexiseq import Cluster, InfeasibleError, plan_search

MODELS = ("llama3-8b", "llama2-7b", "llama3.2-3b")
SEQ_LENS = ("1M", "512K", "256K", "128K")
SCALING_CELLS = ((32, 1), (32, 2), (32, 4), (32, 8), (64, 1), (64, 2), (64, 4), (64, 8))
RANDOM_COUNT, SEED, TRIALS = 12, 7, 300
GAP_GOAL = 0.01


@dataclass(frozen=True)
class MediumCase:
    """A cluster, its model and the sequence lengths to try, longest first."""

    name: str
    cluster: Cluster
    model: str
    seq_lens: tuple[str, ...]


@dataclass(frozen=True)
class MediumResult:
    case: MediumCase
    seq_len: str
    default_tokens_per_s: float
    default_plan: str
    searched_tokens_per_s: float
    searched_plan: str

    @property
    def gap(self) -> float:
        best = max(self.default_tokens_per_s, self.searched_tokens_per_s)
        return 1.0 - self.default_tokens_per_s / best


def draw_cluster(rng: random.Random, index: int) -> Cluster:
    """24-64 GPUs in nodes of 4 or 8, 2-4 types (each on some node), one network speed."""
    per_node = rng.choice([4, 8])
    node_count = rng.choice([24, 32, 40, 48, 64]) // per_node
    types = rng.sample(GPU_TYPES, min(node_count, rng.choice([2, 3, 4])))
    gpus = types + [rng.choice(types) for _ in range(node_count - len(types))]
    nodes = [{"name": f"n{i}", "gpu": gpu, "count": per_node} for i, gpu in enumerate(gpus)]
    network = {"inter_node_GBps": rng.choice([25, 50, 100])}
    return Cluster.from_dict({"name": f"medium-{index}", "nodes": nodes, "network": network})


def describe_cluster(cluster: Cluster) -> str:
    """GPUs per type (in node order), the node size, and the links."""
    per_type: dict[str, int] = {}
    for node in cluster.nodes:
        per_type[node.gpu] = per_type.get(node.gpu, 0) + node.count
    types = ", ".join(f"{count}x{gpu}" for gpu, count in per_type.items())
    links = f"{cluster.inter_node_GBps:g}"
    links += "".join(f", {a}-{b} {g:g}" for a, b, g in cluster.overrides)
    return f"{types} in nodes of {cluster.nodes[0].count} ({links} GB/s)"


def cases(random_count: int = RANDOM_COUNT, seed: int = SEED) -> list[MediumCase]:
    found = [
        MediumCase(
            f"scaling {gpus}x{types}", build_cluster(gpus, types), "llama3-8b", ("1M", "512K")
        )
        for gpus, types in SCALING_CELLS
    ]
    rng = random.Random(seed)
    for index in range(random_count):
        cluster = draw_cluster(rng, index)
        model, longest = rng.choice(MODELS), rng.randrange(len(SEQ_LENS) - 1)
        found.append(MediumCase(f"random {index}", cluster, model, SEQ_LENS[longest:]))
    return found


def run_case(case: MediumCase, trials: int) -> MediumResult | None:
    """Both searches at the longest length a plan fits (None: none fits)."""
    for seq_len in case.seq_lens:
        try:
            default = plan_search(case.cluster, case.model, seq_len).best
        except InfeasibleError:
            continue
        searched = plan_search(case.cluster, case.model, seq_len, n_trials=trials, seed=0).best
        return MediumResult(
            case,
            seq_len,
            default.predicted.tokens_per_s,
            describe_plan(default),
            searched.predicted.tokens_per_s,
            describe_plan(searched),
        )
    return None


def _run(job: tuple[MediumCase, int]) -> MediumResult | None:
    return run_case(*job)


def run_cases(found: list[MediumCase], trials: int, processes: int) -> list:
    jobs = [(case, trials) for case in found]
    if processes <= 1:
        return [_run(job) for job in jobs]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return list(pool.imap(_run, jobs, chunksize=1))


def table(results: list, trials: int) -> str:
    lines = [
        f"| cluster | GPUs | model @ length | default tokens/s | {trials} trials tokens/s "
        "| gap | default plan | long search's plan |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    for result in results:
        case = result.case
        lines.append(
            f"| {case.name}: {describe_cluster(case.cluster)} | {case.cluster.world_size} | "
            f"{case.model} @ {result.seq_len} | {result.default_tokens_per_s:,.0f} | "
            f"{result.searched_tokens_per_s:,.0f} | {100 * result.gap:.2f} % | "
            f"{result.default_plan} | {result.searched_plan} |"
        )
    return "\n".join(lines)


def summary(results: list, skipped: list[str], trials: int) -> str:
    gaps = [r.gap for r in results]
    worst = max(range(len(results)), key=gaps.__getitem__)
    within = sum(g <= GAP_GOAL for g in gaps)
    line = (
        f"Default search within 1 % of {trials} Optuna trials on {within} of {len(results)} "
        f"clusters; worst gap {100 * gaps[worst]:.2f} % ({results[worst].case.name}), mean "
        f"{100 * sum(gaps) / len(gaps):.2f} %."
    )
    return line + (f" Nothing fits: {', '.join(skipped)}." if skipped else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    found = cases()
    done = run_cases(found, args.trials, args.processes)
    results = [r for r in done if r is not None]
    skipped = [case.name for case, r in zip(found, done) if r is None]
    body, line = table(results, args.trials), summary(results, skipped, args.trials)
    elapsed = time.perf_counter() - started
    print(body, "", line, f"wall time {elapsed:.0f} s, CPU time {cpu_seconds():.0f} s", sep="\n")
    if not args.no_write:
        replace_section("plan_quality_medium", section(body, line, elapsed, argv))
    return 0


def section(body: str, line: str, elapsed: float, argv) -> str:
    command = shlex.join([".venv/bin/python", "benchmarks/plan_quality_medium.py", *(argv or [])])
    machine = (
        f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"
    )
    return "\n".join(
        [
            "## Plan quality, 24-64 GPUs: default search vs a long Optuna search",
            "",
            "Predictions of the datasheet cost model (**datasheet estimate**). Gap = 1 - default "
            "/ the faster of the two plans. Between `plan_quality`'s small clusters and its "
            "128-GPU one, where the polish's cap on full evaluations is 12 (32 GPUs) to 6 (64).",
            "",
            body,
            "",
            line,
            "",
            f"Produced by `{command}` on {machine}; the run took {elapsed:.0f} s wall, "
            f"{cpu_seconds():.0f} s of CPU in all its processes.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
