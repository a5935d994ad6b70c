"""A cluster as measured: devices slower than modelled (`measured_slowdown`) and devices lost."""

from __future__ import annotations

import pytest

from hexiseq import Cluster
from hexiseq.costmodel.datasheet import DatasheetCostModel
from hexiseq.errors import InputError
from hexiseq.search.predict import predict

TWO_NODES = {
    "name": "two",
    "nodes": [
        {"name": "a", "gpu": "H100-SXM", "count": 4},
        {"name": "b", "gpu": "A100-80G", "count": 2},
    ],
    "network": {"inter_node_GBps": 25, "overrides": [{"a": "a", "b": "b", "GBps": 10}]},
}


def test_measured_slowdown_multiplies_and_round_trips():
    cluster = Cluster.from_dict(TWO_NODES).with_measured_slowdowns({1: 2.0, 4: 1.5})
    assert [d.compute_slowdown for d in cluster.devices] == [1, 2, 1, 1, 1.5, 1]
    again = cluster.with_measured_slowdowns({1: 1.5})
    assert again.devices[1].measured_slowdown == 3.0
    assert Cluster.from_dict(again.to_dict()) == again
    back = again.with_measured_slowdowns({1: 1 / 3, 4: 1 / 1.5})
    assert back.nodes[0].measured_slowdown is None  # all 1 again: the file says nothing
    assert (
        back.to_dict()["nodes"][0].keys()
        == Cluster.from_dict(TWO_NODES).to_dict()["nodes"][0].keys()
    )


def test_without_ranks_renumbers_and_drops_empty_nodes():
    cluster = Cluster.from_dict(TWO_NODES).with_measured_slowdowns({5: 2.0})
    fewer = cluster.without_ranks([1, 4])
    assert fewer.world_size == 4
    assert [(d.rank, d.node, d.measured_slowdown) for d in fewer.devices] == [
        (0, "a", 1.0), (1, "a", 1.0), (2, "a", 1.0), (3, "b", 2.0)
    ]  # fmt: skip
    only_a = cluster.without_ranks([4, 5])
    assert [n.name for n in only_a.nodes] == ["a"] and only_a.overrides == ()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.with_measured_slowdowns({6: 2.0}), "cluster two has ranks 0..5"),
        (lambda c: c.with_measured_slowdowns({0: 0.0}), "must be > 0"),
        (lambda c: c.with_measured_slowdowns({0: float("nan")}), "must be > 0"),
        (lambda c: c.without_ranks([-1]), "lost rank -1"),
        (lambda c: c.without_ranks(range(6)), "every device is lost"),
    ],
)
def test_bad_changes_say_what_is_allowed(call, message):
    with pytest.raises(InputError, match=message):
        call(Cluster.from_dict(TWO_NODES))


@pytest.mark.parametrize(
    "factors, message",
    [
        ([2.0], "gives 1 factor\\(s\\) for node 'a' of 4 device\\(s\\)"),
        ([1, 1, 1, 1000.0], "must lie in 0.01..100"),
        ([1, 1, 1, -2.0], "must lie in 0.01..100"),
    ],
)
def test_cluster_file_checks_measured_slowdown(factors, message):
    document = {**TWO_NODES, "nodes": [{**TWO_NODES["nodes"][0], "measured_slowdown": factors},
                                       TWO_NODES["nodes"][1]]}  # fmt: skip
    with pytest.raises(InputError, match=message):
        Cluster.from_dict(document)


def test_the_simulator_prices_a_measured_slow_device(tmp_path):
    from hexiseq.search import plan_search

    cost = DatasheetCostModel()
    plan = plan_search(Cluster.from_dict(TWO_NODES), "llama3-8b", "64k", cost_model=cost).best
    slower = plan.cluster.with_measured_slowdowns({0: 2.0})
    import dataclasses

    moved = dataclasses.replace(plan, cluster=slower)
    before = predict(plan, cost_model=cost)
    after = predict(moved, cost_model=cost)
    assert after.ranks[0].linear_s == pytest.approx(2 * before.ranks[0].linear_s)
    assert after.ranks[1].linear_s == pytest.approx(before.ranks[1].linear_s)
    assert after.step_time_s > before.step_time_s
