"""Does `--workers N` search faster than one worker, with the trial count exact?

One stored study (SQLite in a temporary folder) per run: `plan_search(..., n_trials=TRIALS,
storage=..., workers=N)` on a 32-GPU, 4-type cluster, for N = 1 and N = 2 (this machine's
cores; spawned workers pay their own imports). Each cell is the median wall time of REPEATS
runs; "complete" counts the study's completed trials (must equal TRIALS), "pruned" the
trials a racing worker drew past the count.

Run: `.venv/bin/python benchmarks/search_workers.py [--no-write]` (prints the table and
updates the "Search workers" section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import optuna
from _results import replace_section

from hexiseq import plan_search

CLUSTER, MODEL, SEQ_LEN = "mix4-32", "llama-30b", "512k"
TRIALS, REPEATS, WORKERS = 200, 2, (1, 2)


def one_run(workers: int, folder: Path, index: int) -> tuple[float, int, int, float]:
    """Wall seconds, completed and pruned trials, best tokens/s of one stored search."""
    url = f"sqlite:///{folder / f'study-{workers}-{index}.db'}"
    started = time.perf_counter()
    result = plan_search(
        CLUSTER, MODEL, SEQ_LEN, n_trials=TRIALS, storage=url, workers=workers, seed=index
    )
    wall_s = time.perf_counter() - started
    study = optuna.load_study(study_name=result.study_name, storage=url)
    states = [t.state for t in study.trials]
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    pruned = states.count(optuna.trial.TrialState.PRUNED)
    return wall_s, complete, pruned, result.best.predicted.tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in WORKERS:
            runs = [one_run(workers, Path(tmp), i) for i in range(REPEATS)]
            walls = [r[0] for r in runs]
            rows.append((workers, statistics.median(walls), walls, runs))
    base_s = rows[0][1]
    lines = [
        "| workers | median s | runs s | complete trials | pruned | speedup | best tokens/s |",
        "|---:|---:|---|---|---|---:|---|",
    ]
    for workers, median_s, walls, runs in rows:
        lines.append(
            f"| {workers} | {median_s:.2f} | {', '.join(f'{w:.2f}' for w in walls)} "
            f"| {', '.join(str(r[1]) for r in runs)} | {', '.join(str(r[2]) for r in runs)} "
            f"| {base_s / median_s:.2f}x | {', '.join(f'{r[3]:,.0f}' for r in runs)} |"
        )
    table = "\n".join(lines)
    exact = all(r[1] == TRIALS for row in rows for r in row[3])
    verdicts = [
        f"- trial count exact ({TRIALS} completed in every run): {'yes' if exact else 'no'}",
        f"- {WORKERS[-1]} workers faster than 1: "
        f"{'yes' if rows[-1][1] < base_s else 'no'} ({base_s / rows[-1][1]:.2f}x)",
    ]
    print(table, *verdicts, sep="\n")
    if not args.no_write:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        body = "\n".join(
            [
                "## Search workers",
                "",
                f"`plan_search({CLUSTER!r}, {MODEL!r}, {SEQ_LEN!r}, n_trials={TRIALS}, "
                "storage=SQLite, workers=N)`, median of "
                f"{REPEATS} runs ({os.cpu_count()} CPU cores, Python "
                f"{platform.python_version()}; {date}); seeds differ between runs, so the "
                "best plans may differ.",
                "",
                table,
                "",
                *verdicts,
                "",
                "Produced by `.venv/bin/python benchmarks/search_workers.py`.",
            ]
        )
        replace_section("search_workers", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
