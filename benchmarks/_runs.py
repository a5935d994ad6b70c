"""Run a plan with the runtime (`hexiseq run`, torchrun inside) and read back what it measured."""

from __future__ import annotations

import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hexiseq.costmodel import CostModel
from hexiseq.plan import Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.baselines import uniform_grid_plan
from hexiseq.store import Store

HEXISEQ = str(Path(sys.executable).with_name("hexiseq"))


@dataclass(frozen=True)
class MeasuredRun:
    """Step times of one runtime run, warm-up steps left out."""

    run_id: int
    step_times_s: tuple[float, ...]
    rank_times_s: dict[int, float]
    """Per rank, the median of its own time (opening barrier to its optimizer step's end)."""

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)


def run_plan(
    plan: Plan, path: Path, store_url: str, *, steps: int, warm_up_steps: int = 1
) -> MeasuredRun:
    """Write `plan` to `path`, run it for `steps` steps on CPU ranks and return the steps
    after the first `warm_up_steps` (allocation and first-call costs)."""
    plan.to_json(path)
    command = [HEXISEQ, "run", "--plan", str(path), "--steps", str(steps), "--store", store_url]
    command += ["--device", "cpu"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    with Store.open(store_url) as store:
        run_id = max(run["id"] for run in store.list_runtime_runs())
        rows = [m for m in store.runtime_measurements(run_id) if m.step >= warm_up_steps]
    step_times = tuple(row.step_time_s for row in rows if row.rank == 0)
    ranks = sorted({row.rank for row in rows})
    rank_times = {
        rank: statistics.median(row.rank_time_s for row in rows if row.rank == rank)
        for rank in ranks
    }
    return MeasuredRun(run_id, step_times, rank_times)


def uniform_grids(
    picked: Plan, cost: CostModel, checkpointing: tuple[bool, ...] = (False, True)
) -> dict[str, Plan]:
    """Every feasible uniform HP x CP grid of the cluster and step uniform-USP `picked` its
    grid for, under `cost` and the `checkpointing` settings the search had (each grid without
    the recompute where that fits), by name, `picked`'s marked: where their predicted steps
    lie close, the model's pick need not be the grid that runs fastest, so each is run."""
    problem = Problem(picked.cluster, picked.model, picked.train, cost, checkpointing)
    world, grids = picked.cluster.world_size, {}
    for degree in (d for d in range(1, world + 1) if world % d == 0):
        plan = uniform_grid_plan(problem, degree, "uniform grid")
        if isinstance(plan, Plan):
            mark = " = uniform-USP" if plan.knobs == picked.knobs else ""
            grids[f"uniform grid hp={degree}, cp={world // degree}{mark}"] = plan
    return grids
