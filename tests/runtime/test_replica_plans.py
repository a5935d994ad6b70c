"""A plan of several data-parallel replicas run by the runtime's own training step
(`runtime.train.run_step`, as `hexiseq run` runs it): replicas of different sizes and
layouts, different sequences per step and uneven state shares inside each; the step's loss
and every gradient equal the single-process float64 model on the whole batch (fp32, fresh
random tokens, relative error <= 1e-5)."""

from __future__ import annotations

import pytest
from distributed import run_distributed
from replica_plan_cases import check_replica_plan_step, replica_plan

UNEVEN = {"wide": [0.5, 0.15, 0.35], "one": [1.0]}
EVEN = {"wide": [1 / 3, 1 / 3, 1 / 3], "one": [1.0]}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("fractions", "sequences", "sharded"),
    [
        (UNEVEN, {"wide": 2, "one": 1}, True),
        (EVEN, {"wide": 1, "one": 2}, True),
        (UNEVEN, {"wide": 1, "one": 2}, False),
    ],
)
def test_a_replica_plan_trains_as_one_process_on_the_whole_batch(fractions, sequences, sharded):
    plan = replica_plan(fractions, sequences)
    assert plan.data_parallel and [r.sequences for r in plan.replicas] == [
        sequences["wide"],
        sequences["one"],
    ]
    run_distributed(check_replica_plan_step, 4, plan.to_json_text(), sharded)
