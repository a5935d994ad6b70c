"""The runtime runs warning-free (issue 17): a real `hexiseq run` under torchrun with
`PYTHONWARNINGS=error` in the launcher's and every rank's environment succeeds and records
its steps, with sharded (uneven shares) and replicated states; and a warning fails a runtime
test here (`conftest`), in the test's own process and in the ranks it spawns."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
from distributed import run_distributed
from torch.multiprocessing import ProcessRaisedException

from hexiseq import Cluster, ModelSpec, Plan
from hexiseq.search import plan_search
from hexiseq.store import Store

STEPS = 2
# Two ranks (the test machine's cores are few): one plain CPU, one emulated 2x slower, so the
# compute padding's forward and backward hooks run too.
TWO_CPU_TYPES = {
    "name": "two-cpu-types",
    "nodes": [
        {"name": "fast", "gpu": "cpu", "count": 1},
        {"name": "slow", "gpu": "cpu", "count": 1, "emulation_slowdown": 2.0},
    ],
    "network": {"inter_node_GBps": 2.0, "inter_node_latency_us": 50},
}
UNEVEN_SHARES = (0.7, 0.3)


def _tiny_plan() -> Plan:
    """The best 'tiny' plan for 128 tokens on two CPU types, its model states shared unevenly
    (the gloo path of the uneven all-gather and reduce-scatter)."""
    plan = plan_search(Cluster.from_dict(TWO_CPU_TYPES), ModelSpec.preset("tiny"), 128).best
    assignments = [
        dataclasses.replace(assignment, state_fraction=share)
        for assignment, share in zip(plan.assignments, UNEVEN_SHARES, strict=True)
    ]
    return dataclasses.replace(plan, assignments=assignments)


@pytest.mark.multiproc
@pytest.mark.parametrize("state_sharding", ["sharded", "replicated"])
def test_hexiseq_run_with_warnings_as_errors_succeeds_and_records_its_steps(
    tmp_path, state_sharding
):
    plan_path, url = tmp_path / "plan.json", f"sqlite:///{tmp_path / 'runs.db'}"
    _tiny_plan().to_json(plan_path)
    command = [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(plan_path)]
    options = ["--steps", str(STEPS), "--store", url, "--device", "cpu"]
    done = subprocess.run(
        [*command, *options, "--state-sharding", state_sharding],
        env={**os.environ, "PYTHONWARNINGS": "error"},  # torchrun passes it on to the ranks
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    with Store.open(url) as store:
        (run,) = store.list_runtime_runs()
        rows = store.runtime_measurements(run["id"])
    assert (run["status"], run["world_size"], run["steps"]) == ("finished", 2, STEPS)
    assert [(m.step, m.rank) for m in rows] == [(s, r) for s in range(STEPS) for r in range(2)]


def test_a_warning_is_an_error_in_a_runtime_test():
    with pytest.raises(UserWarning, match="probe"):
        warnings.warn("probe", UserWarning, stacklevel=1)


def _warn(rank: int, world_size: int) -> None:
    warnings.warn("probe from a rank", UserWarning, stacklevel=1)


@pytest.mark.multiproc
def test_a_warning_in_a_spawned_rank_fails_the_test():
    with pytest.raises(ProcessRaisedException, match="probe from a rank"):
        run_distributed(_warn, 1)
