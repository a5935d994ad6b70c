"""Predicted vs measured step time of the runtime runs in a store, part by part.

    python benchmarks/step_time_accuracy.py [--store sqlite:////tmp/step_h100.db] [--runs 1 2 3]

Loads each run's plan from the store (`runtime_runs.plan_json`), re-simulates it with the
datasheet cost model (`DatasheetCostModel`: catalog peaks x per-kernel-backend efficiencies,
no profile) and prints the predicted step time and its parts next to the measured steady step
time: the median over the run's steps after the first (the first pays for CUDA context, lazy
kernel loading and the allocator's warm-up), slowest rank per step.

Default store: a copy of ../shared/data/h100-profile.db (one H100-SXM, torch 2.11, hexiseq
490c15d), copied to a temporary file because the shared one is read-only.

Which numbers come from where (no constant here is fitted to these runs): GEMM and attention
efficiencies from ../shared/data/h100-sdpa-gemm-rates.json (microbenchmarks, not these runs);
the memory-bound efficiency and the per-kernel floor from the elementwise microbenchmarks in
the store's profile tables; the exp rate from the FlashAttention-3 paper; bytes and kernels
from reading the runtime's code (costmodel/_runtime_work.py). One constant comes from a run:
AdamW's slowdown over plain elementwise kernels (`ADAMW_MEASURED_SLOWDOWN`), from the profiler
table of the 3B 8K plan, so runs 3 and 5 are in-sample for it; runs 1, 2 (where AdamW is
< 0.1 ms) and 4, 6 (same parameter count, so the same optimizer term) are out of sample.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import sqlalchemy

from hexiseq.costmodel import CostModel, DatasheetCostModel, FittedCostModel, simulate_step
from hexiseq.costmodel._state import BREAKDOWN_KEYS
from hexiseq.plan import Plan
from hexiseq.store import Store

SHARED_STORE = Path(__file__).resolve().parents[2] / "shared" / "data" / "h100-profile.db"
PART_LABELS = {
    "linear_s": "gemm",
    "attention_s": "attn",
    "all_to_all_s": "a2a",
    "ring_exposed_comm_s": "ring",
    "sharding_exposed_comm_s": "shard",
    "idle_s": "idle",
    "elementwise_s": "elem",
    "cast_s": "cast",
    "loss_s": "loss",
    "optimizer_s": "optim",
    "launch_s": "launch",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", help="SQLAlchemy URL (default: a copy of the shared H100 db)")
    parser.add_argument("--runs", type=int, nargs="*", help="run ids (default: all)")
    parser.add_argument(
        "--cost-model",
        choices=("datasheet", "fitted"),
        default="datasheet",
        help="fitted: the store's latest fit (run `hexiseq fit --store URL` first)",
    )
    return parser.parse_args()


def default_store_url() -> str:
    """A writable temporary copy of the shared H100 store."""
    copy = Path(tempfile.mkdtemp(prefix="step_time_")) / "h100.db"
    shutil.copyfile(SHARED_STORE, copy)
    copy.chmod(0o600)
    return f"sqlite:///{copy}"


def load_runs(url: str, run_ids: list[int] | None) -> list[tuple[int, Plan, float]]:
    """(run id, plan, measured steady step s) for each run with at least two steps."""
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as connection:
        runs = connection.execute(sqlalchemy.text("SELECT id, plan_json FROM runtime_runs"))
        runs = [(i, text) for i, text in runs if not run_ids or i in run_ids]
        found = []
        for run_id, plan_json in runs:
            rows = connection.execute(
                sqlalchemy.text(
                    "SELECT step, MAX(step_time_s) FROM runtime_measurements "
                    "WHERE run_id = :r GROUP BY step ORDER BY step"
                ),
                {"r": run_id},
            ).all()
            steady = [seconds for step, seconds in rows if step > 0]
            if steady:
                found.append((run_id, load_plan(plan_json, run_id), statistics.median(steady)))
    engine.dispose()
    return found


def load_plan(plan_json: str, run_id: int) -> Plan:
    """The run's plan; a schema-1 plan written before the newer RankTime parts loads as is."""
    return Plan.from_run_json_text(plan_json, source=f"run {run_id}")


def open_cost_model(url: str, kind: str) -> CostModel:
    if kind == "datasheet":
        return DatasheetCostModel()
    store = Store.open(url)
    try:
        document = store.latest_fitted_model()
    finally:
        store.close()
    if document is None:
        raise SystemExit(f"no fitted model in {url}; run `hexiseq fit --store {url}` first")
    return FittedCostModel.from_json(document)


def describe(run_id: int, plan: Plan, measured_s: float, cost: CostModel) -> str:
    prediction = simulate_step(
        plan.cluster,
        plan.model,
        plan.train,
        plan.layout(),
        cost,
        [a.state_fraction for a in plan.assignments],
    )
    slowest = max(prediction.rank_times, key=lambda rank: rank.step_s)
    error = prediction.step_time_s / measured_s - 1.0
    parts = "  ".join(
        f"{PART_LABELS[key]} {1e3 * getattr(slowest, key):.1f}"
        for key in BREAKDOWN_KEYS
        if getattr(slowest, key) > 5e-5
    )
    name = f"{plan.model.name} {plan.train.seq_len // 1024}K"
    checkpointing = "ckpt" if plan.train.activation_checkpointing else "no ckpt"
    return (
        f"{run_id:>3}  {name:<16} {checkpointing:<8} {plan.predicted.step_time_s:>9.3f} "
        f"{prediction.step_time_s:>9.3f} {measured_s:>9.3f} {100 * error:>+7.1f}%   {parts} (ms)"
    )


def main() -> None:
    args = parse_args()
    url = args.store or default_store_url()
    cost = open_cost_model(url, args.cost_model)
    print(f"store: {url}  cost model: {args.cost_model}")
    print(
        f"{'run':>3}  {'model':<16} {'':<8} {'plan s':>9} {'now s':>9} {'meas s':>9} {'error':>8}"
    )
    for run_id, plan, measured_s in load_runs(url, args.runs):
        print(describe(run_id, plan, measured_s, cost))


if __name__ == "__main__":
    main()
