"""Re-planning on a changed cluster: a device measured slower, a device lost."""

from __future__ import annotations

import dataclasses

import pytest

from hexiseq import Cluster
from hexiseq.costmodel.datasheet import DatasheetCostModel
from hexiseq.errors import InfeasibleError
from hexiseq.search import plan_search
from hexiseq.search.predict import predict
from hexiseq.search.replan import replan

COST = DatasheetCostModel()


@pytest.fixture(scope="module")
def plan():
    return plan_search("h100x8-a100x8", "llama3-8b", "128k", cost_model=COST).best


def test_a_slowed_device_gets_less_work_and_the_gain_is_the_predicted_ratio(plan):
    replanned = replan(plan, COST, slowdowns={0: 2.0})
    new = replanned.plan
    assert new.cluster.devices[0].measured_slowdown == 2.0
    assert new.cluster.world_size == plan.cluster.world_size
    assert replanned.rank_map == {r: r for r in range(plan.cluster.world_size)}
    # the old plan, priced on the measured cluster, is what the gain compares with
    old_on_measured = dataclasses.replace(plan, cluster=new.cluster)
    assert replanned.predicted_old_step_s == pytest.approx(
        predict(old_on_measured, cost_model=COST).step_time_s
    )
    assert replanned.predicted_old_step_s > plan.predicted.step_time_s
    assert replanned.predicted_gain == pytest.approx(
        replanned.predicted_old_step_s / new.predicted.step_time_s
    )
    assert replanned.predicted_gain > 1.2 and replanned.worth_it()
    slow, peer = new.assignments[0], new.assignments[1]  # both H100s of node 0
    assert slow.tokens * (slow.head_range[1] - slow.head_range[0]) < peer.tokens * (
        peer.head_range[1] - peer.head_range[0]
    )


def test_no_change_is_not_worth_a_restart(plan):
    replanned = replan(plan, COST, slowdowns={})
    assert replanned.predicted_gain == pytest.approx(1.0, rel=0.02)
    assert not replanned.worth_it(1.05)


def test_a_lost_device_is_planned_around(plan):
    replanned = replan(plan, COST, lost=[3])
    assert replanned.plan.cluster.world_size == plan.cluster.world_size - 1
    assert replanned.predicted_old_step_s is None and replanned.predicted_gain is None
    assert replanned.worth_it()
    assert 3 not in replanned.rank_map and replanned.rank_map[4] == 3
    assert sorted(replanned.rank_map.values()) == list(range(replanned.plan.cluster.world_size))


def test_nothing_left_that_fits_is_one_clear_message():
    tight = Cluster.from_dict(
        {"name": "two-l40s", "nodes": [{"name": "n", "gpu": "L40S", "count": 2}]}
    )
    plan = plan_search(tight, "llama3.2-3b", "16k", cost_model=COST).best
    with pytest.raises(InfeasibleError, match="re-plan of .* on what is left"):
        replan(plan, COST, lost=[0])
