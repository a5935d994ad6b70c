"""Does `--workers N` search faster than one worker, with the trial count exact?

`plan_search(..., n_trials=T, workers=N)` on a 32-GPU, 4-type cluster for T = 200 and 600
and N = 1 and 2 (this machine's cores), with the study stored in SQLite (a temporary folder) and in
memory. The runs are interleaved (1, 2, 1, 2, ...: a slow spell of the machine hits both) and
each cell is the median wall time of REPEATS runs. "complete" counts the stored study's
completed trials (must equal T) and "other" its trials in any other state (must be 0).
The CPU seconds are this process's (the sampling, the stored study's writes and, with one
worker, the scoring); the workers (forked on Linux) pay their scoring on top.

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
TRIAL_COUNTS, REPEATS, WORKERS = (200, 600), 3, (1, 2)
STORAGES = ("SQLite", "memory")


def one_run(trials: int, workers: int, storage: str, folder: Path, index: int) -> dict:
    """Wall and CPU seconds, stored trials by state and best tokens/s of one search."""
    url = f"sqlite:///{folder / f'study-{trials}-{storage}-{workers}-{index}.db'}"
    url = url if storage == "SQLite" else None
    started, cpu = time.perf_counter(), time.process_time()
    result = plan_search(
        CLUSTER, MODEL, SEQ_LEN, n_trials=trials, storage=url, workers=workers, seed=index
    )
    run = {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
        "best": result.best.predicted.tokens_per_s,
        "complete": None,
        "other": None,
    }
    if url is not None:
        study = optuna.load_study(study_name=result.study_name, storage=url)
        states = [t.state for t in study.trials]
        run["complete"] = states.count(optuna.trial.TrialState.COMPLETE)
        run["other"] = len(states) - run["complete"]
    return run


def _listed(runs: list[dict], key: str, form: str) -> str:
    return ", ".join(form.format(r[key]) for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    runs: dict[tuple[int, str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trials in TRIAL_COUNTS:
            for index in range(REPEATS):
                for storage in STORAGES:
                    for workers in WORKERS:
                        run = one_run(trials, workers, storage, Path(tmp), index)
                        runs.setdefault((trials, storage, workers), []).append(run)
    lines = [
        "| trials | study | workers | median s | runs s | this process's CPU s "
        "| complete trials | other states | speedup | best tokens/s |",
        "|---:|---|---:|---:|---|---:|---|---|---:|---|",
    ]
    medians = {key: statistics.median(r["wall_s"] for r in rs) for key, rs in runs.items()}
    for (trials, storage, workers), rs in runs.items():
        speedup = medians[(trials, storage, 1)] / medians[(trials, storage, workers)]
        stored = storage == "SQLite"
        lines.append(
            f"| {trials} | {storage} | {workers} | {medians[(trials, storage, workers)]:.2f} "
            f"| {_listed(rs, 'wall_s', '{:.2f}')} "
            f"| {statistics.median(r['cpu_s'] for r in rs):.2f} "
            f"| {_listed(rs, 'complete', '{}') if stored else '-'} "
            f"| {_listed(rs, 'other', '{}') if stored else '-'} "
            f"| {speedup:.2f}x | {_listed(rs, 'best', '{:,.0f}')} |"
        )
    table = "\n".join(lines)
    exact = all(
        r["complete"] == trials and r["other"] == 0
        for (trials, storage, _), rs in runs.items()
        if storage == "SQLite"
        for r in rs
    )
    verdicts = [
        f"- trial count exact (the count completed, nothing else, in every stored run): "
        f"{'yes' if exact else 'no'}",
    ]
    for trials in TRIAL_COUNTS:
        for storage in STORAGES:
            one, many = medians[(trials, storage, 1)], medians[(trials, storage, WORKERS[-1])]
            verdicts.append(
                f"- {trials} trials, {storage}: {WORKERS[-1]} workers faster than 1: "
                f"{'yes' if many < one else 'no'} ({one / many:.2f}x)"
            )
    print(table, *verdicts, sep="\n")
    if not args.no_write:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        body = "\n".join(
            [
                "## Search workers",
                "",
                f"`plan_search({CLUSTER!r}, {MODEL!r}, {SEQ_LEN!r}, n_trials=T, "
                "storage=..., workers=N)`, median of "
                f"{REPEATS} interleaved runs ({os.cpu_count()} CPU cores, Python "
                f"{platform.python_version()}; {date}); run i of every cell uses seed i.",
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
