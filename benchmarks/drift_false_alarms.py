"""Does the drift monitor's default threshold cry wolf? Healthy supervised runs, idle and loaded.

`hexiseq run --replan` of the re-planning benchmark's plan (`replanning.py`: `tiny`, 8K tokens
on `cpu-emulated-2type`, four CPU ranks on this machine's two cores) with no fault, at the
default `--drift-threshold`, RUNS times on an otherwise idle machine and RUNS times beside one
extra CPU-bound process (a noisy neighbour taking a core's worth of time). Every step logs each
rank's relative drift (`runtime._drift`: its compute over the plan's prediction, over the same
at its own start, over the typical rank's); a false alarm is a drift the monitor reported
(a `drift-<step>.json`, which makes the supervisor search again) in a run with no fault.

Then one control run per condition with rank 0 slowed 1.5x from step SLOW_AT (above the
default threshold of 1.3): the monitor must report it, with about that factor.

Run: `.venv/bin/python benchmarks/drift_false_alarms.py [--runs N] [--no-write]` (prints the
table and updates the "Drift monitor: false alarms" section of benchmarks/RESULTS.md). About
9 minutes on 2 cores with the default 6 runs per condition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from _results import replace_section
from replanning import CLUSTER, HEXISEQ, MODEL, SEQ_LEN, make_plan

from hexiseq.supervision import DEFAULT_DRIFT_THRESHOLD, read_steps

STEPS, SLOW_AT, CONTROL_FACTOR = 12, 5, 1.5
RUNS = 6
NOISE = "while True: pass"


@dataclass(frozen=True)
class RunResult:
    """One supervised run: the drift values logged and the drifts the monitor reported."""

    drifts: list[float]  # every rank's relative drift at every monitored step
    reported: list[dict]  # the monitor's reports (drift-<step>.json)


def supervised(plan: Path, folder: Path, *flags: str) -> RunResult:
    done = subprocess.run(
        [*HEXISEQ, "run", "--plan", str(plan), "--steps", str(STEPS), "--device", "cpu",
         "--no-store", "--replan", "--run-dir", str(folder), *flags],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"hexiseq run {' '.join(flags)} failed:\n{done.stdout}\n{done.stderr}")
    drifts = [value for entry in read_steps(folder) for value in entry.get("drift", [])]
    reports = [json.loads(path.read_text()) for path in sorted(folder.rglob("drift-*.json"))]
    return RunResult(drifts, reports)


@contextmanager
def noisy_neighbour(on: bool):
    """One CPU-bound process beside the run, when `on`."""
    process = subprocess.Popen([sys.executable, "-c", NOISE]) if on else None
    try:
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait()


def measure(runs: int) -> dict[str, dict]:
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        plan = make_plan(folder)
        for condition, loaded in (("idle", False), ("one CPU-bound neighbour", True)):
            with noisy_neighbour(loaded):
                healthy = [
                    supervised(plan, folder / f"{loaded}-{i}") for i in range(runs)
                ]  # fmt: skip
                control = supervised(
                    plan,
                    folder / f"{loaded}-control",
                    f"--inject-slowdown=0:{CONTROL_FACTOR}@{SLOW_AT}",
                    "--min-gain=1000",  # report, never re-plan: the factor stays measurable
                )
            results[condition] = {"healthy": healthy, "control": control}
            print(format_row(condition, healthy, control), flush=True)
    return results


def format_row(condition: str, healthy: list[RunResult], control: RunResult) -> str:
    drifts = sorted(value for run in healthy for value in run.drifts)
    alarms = sum(bool(run.reported) for run in healthy)
    above = sum(value >= DEFAULT_DRIFT_THRESHOLD for value in drifts)
    p99 = drifts[min(len(drifts) - 1, int(0.99 * len(drifts)))]
    caught = [r["factors"].get("0") for r in control.reported if "0" in r["factors"]]
    control_text = f"reported, {caught[0]:.2f}x" if caught else "NOT reported"
    return (
        f"| {condition} | {len(healthy)} | {alarms} | {len(drifts)} | "
        f"{statistics.median(drifts):.3f} | {p99:.3f} | {drifts[-1]:.3f} | {above} | "
        f"{control_text} |"
    )


def report(results: dict[str, dict], runs: int) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        "| condition | healthy runs | runs with a false alarm | rank-steps monitored | "
        "median drift | 99th pct | max | rank-steps >= threshold | "
        f"control: rank 0 {CONTROL_FACTOR}x slower |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    rows = [format_row(c, r["healthy"], r["control"]) for c, r in results.items()]
    return "\n".join(
        [
            "## Drift monitor: false alarms",
            "",
            f"`hexiseq run --replan` with no fault on `{CLUSTER}` (4 CPU ranks on 2 cores), "
            f"`{MODEL}` at {SEQ_LEN} tokens, {STEPS} steps, default threshold "
            f"{DEFAULT_DRIFT_THRESHOLD} (monitoring from step 4: steps 1-3 are each rank's "
            f"start), {runs} runs per condition; drift is each rank's compute ratio over its "
            f"own start, relative to the typical rank. A false alarm is a drift the monitor "
            f"reported in a run with no fault. Control: rank 0 {CONTROL_FACTOR}x slower from "
            f"step {SLOW_AT}, `--min-gain` out of reach so the monitor's factor is what it "
            f"reported ({platform.machine()}, Python {platform.python_version()}; {when}).",
            "",
            header,
            *rows,
            "",
            "Produced by `.venv/bin/python benchmarks/drift_false_alarms.py`.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="healthy runs per condition")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    text = report(measure(args.runs), args.runs)
    print(text)
    if not args.no_write:
        replace_section("drift_false_alarms", text)


if __name__ == "__main__":
    main()
