"""What a user waits for: the README's first command, `hexiseq plan`, from a cold start.

`plan_search` in a warm process is what planner_scaling.py times; the command a user types
also starts Python, imports hexiseq (the cost models, the store, the search), opens the store
and saves the plan. This script runs the README's first command (16 GPUs, llama-30b, 256K)
in a fresh process per run, this tree against an earlier revision (a temporary git worktree,
as planner_ab.py does), the two alternating run by run, each with its own store already at
the newest schema (one warm-up run each: the steady state of a user's second command). A
run's phases are timed inside it: importing the CLI, opening the store, the search (its
imports included) and the rest (loading the cluster and model, saving, printing); the
command's wall time, interpreter start and exit included, is timed around it.

Run: `.venv/bin/python benchmarks/cli_latency.py --baseline REV [--runs 9]`. Prints the table
and writes it into the "CLI latency" section of RESULTS.md unless `--no-write`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import replace_section
from planner_ab import _TreeFinder, baseline_worktree, provenance

REPO = Path(__file__).resolve().parent.parent
COMMAND = ["plan", "--cluster", "h100x8-a100x8", "--model", "llama-30b", "--seq-len", "256k"]
PHASES = ("import_s", "store_s", "search_s", "rest_s")


def measure(tree: Path, store_url: str) -> dict:
    """In a fresh process: run `hexiseq` COMMAND with hexiseq imported from `tree`; the
    seconds of each phase (PHASES)."""
    started = time.perf_counter()
    sys.meta_path.insert(0, _TreeFinder(tree))
    import hexiseq
    from hexiseq import cli
    from hexiseq.cli import plan as cli_plan

    imported = time.perf_counter()
    if not Path(hexiseq.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"hexiseq came from {hexiseq.__file__}, not from {tree}")
    spent = {"store_s": 0.0, "search_s": 0.0}
    for name, phase in (("_open_store", "store_s"), ("_search", "search_s")):
        setattr(cli_plan, name, _timed(getattr(cli_plan, name), spent, phase))
    sys.argv = ["hexiseq", *COMMAND, "--store", store_url]
    with contextlib.redirect_stdout(io.StringIO()):
        code = getattr(cli, "console", cli.main)()  # as the console script runs it
    if code:
        raise SystemExit(f"hexiseq {shlex.join(COMMAND)} exited {code}")
    ended = time.perf_counter()
    rest_s = ended - imported - spent["store_s"] - spent["search_s"]
    return {"import_s": imported - started, **spent, "rest_s": rest_s}


def _timed(real, spent: dict, phase: str):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - started

    return timed


def one_run(tree: Path, store_url: str) -> dict:
    """A fresh process's phases and its command's wall time (`command_s`)."""
    command = [sys.executable, __file__, "--measure", str(tree), "--store", store_url]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall_s = time.perf_counter() - started
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"running {tree}: {last}")
    return {"command_s": wall_s, **json.loads(done.stdout.splitlines()[-1])}


def run_alternating(trees: dict[str, Path], scratch: Path, runs: int) -> dict:
    """{tree name: [per-run results]}, one warm-up run each (it makes the store), then the
    trees alternating run by run."""
    stores = {name: f"sqlite:///{scratch / f'{name}.db'}" for name in trees}
    for name, tree in trees.items():
        one_run(tree, stores[name])
    results: dict = {name: [] for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            results[name].append(one_run(tree, stores[name]))
    return results


def format_table(results: dict, labels: dict[str, str]) -> str:
    lines = [
        "| tree | command s | import s | store open s | search s (imports in) | rest s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        cells = [statistics.median(r[key] for r in runs) for key in ("command_s", *PHASES)]
        lines.append(f"| {labels[name]} | " + " | ".join(f"{s:.3f}" for s in cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="revision to compare against")
    parser.add_argument("--runs", type=int, default=9, help="runs per tree (default 9)")
    parser.add_argument("--no-write", action="store_true", help="leave RESULTS.md alone")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(Path(args.measure), args.store)))
        return 0
    head, stamp, command = provenance("cli_latency.py")
    with baseline_worktree(args.baseline) as (revision, worktree):
        labels = {"baseline": revision, "this": f"this tree ({head})"}
        trees = {"baseline": worktree, "this": REPO}
        with tempfile.TemporaryDirectory() as stores:
            results = run_alternating(trees, Path(stores), args.runs)
    table = format_table(results, labels)
    print(table)
    if not args.no_write:
        replace_section(
            "cli_latency",
            "## CLI latency: the README's first command, cold\n\n"
            f"`hexiseq {shlex.join(COMMAND)}` in a fresh process, median of {args.runs} "
            f"runs per tree, the trees alternating run by run, each with its own store at the "
            f"newest schema (2 CPU cores, {stamp}). Phases are timed inside the process; "
            "the command's wall time also holds the interpreter's start and exit.\n\n"
            f"{table}\n\nProduced by `{command}`.",
        )
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
