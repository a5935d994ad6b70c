"""Re-planning while training (issue 15 part 3), on the emulated CPU cluster.

`hexiseq run --replan` of one plan of a small model on `cpu-emulated-2type` (four CPU ranks,
two of them emulated 2x slower), STEPS steps, in four runs with the same seed:

- reference: no fault;
- slowdown, kept: rank 0 (a fast rank) emulated 2x slower from step SLOW_AT on, the drift
  monitor on but `--min-gain` out of reach, so the plan never changes (what a static plan
  does);
- slowdown, re-planned: the same fault, the supervisor free to re-plan;
- lost device: rank 1 killed (SIGKILL) when step FAIL_AT begins; the supervisor plans again
  on the three ranks left and resumes from the last checkpoint;
- then the last three again as a run over two nodes: one supervisor per node of the preset
  ("fast", ranks 0-1; "slow", ranks 2-3), both on this machine, meeting on loopback around one
  shared run folder (`--node-rank K --master`, `hexiseq.cli.supervise_nodes`).

Throughput after the fault: tokens of the steps from the fault on over the wall time from the
end of the step before it to the end of the last step (so the checkpoint, the hand-over to
the new plan — in place after a drift, a relaunch after a lost device — and the new plan's
first step count against re-planning). Losses: the largest relative
difference of any step's loss from the reference's (the new plan's layout and state shares
sum in another order: fp32 noise). Planning: the supervisor's search, from its log.

Then the re-plan search alone on simulated clusters (datasheet model): the default plan of
each preset, re-planned after one device is measured 2x slower and after one device is lost;
the median of REPEATS warm calls of `search.replan`, and the gain it predicts.

Run: `.venv/bin/python benchmarks/replanning.py [--no-write]` (prints the table and updates
the "Re-planning while training" section of benchmarks/RESULTS.md). About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _results import replace_section

from hexiseq.supervision import read_steps

CLUSTER, MODEL, SEQ_LEN = "cpu-emulated-2type", "tiny", "8k"
STEPS, SLOW_AT, FAIL_AT = 16, 4, 5
HEXISEQ = [str(Path(sys.executable).with_name("hexiseq"))]


def make_plan(folder: Path) -> Path:
    path = folder / "plan.json"
    subprocess.run(
        [*HEXISEQ, "plan", "--cluster", CLUSTER, "--model", MODEL, "--seq-len", SEQ_LEN,
         "--out", str(path), "--no-store"],
        check=True, capture_output=True,
    )  # fmt: skip
    return path


def supervised(plan: Path, folder: Path, *flags: str) -> tuple[list[dict], str, float]:
    """Steps logged, the supervisor's output, and the wall seconds of the whole run."""
    began = time.perf_counter()
    done = subprocess.run(
        [*HEXISEQ, "run", "--plan", str(plan), "--steps", str(STEPS), "--device", "cpu",
         "--no-store", "--replan", "--run-dir", str(folder), *flags],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"hexiseq run {' '.join(flags)} failed:\n{done.stdout}\n{done.stderr}")
    return read_steps(folder), done.stdout, wall


def two_nodes(plan: Path, folder: Path, *flags: str) -> tuple[list[dict], str, float]:
    """`supervised` as two nodes: node 0's output; the wall seconds until both are done."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))  # a port free right now
        master = f"127.0.0.1:{probe.getsockname()[1]}"
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", "HEXISEQ_LAUNCH_ID": folder.name}
    began = time.perf_counter()
    nodes = [
        subprocess.Popen(
            [
                *HEXISEQ,
                "run",
                "--plan",
                str(plan),
                "--steps",
                str(STEPS),
                "--device",
                "cpu",
                "--no-store",
                "--replan",
                "--run-dir",
                str(folder),
                "--node-rank",
                str(node),
                "--master",
                master,
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )  # fmt: skip
        for node in (1, 0)
    ]
    outputs = [node.communicate() for node in nodes]
    wall = time.perf_counter() - began
    if any(node.returncode != 0 for node in nodes):
        raise SystemExit(f"two nodes {' '.join(flags)} failed:\n{outputs}")
    return read_steps(folder), outputs[1][0], wall


def last_entries(steps: list[dict]) -> dict[int, dict]:
    """Each step's entry as last run (a step run again after a lost device counts once)."""
    return {entry["step"]: entry for entry in steps}


def throughput_after(steps: list[dict], first: int, tokens: int) -> float:
    entries = last_entries(steps)
    start = entries[first - 1]["ended_unix_s"]
    end = entries[STEPS - 1]["ended_unix_s"]
    return tokens * (STEPS - first) / (end - start)


def loss_gap(steps: list[dict], reference: list[dict]) -> float:
    ours, theirs = last_entries(steps), last_entries(reference)
    return max(abs(ours[s]["loss"] - theirs[s]["loss"]) / abs(theirs[s]["loss"]) for s in theirs)


def planning_seconds(output: str) -> list[float]:
    return [float(s) for s in re.findall(r"re-planned in ([0-9.]+) s", output)]


