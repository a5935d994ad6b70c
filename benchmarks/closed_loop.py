"""The closed loop on this machine: profile, fit, plan, run, and compare predicted with measured.

An emulated 2-type CPU cluster of 4 ranks (`cpu-emulated-2type`: 2 ranks at normal speed, 2
whose compute is padded to 2x by sleeping; labelled as emulation everywhere):

1. profile the device as the run uses it: in the run four single-thread ranks share this
   machine's cores, so the 1x type is profiled by four `hexiseq profile --threads 1` sweeps
   at once (all at 1x, so they keep pace and every point is timed with the cores shared
   four ways), and the rows of one are kept. The emulated 2x type is profiled the way the
   cluster runs (sweeps 0-1 at 1x, 2-3 at `--emulation-slowdown 2`; one 2x sweep is kept).
   Links: `hexiseq profile links --nproc 4`, once for the class of the links inside a node
   (`intra:cpu`) and once for those between nodes (`inter`): on one machine both are gloo
   over loopback;
2. fit (`hexiseq fit`): the step simulator then predicts with the fitted model (the 1x fit,
   times each rank's slowdown, as for every emulated device; the 2x fit is reported as a
   check of the emulation);
3. plan with hexiseq and take the best uniform baseline, both under the fitted model;
4. run both with the runtime (`hexiseq run`, 4 gloo ranks, states sharded as planned);
5. report predicted vs measured step time for each and the measured speedup.

Goals (issue 5): |predicted - measured| / measured <= 10 %; measured speedup >= 1.3x.

Run: `.venv/bin/python benchmarks/closed_loop.py [--quick] [--keep DIR]` (prints the table
and updates the "Closed loop" section of benchmarks/RESULTS.md; --quick: smaller run, no
RESULTS update).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _results import replace_section
from _runs import HEXISEQ, run_plan, uniform_grids

from hexiseq import Cluster, ModelSpec
from hexiseq.costmodel.fitted import FittedCostModel
from hexiseq.search import plan_search
from hexiseq.store import Store

CLUSTER, MODEL = "cpu-emulated-2type", "small"
GRID = Path(__file__).with_name("closed_loop_grid.yaml")
# (slowdown of each of the 4 concurrent sweeps, the sweep whose rows are kept)
PROFILE_PHASES = (((1.0, 1.0, 1.0, 1.0), 0), ((1.0, 1.0, 2.0, 2.0), 2))
MACHINE = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def profile(scratch: Path, store_url: str) -> float:
    """Profile compute (4 concurrent sweeps) and links into `store_url`; returns seconds."""
    began = time.perf_counter()
    for phase, (slowdowns, kept) in enumerate(PROFILE_PHASES):
        _concurrent_sweeps(scratch / f"phase{phase}", slowdowns)
        _copy_rows(f"sqlite:///{scratch}/phase{phase}/sweep{kept}.db", store_url)
    for link_class in ("intra:cpu", "inter"):
        command = [HEXISEQ, "profile", "links", "--nproc", "4", "--grid", str(GRID)]
        command += ["--link-class", link_class, "--store", store_url]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def _concurrent_sweeps(directory: Path, slowdowns: tuple[float, ...]) -> None:
    """One single-thread compute sweep per slowdown, all at once, each into its own store."""
    directory.mkdir(parents=True, exist_ok=True)
    sweeps = []
    for rank, slowdown in enumerate(slowdowns):
        command = [HEXISEQ, "profile", "--device", "cpu", "--grid", str(GRID), "--threads", "1"]
        command += ["--store", f"sqlite:///{directory}/sweep{rank}.db"]
        command += ["--emulation-slowdown", str(slowdown)] if slowdown != 1.0 else []
        sweeps.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
    for sweep in sweeps:
        if sweep.wait() != 0:
            raise RuntimeError(f"profile sweep failed: exit {sweep.returncode}")


def _copy_rows(source_url: str, target_url: str) -> None:
    """The compute rows of one sweep store into the closed loop's store, as one run."""
    with Store.open(source_url) as source, Store.open(target_url) as target:
        rows = source.profile_measurements()
        first = rows[0]
        run_id = target.save_profile_run(
            kind="compute",
            device_type=first.device_type,
            device_name=first.device_name,
            torch_version=first.torch_version,
            cuda_version=first.cuda_version,
            host=first.host,
            command=f"closed_loop.py: concurrent sweep, emulation {first.emulation_slowdown:g}x",
            grid_name="closed-loop",
            quick=False,
        )
        for row in rows:
            target.add_profile_measurement(run_id, row)


