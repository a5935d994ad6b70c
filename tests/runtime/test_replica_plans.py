"""A plan of several data-parallel replicas run by the runtime's own training step
(`runtime.train.run_step`, as `hexiseq run` runs it): replicas of different sizes and
layouts, different sequences per step and uneven state shares inside each; the step's loss
and every gradient equal the single-process float64 model on the whole batch (fp32, fresh
random tokens, relative error <= 1e-5)."""

from __future__ import annotations

import pytest
from distributed import run_distributed
from replica_plan_cases import check_replica_plan_steps, replica_plan

UNEVEN = {"wide": [0.5, 0.15, 0.35], "one": [1.0]}
EVEN = {"wide": [1 / 3, 1 / 3, 1 / 3], "one": [1.0]}


CASES = [  # (state shares, sequences per replica, sharded states)
    (UNEVEN, {"wide": 2, "one": 1}, True),
    (EVEN, {"wide": 1, "one": 2}, True),
    (UNEVEN, {"wide": 1, "one": 2}, False),
]


@pytest.mark.multiproc
def test_a_replica_plan_trains_as_one_process_on_the_whole_batch():
    """Each case in one spawn of 4 ranks (their imports are most of the time)."""
    cases = []
    for fractions, sequences, sharded in CASES:
        plan = replica_plan(fractions, sequences)
        assert plan.data_parallel
        assert [r.sequences for r in plan.replicas] == [sequences["wide"], sequences["one"]]
        cases.append((plan.to_json_text(), sharded))
    run_distributed(check_replica_plan_steps, 4, cases)


@pytest.mark.multiproc
def test_hexiseq_run_trains_a_replica_plan_as_one_mesh_trains_the_same_batch(tmp_path):
    """`hexiseq run` of the search's replica plan (the emulated 2-type cluster, a batch of 3
    sequences) records every rank's steps, and its losses equal those of the one-mesh plan
    of the same batch (same seed, same tokens): the replicas train the same model."""
    import subprocess
    import sys

    from hexiseq import Cluster
    from hexiseq.search import plan_search
    from hexiseq.store import Store

    cluster = Cluster.preset("cpu-emulated-2type")
    losses = {}
    for data_parallel in (True, False):
        plan = plan_search(cluster, "tiny", 256, micro_batches=3, data_parallel=data_parallel)
        assert plan.best.data_parallel == data_parallel
        path, url = (
            tmp_path / f"{data_parallel}.json",
            f"sqlite:///{tmp_path / f'{data_parallel}.db'}",
        )
        plan.best.to_json(path)
        done = subprocess.run(
            [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(path), "--steps", "2",
             "--store", url, "--device", "cpu"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        with Store.open(url) as store:
            (run,) = store.list_runtime_runs()
            rows = store.runtime_measurements(run["id"])
        assert [(m.step, m.rank) for m in rows] == [(s, r) for s in range(2) for r in range(4)]
        by_step = [{m.loss for m in rows if m.step == step} for step in range(2)]
        assert all(len(step) == 1 for step in by_step)  # one loss on every rank
        losses[data_parallel] = [step.pop() for step in by_step]
    for replicated, mesh in zip(losses[True], losses[False]):
        assert abs(replicated - mesh) / mesh <= 1e-5
