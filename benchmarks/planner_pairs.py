"""Paired A/B of the default `plan_search` on plan_quality.py's 20 random clusters.

`planner_ab.py` alternates two trees round by round, a fresh process per tree each round: a
round is minutes long, and this machine's host speed moves by 2x within minutes, so a small
change drowns in it. Here one long-lived process per tree (this tree and a git worktree of
`--baseline`, imported as `planner_ab` does) searches cluster after cluster, the two taking
turns search by search (the order swapped every other search), so each pair of searches of
one cluster ran within a second of each other. A cluster's time per tree is the median of
`--rounds` searches (after one warm-up search of every cluster); the table gives both, the
change, and whether the best plans run equally fast. `--helper off` keeps each search in its
process (`HEXISEQ_SEARCH_HELPER=off`) and times its CPU seconds; `--helper on` (the default
search) times wall seconds, its helper process included.

Run: `.venv/bin/python benchmarks/planner_pairs.py --baseline REV [--rounds 5]
[--helper on|off] [--no-write]` (prints the table and writes it into the "Planner pairs"
section of RESULTS.md unless `--no-write`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import replace_section
from planner_ab import REPO, _TreeFinder, baseline_worktree, provenance
from planner_scaling import calibration_s, machine_line

CLUSTERS = 20
SEED = 2024


def serve(tree: Path, helper: str) -> None:
    """A worker: import hexiseq from `tree`, warm every cluster up, then search the cluster
    each line of stdin names, answering [seconds, best tokens/s] as JSON."""
    os.environ["HEXISEQ_SEARCH_HELPER"] = helper
    sys.meta_path.insert(0, _TreeFinder(tree))
    import plan_quality

    from hexiseq import plan_search

    cases, _ = plan_quality.draw_cases(CLUSTERS, SEED)
    for case in cases:
        plan_search(case.cluster, case.model, case.seq_len)
    clock = time.process_time if helper == "off" else time.perf_counter
    print("ready", flush=True)
    for line in sys.stdin:
        case = cases[int(line)]
        started = clock()
        result = plan_search(case.cluster, case.model, case.seq_len)
        print(json.dumps([clock() - started, result.best.predicted.tokens_per_s]), flush=True)


def run_pairs(trees: list[Path], rounds: int, helper: str) -> list[list[list[tuple]]]:
    """[tree][cluster] the (seconds, tokens/s) of each round."""
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", str(tree), "--helper", helper],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tree in trees
    ]
    try:
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit("a worker did not start (see its error above)")
        found = [[[] for _ in range(CLUSTERS)] for _ in trees]
        for round_ in range(rounds):
            for index in range(CLUSTERS):
                order = (0, 1) if (round_ + index) % 2 == 0 else (1, 0)
                for tree in order:
                    workers[tree].stdin.write(f"{index}\n")
                    workers[tree].stdin.flush()
                    found[tree][index].append(tuple(json.loads(workers[tree].stdout.readline())))
        return found
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait()


def format_table(found: list[list[list[tuple]]], unit: str) -> str:
    lines = [
        f"| # | baseline {unit} s | this tree {unit} s | change | best plan |",
        "|---:|---:|---:|---:|---|",
    ]
    sums, ratios = [0.0, 0.0], []
    for index in range(CLUSTERS):
        medians = [statistics.median(s for s, _ in tree[index]) for tree in found]
        plans = {round(tokens, 6) for tree in found for _, tokens in tree[index]}
        same = "same" if len(plans) == 1 else "differs"
        sums = [total + m for total, m in zip(sums, medians)]
        ratios.append(medians[1] / medians[0])
        change = 100 * (medians[1] / medians[0] - 1)
        lines.append(
            f"| {index} | {medians[0]:.3f} | {medians[1]:.3f} | {change:+.1f} % | {same} |"
        )
    faster = sum(ratio < 1 for ratio in ratios)
    lines.append(
        f"| sum | {sums[0]:.3f} | {sums[1]:.3f} | {100 * (sums[1] / sums[0] - 1):+.1f} % | "
        f"median ratio {statistics.median(ratios):.3f}, {faster} of {CLUSTERS} faster |"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="the revision to compare against (git rev)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--helper", choices=("on", "off"), default="on")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # a worker process: its tree
    args = parser.parse_args(argv)
    if args.serve is None and not args.baseline:
        parser.error("--baseline is required")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        serve(Path(args.serve), args.helper)
        return 0
    before_s = calibration_s()
    with baseline_worktree(args.baseline) as (revision, worktree):
        found = run_pairs([worktree, REPO], args.rounds, args.helper)
    unit = "CPU" if args.helper == "off" else "wall"
    table = format_table(found, unit) + "\n\n" + machine_line(before_s, calibration_s())
    print(table)
    if not args.no_write:
        head, stamp, command = provenance("planner_pairs.py")
        helper = "helper off, CPU seconds" if args.helper == "off" else "helper on, wall seconds"
        replace_section(
            f"planner_pairs_{args.helper}",
            f"## Planner pairs ({helper})\n\n"
            f"Default `plan_search` on plan_quality.py's {CLUSTERS} random clusters (seed "
            f"{SEED}), this tree ({head}) against {revision}: one process per tree, the "
            "two taking turns search by search; a cluster's time is the median of "
            f'{args.rounds} searches after one warm-up (2 CPU cores, {stamp}). "best plan": '
            "whether every search of both trees found a plan of the same throughput.\n\n"
            f"{table}\n\nProduced by `{command}`.",
        )
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
