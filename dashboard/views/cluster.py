"""Cluster views: devices by node and type, the link-bandwidth matrix, a plan's ring order."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from hexiseq.catalog import gpu_spec
from hexiseq.cluster import Cluster
from hexiseq.plan import Plan


def devices_frame(cluster: Cluster) -> pd.DataFrame:
    """One row per device: rank, node, GPU, datasheet memory and peak, emulated slowdown."""
    rows = [
        {
            "rank": device.rank,
            "node": device.node,
            "local_rank": device.local_rank,
            "gpu": device.gpu,
            "memory_GiB": cluster.gpu(device.rank).memory_GiB,
            "dense_bf16_TFLOPs": gpu_spec(device.gpu).dense_bf16_tflops,
            "emulation_slowdown": device.emulation_slowdown,
        }
        for device in cluster.devices
    ]
    return pd.DataFrame(rows)


def nodes_frame(cluster: Cluster) -> pd.DataFrame:
    """One row per node: its GPU type, device count, intra-node link and total memory."""
    rows = [
        {
            "node": node.name,
            "gpu": node.gpu,
            "devices": node.count,
            "intra_node_GBps": node.intra_node_GBps,
            "memory_GiB_total": node.count * (node.memory_GiB or gpu_spec(node.gpu).memory_GiB),
            "emulation_slowdown": node.emulation_slowdown,
        }
        for node in cluster.nodes
    ]
    return pd.DataFrame(rows)


def link_bandwidth_frame(cluster: Cluster) -> pd.DataFrame:
    """Node x node matrix of one-direction per-GPU bandwidth, GB/s (diagonal: intra-node)."""
    names = [node.name for node in cluster.nodes]
    matrix = [[cluster.link_GBps(a, b) for b in names] for a in names]
    return pd.DataFrame(matrix, index=pd.Index(names, name="from"), columns=names)


def link_heatmap_figure(cluster: Cluster) -> go.Figure:
    """Heatmap of `link_bandwidth_frame`, each cell labelled with its GB/s."""
    frame = link_bandwidth_frame(cluster)
    figure = go.Figure(
        go.Heatmap(
            z=frame.to_numpy(),
            x=list(frame.columns),
            y=list(frame.index),
            text=[[f"{value:g}" for value in row] for row in frame.to_numpy()],
            texttemplate="%{text}",
            colorscale="Viridis",
            colorbar={"title": "GB/s"},
            hovertemplate="%{y} → %{x}: %{z:g} GB/s<extra></extra>",
        )
    )
    figure.update_layout(
        title=f"Link bandwidth per GPU, one direction (GB/s): {cluster.name}",
        xaxis_title="to node",
        yaxis_title="from node",
        yaxis_autorange="reversed",
    )
    return figure


def ring_hops_frame(plan: Plan) -> pd.DataFrame:
    """One row per HP group in ring order: members, nodes, GPUs, segment length, and the hop
    to the next group (its slowest node-to-node link, GB/s; the ring's K/V blocks cross it)."""
    rows = []
    for index, replica in enumerate(plan.replicas):
        rows += _ring_hops(plan, replica.layout, replica.ranks, index)
    return pd.DataFrame(rows)


def _ring_hops(plan: Plan, layout, ranks: Sequence[int], replica: int) -> list[dict]:
    """One replica's ring (global ranks)."""
    cluster = plan.cluster
    groups = [[ranks[member] for member in group] for group in layout.groups]
    local = {rank: i for i, rank in enumerate(ranks)}
    rows = []
    for position, members in enumerate(groups):
        following = groups[(position + 1) % len(groups)]
        rows.append(
            {
                **({"replica": replica} if plan.data_parallel else {}),
                "ring_position": position,
                "ranks": ", ".join(str(rank) for rank in members),
                "nodes": ", ".join(_nodes_of(cluster, members)),
                "gpus": ", ".join(dict.fromkeys(cluster.devices[r].gpu for r in members)),
                "heads_per_rank": ", ".join(str(layout.num_heads_of(local[r])) for r in members),
                "segment_tokens": layout.segment_length(position),
                "next_group": (position + 1) % len(groups),
                "hop_GBps": _slowest_link_GBps(cluster, members, following),
            }
        )
    return rows


def _nodes_of(cluster: Cluster, ranks: tuple[int, ...]) -> list[str]:
    return list(dict.fromkeys(cluster.devices[rank].node for rank in ranks))


def _slowest_link_GBps(cluster: Cluster, sender: tuple[int, ...], receiver: tuple[int, ...]):
    return min(
        cluster.link_GBps(a, b)
        for a in _nodes_of(cluster, sender)
        for b in _nodes_of(cluster, receiver)
    )


def ring_order_figure(plan: Plan) -> go.Figure:
    """The HP groups on a circle in ring order; one arrow per hop, labelled with its GB/s."""
    hops = ring_hops_frame(plan)
    count = len(hops)
    angles = [math.pi / 2 - 2 * math.pi * i / count for i in range(count)]
    xs, ys = [math.cos(a) for a in angles], [math.sin(a) for a in angles]
    figure = go.Figure(
        go.Scatter(
            x=xs,
            y=ys,
            mode="markers+text",
            marker={"size": 28, "color": list(range(count)), "colorscale": "Turbo"},
            text=[f"g{p}" for p in hops["ring_position"]],
            textposition="middle center",
            hovertext=[
                f"group {row.ring_position}: ranks {row.ranks} ({row.gpus} on {row.nodes}), "
                f"{row.segment_tokens:,} tokens"
                for row in hops.itertuples()
            ],
            hoverinfo="text",
            name="HP groups",
        )
    )
    if count > 1:
        for row in hops.itertuples():
            _add_hop_arrow(
                figure,
                (xs[row.ring_position], ys[row.ring_position]),
                (xs[row.next_group], ys[row.next_group]),
                row.hop_GBps,
            )
    figure.update_layout(
        title=f"Ring order of {plan.name}: {count} HP group(s)",
        xaxis={"visible": False, "range": [-1.4, 1.4]},
        yaxis={"visible": False, "range": [-1.4, 1.4], "scaleanchor": "x"},
        showlegend=False,
    )
    return figure


def _add_hop_arrow(figure: go.Figure, start: tuple, end: tuple, bandwidth_GBps: float) -> None:
    shrink = 0.15  # keep the arrow off the markers
    (x0, y0), (x1, y1) = start, end
    tail = (x0 + shrink * (x1 - x0), y0 + shrink * (y1 - y0))
    head = (x1 - shrink * (x1 - x0), y1 - shrink * (y1 - y0))
    figure.add_annotation(
        x=head[0],
        y=head[1],
        ax=tail[0],
        ay=tail[1],
        xref="x",
        yref="y",
        axref="x",
        ayref="y",
        showarrow=True,
        arrowhead=3,
        arrowwidth=1.5,
        text="",
    )
    figure.add_annotation(
        x=(x0 + x1) / 2 * 1.12,
        y=(y0 + y1) / 2 * 1.12,
        text=f"{bandwidth_GBps:g} GB/s",
        showarrow=False,
        font={"size": 11},
    )
