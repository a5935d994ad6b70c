"""What-if views: a cluster as an editable table of nodes, and the cluster an edited table
describes (validated like a cluster file: one line naming what is wrong)."""

from __future__ import annotations

import math

import pandas as pd

from hexiseq.cluster import Cluster
from hexiseq.errors import InputError

NODE_COLUMNS = ["name", "gpu", "count", "intra_node_GBps"]


def editable_nodes(cluster: Cluster) -> pd.DataFrame:
    """One row per node of `cluster`: name, GPU type, device count, intra-node GB/s."""
    rows = [
        {
            "name": node.name,
            "gpu": node.gpu,
            "count": node.count,
            "intra_node_GBps": node.intra_node_GBps,
        }
        for node in cluster.nodes
    ]
    return pd.DataFrame(rows, columns=NODE_COLUMNS)


def edited_cluster(
    base: Cluster, nodes: pd.DataFrame, inter_node_GBps: float, inter_node_latency_us: float
) -> Cluster:
    """The cluster the edited `nodes` table and network describe. A node still named as in
    `base` keeps what the table does not show (emulated slowdown, memory override), and
    `base`'s per-pair link overrides are kept between the nodes that remain. Rows left
    empty are dropped. InputError (one line) for anything a cluster file would refuse."""
    kept = {node.name: node for node in base.nodes}
    document_nodes = []
    for index, row in enumerate(nodes.to_dict("records"), start=1):
        if all(_blank(row.get(column)) for column in NODE_COLUMNS):
            continue
        entry = {"name": _text(row.get("name")), "gpu": _text(row.get("gpu")),
                 "count": _whole(row.get("count"), index)}  # fmt: skip
        if not _blank(row.get("intra_node_GBps")):
            entry["intra_node_GBps"] = float(row["intra_node_GBps"])
        if entry["name"] in kept:
            node = kept[entry["name"]]
            if node.emulation_slowdown != 1.0:
                entry["emulation_slowdown"] = node.emulation_slowdown
            if node.memory_GiB is not None:
                entry["memory_GiB"] = float(node.memory_GiB)
        document_nodes.append(entry)
    names = {entry["name"] for entry in document_nodes}
    overrides = [
        {"a": a, "b": b, "GBps": GBps}
        for a, b, GBps in base.overrides
        if a in names and b in names
    ]
    document = {
        "name": base.name if _same(base, document_nodes) else f"{base.name} (edited)",
        "nodes": document_nodes,
        "network": {
            "inter_node_GBps": float(inter_node_GBps),
            "inter_node_latency_us": float(inter_node_latency_us),
            "overrides": overrides,
        },
    }
    return Cluster.from_dict(document, source="the edited cluster")


def _same(base: Cluster, document_nodes: list[dict]) -> bool:
    return editable_nodes(base).to_dict("records") == [
        {column: entry.get(column) for column in NODE_COLUMNS} for entry in document_nodes
    ]


def _blank(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def _text(value) -> str:
    return "" if _blank(value) else str(value).strip()


def _whole(value, row: int) -> int:
    if _blank(value):
        raise InputError(f"the edited cluster: node row {row} has no device count")
    number = float(value)
    if not number.is_integer():
        raise InputError(f"the edited cluster: node row {row} has {value} devices; a whole number")
    return int(number)