def measure() -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        plan = make_plan(folder)
        tokens = json.loads(plan.read_text())["train"]["seq_len"]
        runs = {
            "reference (no fault)": (),
            "2x slowdown, plan kept": (f"--inject-slowdown=0:2@{SLOW_AT}", "--min-gain=1000"),
            "2x slowdown, re-planned": (f"--inject-slowdown=0:2@{SLOW_AT}",),
            "device lost, re-planned": (f"--inject-failure=1@{FAIL_AT}",),
        }
        runs.update(
            {
                f"2 nodes: {name}": flags
                for name, flags in runs.items()
                if name != "reference (no fault)"
            }
        )
        results, reference = [], None
        for name, flags in runs.items():
            run = two_nodes if name.startswith("2 nodes") else supervised
            steps, output, wall = run(plan, folder / f"run-{len(results)}", *flags)
            reference = reference or steps
            first = FAIL_AT if "lost" in name else SLOW_AT
            entries = last_entries(steps)
            results.append(
                {
                    "run": name,
                    "steps": f"{len(entries)}/{STEPS}",
                    "ranks at end": entries[STEPS - 1]["world_size"],
                    "plans": len({e["plan"] for e in steps}),
                    "tokens/s after": throughput_after(steps, first, tokens),
                    "loss gap": loss_gap(steps, reference),
                    "planning s": planning_seconds(output),
                    "wall s": wall,
                }
            )
            print(format_row(results[-1]), flush=True)
    return results


HEADER = (
    "| run | steps run | ranks at end | plans | tokens/s from the fault on | vs plan kept | "
    "max loss gap vs reference | re-plan search s | wall s |\n"
    "|---|---:|---:|---:|---:|---:|---:|---|---:|"
)


def format_row(row: dict, kept: float | None = None) -> str:
    ratio = f"{row['tokens/s after'] / kept:.2f}x" if kept else "-"
    planning = ", ".join(f"{s:.2f}" for s in row["planning s"]) or "-"
    return (
        f"| {row['run']} | {row['steps']} | {row['ranks at end']} | {row['plans']} | "
        f"{row['tokens/s after']:,.0f} | {ratio} | {row['loss gap']:.1e} | {planning} | "
        f"{row['wall s']:.0f} |"
    )


def report(results: list[dict]) -> str:
    def kept(row: dict) -> float | None:
        """The throughput of the same machines' kept plan, for a slowdown row."""
        if "slowdown" not in row["run"]:
            return None
        nodes = row["run"].startswith("2 nodes")
        same = [
            r for r in results if "kept" in r["run"] and r["run"].startswith("2 nodes") == nodes
        ]
        return same[0]["tokens/s after"]

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Re-planning while training",
        "",
        f"`hexiseq run --replan` on `{CLUSTER}` (4 CPU ranks, two emulated 2x slower), model "
        f"`{MODEL}`, {SEQ_LEN} tokens, {STEPS} steps, checkpoint every step; slowdown: rank 0 "
        f"2x slower from step {SLOW_AT}; lost device: rank 1 killed when step {FAIL_AT} "
        f"begins. Throughput from the fault on counts the checkpoint, the hand-over (in place "
        f'after a drift, a relaunch after a loss) and the new plan\'s first step. "2 nodes": '
        f"the same runs with one supervisor per node of the preset (fast: ranks 0-1, slow: "
        f"2-3), both on this machine, on loopback, sharing the run folder "
        f"({platform.machine()}, 2 cores, Python {platform.python_version()}; {when}).",
        "",
        HEADER,
        *(format_row(row, kept(row)) for row in results),
    ]
    return "\n".join(lines)


SIMULATED = [
    ("h100x8-a100x8", "llama3-8b", "256k"),
    ("mix4-32", "llama3-8b", "512k"),
    ("mix2-128", "llama3-8b", "1M"),
    ("mix4-128", "llama3-70b", "512k"),
]
REPEATS = 3


def simulated() -> list[str]:
    """Rows of the re-plan search table (see the module docstring)."""
    import statistics

    from hexiseq import plan_search
    from hexiseq.costmodel.datasheet import DatasheetCostModel
    from hexiseq.search.replan import replan

    cost = DatasheetCostModel()
    rows = []
    for cluster, model, seq_len in SIMULATED:
        plan = plan_search(cluster, model, seq_len, cost_model=cost).best
        for what, change in (("rank 0 2x slower", {"slowdowns": {0: 2.0}}),
                             ("rank 0 lost", {"lost": [0]})):  # fmt: skip
            replan(plan, cost, **change)  # warm-up
            runs = [replan(plan, cost, **change) for _ in range(REPEATS)]
            seconds = statistics.median(r.planning_s for r in runs)
            gain = runs[0].predicted_gain
            rows.append(
                f"| {cluster} ({plan.cluster.world_size} GPUs) | {model} | {seq_len} | {what} | "
                f"{seconds:.2f} | {'-' if gain is None else f'{gain:.2f}x'} |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    text = "\n".join(
        [
            report(measure()),
            "",
            "Re-plan search alone, simulated (datasheet model; median of 3 warm calls; "
            "predicted gain of the new plan over the old one on the changed cluster; a lost "
            "device has none, its old plan cannot run):",
            "",
            "| cluster | model | tokens | change | re-plan s | predicted gain |",
            "|---|---|---|---|---:|---:|",
            *simulated(),
            "",
            "Produced by `.venv/bin/python benchmarks/replanning.py`.",
        ]
    )
    print(text)
    if not args.no_write:
        replace_section("replanning", text)


if __name__ == "__main__":
    main()
