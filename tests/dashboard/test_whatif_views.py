"""The what-if page's cluster editor: a cluster as a table of nodes, and the cluster an edited
table describes (checked as a cluster file is)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from hexiseq import Cluster
from hexiseq.dashboard.views import whatif as views
from hexiseq.errors import InputError

WITH_OVERRIDE = {
    "name": "three",
    "nodes": [
        {"name": "a", "gpu": "H100-SXM", "count": 8},
        {"name": "b", "gpu": "A100-80G", "count": 8},
        {"name": "c", "gpu": "cpu", "count": 2, "emulation_slowdown": 2.0, "memory_GiB": 64.0},
    ],
    "network": {"inter_node_GBps": 50, "overrides": [{"a": "a", "b": "b", "GBps": 25}]},
}


def _edit(base: Cluster, nodes: pd.DataFrame, GBps: float = 50.0) -> Cluster:
    return views.edited_cluster(base, nodes, GBps, base.inter_node_latency_us)


def test_an_unedited_table_is_the_same_cluster():
    base = Cluster.from_dict(WITH_OVERRIDE)
    again = _edit(base, views.editable_nodes(base))
    assert again.to_dict() == base.to_dict()


def test_nodes_added_removed_and_retyped():
    base = Cluster.from_dict(WITH_OVERRIDE)
    nodes = views.editable_nodes(base)
    nodes.loc[1, "gpu"] = "H200"  # b: another GPU type
    nodes = nodes.drop(index=0)  # a removed: its override goes with it
    nodes.loc[3] = {"name": "d", "gpu": "L40S", "count": 4, "intra_node_GBps": math.nan}
    nodes.loc[4] = {"name": None, "gpu": None, "count": math.nan, "intra_node_GBps": None}
    edited = _edit(base, nodes, GBps=12.5)
    assert [(n.name, n.gpu, n.count) for n in edited.nodes] == [
        ("b", "H200", 8), ("c", "cpu", 2), ("d", "L40S", 4)
    ]  # fmt: skip
    assert edited.name == "three (edited)" and edited.inter_node_GBps == 12.5
    assert edited.overrides == ()
    c = edited.nodes[1]
    assert (c.emulation_slowdown, c.memory_GiB) == (2.0, 64.0)  # kept from the base node
    assert edited.world_size == 14


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("count", 2.5, "2.5 devices; a whole number"),
        ("count", math.nan, "has no device count"),
        ("count", 0, "count"),
        ("gpu", "TPU-v5", "TPU-v5"),
        ("name", "b", "unique"),
        ("intra_node_GBps", -1.0, "intra_node_GBps"),
    ],
)
def test_a_bad_edit_is_one_line(column, value, message):
    base = Cluster.from_dict(WITH_OVERRIDE)
    nodes = views.editable_nodes(base)
    nodes[column] = nodes[column].astype(object)
    nodes.loc[0, column] = value
    with pytest.raises(InputError, match=message) as caught:
        _edit(base, nodes)
    assert "\n" not in str(caught.value)


def test_a_network_out_of_range_is_one_line():
    base = Cluster.from_dict(WITH_OVERRIDE)
    with pytest.raises(InputError, match="inter_node_GBps"):
        _edit(base, views.editable_nodes(base), GBps=0.0)
