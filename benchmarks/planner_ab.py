"""Interleaved A/B of the default `plan_search`: this tree against an earlier revision.

The 2-core machine's speed drifts by 10-15 % from one hour to the next, so two
planner_scaling runs taken at different times say little about a change. This script checks
the earlier revision out into a temporary git worktree, imports hexiseq from there (the
package-dir mapping of pyproject.toml), and alternates the two trees round by round, each
round a fresh process per tree. A cell's time is the median wall time of `--repeats`
searches after one warm-up (planner_scaling's clusters, Llama-3-8B at 1M tokens, 512K where
nothing fits); the table gives each tree's median over the rounds, the change, and whether
the two trees' best plans run equally fast, and the part of a search that scores its short
list (from the short list found to the polish's start), and sums over the random clusters and
over the grid cells. Wall time, not this process's CPU time: a search
may send work to a helper process (`search.helper`; before it, a child forked for the
baselines, `search.beside`), whose CPU time the parent's would leave out, and the parent's
time blocked waiting for it too.

Run: `.venv/bin/python benchmarks/planner_ab.py --baseline REV [--rounds 3] [--repeats 5]
[CELL ...]` with cells as GPUSxTYPES (default: every cell of planner_scaling up to 128 GPUs),
or `randomN` for plan_quality.py's random cluster #N (seed 2024; its model and length).
Prints the table and writes it into the "Planner A/B" section of RESULTS.md unless
`--no-write`.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from _results import replace_section

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "profiler": "profiler",
    "costmodel": "costmodel",
    "search": "search",
    "runtime": "runtime",
    "dashboard": "dashboard",
}  # hexiseq.<name> -> its directory (pyproject.toml's package-dir)
DEFAULT_CELLS = [f"{g}x{t}" for g in (16, 32, 64, 128) for t in (1, 2, 4, 8)]


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Imports `hexiseq` and its sub-packages from another checkout of this repository."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path, target=None):
        parts = name.split(".")
        if parts[0] != "hexiseq":
            return None
        if len(parts) >= 2 and parts[1] in PACKAGE_DIRS:
            where = self.root.joinpath(PACKAGE_DIRS[parts[1]], *parts[2:])
        else:
            where = self.root.joinpath(*parts)
        if where.is_dir():
            return importlib.util.spec_from_file_location(
                name, where / "__init__.py", submodule_search_locations=[str(where)]
            )
        if where.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None


def measure(tree: Path, cells: list[str], repeats: int) -> dict:
    """{cell: {"seconds": median wall time, "tokens_per_s": the best plan's}} with
    hexiseq imported from `tree`."""
    sys.meta_path.insert(0, _TreeFinder(tree))  # so both imports take `tree`'s hexiseq
    from planner_scaling import MODEL, SEQ_LENS, build_cluster

    import hexiseq

    if not Path(hexiseq.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"hexiseq came from {hexiseq.__file__}, not from {tree}")
    marks = _scoring_marks()
    found = {}
    for cell in cells:
        if cell.startswith(RANDOM):
            case = _random_case(int(cell.removeprefix(RANDOM)))
            cluster, model, seq_lens = case.cluster, case.model, (case.seq_len,)
        else:
            gpus, types = (int(part) for part in cell.split("x"))
            cluster, model, seq_lens = build_cluster(gpus, types), MODEL, SEQ_LENS
        seq_len, result = _fitting_search(hexiseq, cluster, model, seq_lens)
        seconds, scoring = [], []
        for _ in range(repeats):
            marks.clear()
            started = time.perf_counter()
            hexiseq.plan_search(cluster, model, seq_len)
            seconds.append(time.perf_counter() - started)
            if {"found", "polished"} <= set(marks):
                scoring.append(marks["polished"] - marks["found"])
        found[cell] = {
            "seconds": statistics.median(seconds),
            "scoring_s": statistics.median(scoring) if scoring else None,
            "tokens_per_s": result.best.predicted.tokens_per_s,
        }
    return found


def _scoring_marks() -> dict:
    """Note when the search's short list is found and when its polish starts (between the
    two the short list is scored), where the tree has them (`optuna_layer.shortlist` and
    `_polish`): {"found": perf_counter, "polished": perf_counter}, set anew each search."""
    from hexiseq.search import optuna_layer

    marks: dict = {}
    for name, mark, after in (("shortlist", "found", True), ("_polish", "polished", False)):
        real = getattr(optuna_layer, name, None)
        if real is not None:
            setattr(optuna_layer, name, _marking(real, marks, mark, after))
    return marks


def _marking(real, marks: dict, mark: str, after: bool):
    def marked(*args, **kwargs):
        if not after:
            marks[mark] = time.perf_counter()
        value = real(*args, **kwargs)
        if after:
            marks[mark] = time.perf_counter()
        return value

    return marked


RANDOM = "random"  # a cell of plan_quality.py's random clusters: random0 ... random19


def _random_case(index: int):
    """plan_quality.py's random case #`index` (seed 2024)."""
    from plan_quality import draw_cases

    return draw_cases(20, 2024)[0][index]


def _fitting_search(hexiseq, cluster, model: str, seq_lens: tuple[str, ...]):
    """The first sequence length a plan fits at, and that (warm-up) search's result."""
    for seq_len in seq_lens:
        try:
            return seq_len, hexiseq.plan_search(cluster, model, seq_len)
        except hexiseq.InfeasibleError:
            continue
    raise SystemExit(f"no plan fits {cluster.name} at {', '.join(seq_lens)}")


def run_rounds(baseline: Path, cells: list[str], rounds: int, repeats: int) -> dict:
    """{tree name: {cell: [per-round results]}}, the trees alternating round by round."""
    trees = dict(zip(TREES, (baseline, REPO)))
    results: dict = {name: {cell: [] for cell in cells} for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            command = [sys.executable, __file__, "--measure", str(tree)]
            command += ["--repeats", str(repeats), *cells]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise SystemExit(f"measuring {name} ({tree}) failed: {last}")
            for cell, found in json.loads(done.stdout.splitlines()[-1]).items():
                results[name][cell].append(found)
    return results


def format_table(results: dict, cells: list[str]) -> str:
    lines = [
        "| cell (GPUs x types) | baseline s | this tree s | change | short list scored, "
        "baseline -> this tree, ms | best plan tokens/s |",
        "|---|---:|---:|---:|---:|---|",
    ]
    sums: dict = {}
    for cell in cells:
        old, new = (_median(results[name][cell], "seconds") for name in TREES)
        old_scoring, new_scoring = (_median(results[name][cell], "scoring_s") for name in TREES)
        old_rate = results["baseline"][cell][0]["tokens_per_s"]
        new_rate = results["this tree"][cell][0]["tokens_per_s"]
        plan = "same" if old_rate == new_rate else f"{100 * (new_rate / old_rate - 1):+.2f} %"
        group = "random clusters" if cell.startswith(RANDOM) else "grid cells"
        total = sums.setdefault(group, [0, 0.0, 0.0, 0.0, 0.0])
        total[0] += 1
        total[1:] = [
            a + (b or 0.0) for a, b in zip(total[1:], (old, new, old_scoring, new_scoring))
        ]
        lines.append(
            f"| {cell} | {old:.3f} | {new:.3f} | {100 * (new / old - 1):+.1f} % | "
            f"{_ms(old_scoring)} -> {_ms(new_scoring)} | {plan} |"
        )
    for group, (count, old, new, old_scoring, new_scoring) in sums.items():
        change = f"{100 * (new_scoring / old_scoring - 1):+.1f} %" if old_scoring else "-"
        lines.append(
            f"| sum of {count} {group} | {old:.3f} | {new:.3f} | {100 * (new / old - 1):+.1f} % | "
            f"{_ms(old_scoring)} -> {_ms(new_scoring)} ({change}) | |"
        )
    return "\n".join(lines)


TREES = ("baseline", "this tree")


def _median(rounds: list[dict], what: str) -> float | None:
    values = [r[what] for r in rounds if r.get(what) is not None]
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="*", default=DEFAULT_CELLS)
    parser.add_argument("--baseline", help="the revision to compare against (git rev)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a round's worker process
    args = parser.parse_args(argv)
    if args.measure is None and not args.baseline:
        parser.error("give --baseline REV, the revision to compare this tree against")
    for cell in args.cells:
        gpus, _, types = cell.partition("x")
        index = cell.removeprefix(RANDOM)
        if cell.startswith(RANDOM) and index.isdigit() and int(index) < 20:
            continue
        if not (gpus.isdigit() and types.isdigit()):
            parser.error(
                f"cell {cell!r}: give GPUSxTYPES, as 16x4 (planner_scaling's cells), or "
                "randomN, N from 0 to 19 (plan_quality.py's random clusters)"
            )
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats take 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(Path(args.measure), args.cells, args.repeats)))
        return 0
    with baseline_worktree(args.baseline) as (revision, worktree):
        results = run_rounds(worktree, args.cells, args.rounds, args.repeats)
    table = format_table(results, args.cells)
    print(table)
    if not args.no_write:
        head, stamp, command = provenance("planner_ab.py")
        replace_section(
            "planner_ab",
            "## Planner A/B (interleaved)\n\n"
            f"Default `plan_search`, this tree ({head}) against {revision}: "
            f"{args.rounds} alternating rounds, a fresh process per tree each round; a "
            f"cell's time is the median wall time of {args.repeats} searches after one "
            f"warm-up, then the median over the rounds (2 CPU cores, {stamp}). "
            '"best plan": the change in the best plan\'s predicted throughput (same: the '
            f"very same number).\n\n{table}\n\nProduced by `{command}`.",
        )
    return 0


def provenance(script: str) -> tuple[str, str, str]:
    """(this tree's short revision, "-dirty" appended where tracked files changed; the UTC
    time now; the command line that ran `benchmarks/<script>`) for a RESULTS section."""
    head = _git("rev-parse", "--short", "HEAD")
    dirty = "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join([".venv/bin/python", f"benchmarks/{script}", *sys.argv[1:]])
    return head + dirty, stamp, command


@contextmanager
def baseline_worktree(baseline: str) -> Iterator[tuple[str, Path]]:
    """(short revision, a temporary git worktree of it) for `baseline`, removed afterwards;
    SystemExit where it names no revision of this repository."""
    try:
        revision = _git("rev-parse", "--short", "--verify", f"{baseline}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--baseline {baseline!r} is not a revision of this repository") from None
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "baseline"
        _git("worktree", "add", "--detach", str(worktree), revision)
        try:
            yield revision, worktree
        finally:
            _git("worktree", "remove", "--force", str(worktree))


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