def fit(store_url: str) -> tuple[FittedCostModel, str]:
    """`hexiseq fit` on the store; the fitted model and the printed held-out table."""
    printed = subprocess.run(
        [HEXISEQ, "fit", "--store", store_url], check=True, capture_output=True, text=True
    ).stdout
    with Store.open(store_url) as store:
        document = store.latest_fitted_model()
    return FittedCostModel.from_json(document), printed


def plan_and_run(cost: FittedCostModel, scratch: Path, seq_len: int, steps: int) -> list[dict]:
    cluster, model = Cluster.preset(CLUSTER), ModelSpec.preset(MODEL)
    result = plan_search(cluster, model, seq_len, cost_model=cost)
    plans = {**uniform_grids(result.baselines["uniform-usp"], cost), "hexiseq": result.best}
    runs_url = f"sqlite:///{scratch}/runs.db"
    rows = []
    for name, plan in plans.items():
        run = run_plan(plan, scratch / "plan.json", runs_url, steps=steps)
        rows.append(
            {
                "name": name,
                "plan": plan,
                "predicted_s": plan.predicted.step_time_s,
                "measured_s": run.median_step_s,
                "steps_s": run.step_times_s,
            }
        )
    return rows


def table(rows: list[dict], seq_len: int, steps: int, profile_s: float, fit_text: str) -> str:
    cluster = Cluster.preset(CLUSTER)
    lines = [
        f"Cluster `{CLUSTER}` (4 CPU ranks on {MACHINE}; ranks 2-3 emulated 2x slower by "
        f"sleeping), model `{MODEL}`, {seq_len:,} tokens, fp32; profiles: 4 concurrent "
        f"single-thread sweeps + gloo links ({profile_s:.0f} s); `hexiseq run` {steps} steps, "
        "the first left out.",
        "",
        "| plan | tokens per rank | checkpointing | predicted step s | measured step s "
        "(median) | steps s | error |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for row in rows:
        plan = row["plan"]
        tokens = [plan.layout().num_tokens(r) for r in range(cluster.world_size)]
        error = (row["predicted_s"] - row["measured_s"]) / row["measured_s"]
        lines.append(
            f"| {row['name']} | {tokens} | {plan.train.activation_checkpointing} | "
            f"{row['predicted_s']:.3f} | {row['measured_s']:.3f} | "
            f"{', '.join(f'{s:.3f}' for s in row['steps_s'])} | {error:+.1%} |"
        )
    *grids, hexiseq = rows
    fastest = min(grids, key=lambda row: row["measured_s"])  # the strongest, as measured
    picked = next(row for row in grids if row["name"].endswith("uniform-USP"))
    measured = fastest["measured_s"] / hexiseq["measured_s"]
    predicted = fastest["predicted_s"] / hexiseq["predicted_s"]
    against_pick = picked["measured_s"] / hexiseq["measured_s"]
    worst = max(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows)
    lines += [
        "",
        f"Measured speedup over the fastest uniform grid measured ({fastest['name']}) "
        f"**{measured:.2f}x** (predicted {predicted:.2f}x; goal >= 1.3x: "
        f"{'met' if measured >= 1.3 else 'not met'}); over uniform-USP's pick "
        f"{against_pick:.2f}x. Worst step-time error **{worst:.1%}** "
        f"(goal <= 10 %: {'met' if worst <= 0.10 else 'not met'}).",
        "",
        "Held-out errors of the fit (`hexiseq fit`):",
        "",
        "```",
        fit_text.strip(),
        "```",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8K tokens, 3 steps, no RESULTS")
    parser.add_argument("--keep", metavar="DIR", help="keep the stores in DIR")
    args = parser.parse_args()
    seq_len, steps = (8192, 3) if args.quick else (16384, 4)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(args.keep or temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        store_url = f"sqlite:///{scratch}/closed_loop.db"
        began = time.perf_counter()
        profile_s = profile(scratch, store_url)
        cost, fit_text = fit(store_url)
        rows = plan_and_run(cost, scratch, seq_len, steps)
        took = time.perf_counter() - began
    command = "python benchmarks/closed_loop.py" + (" --quick" if args.quick else "")
    body = (
        f"## Closed loop: profile, fit, plan, run (CPU, emulated 2-type)\n\n`{command}` "
        f"({took:.0f} s, torch {torch.__version__})\n\n"
        + table(rows, seq_len, steps, profile_s, fit_text)
    )
    print(body)
    if not args.quick:
        replace_section("closed-loop", body)


if __name__ == "__main__":
    main()
