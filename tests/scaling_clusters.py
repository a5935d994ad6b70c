"""Clusters shaped like `benchmarks/planner_scaling.py`'s cells (shared by the search tests)."""

from __future__ import annotations

from hexiseq import Cluster


def planner_scaling_cluster(
    gpus: int, types: list[str] | tuple[str, ...], slow_pair_GBps: float | None = None
) -> Cluster:
    """`gpus` GPUs in nodes of 8, the types round-robin by node, 50 GB/s between nodes
    (node0-node1 at `slow_pair_GBps` where given, as in the benchmark)."""
    nodes = [
        {"name": f"node{i}", "gpu": types[i % len(types)], "count": 8} for i in range(gpus // 8)
    ]
    network: dict = {"inter_node_GBps": 50.0}
    if slow_pair_GBps is not None:
        network["overrides"] = [{"a": "node0", "b": "node1", "GBps": slow_pair_GBps}]
    return Cluster.from_dict({"name": "cell", "nodes": nodes, "network": network})
