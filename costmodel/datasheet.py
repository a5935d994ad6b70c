"""The datasheet cost model: peak x published efficiency per GPU, α + bytes/β links.

The embedded default until a device type has profiles (DESIGN.md §6). The efficiencies and
their sources are in `hexiseq/data/gpus.yaml`; link bandwidth comes from the catalog (intra-node)
and the cluster file (inter-node).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.catalog import gpu_spec
from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import FloatOrArray

DATASHEET_LABEL = "datasheet estimate"

# Collectives reach about 80 % of a link's nominal one-direction bandwidth: nccl-tests bus
# bandwidth on NVLink4 (H100) tops out near 370 GB/s of 450, and on a 400 Gb/s NIC near 45 of
# 50 GB/s. An assumption until `hexiseq profile links` measures each link (issue 5).
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DatasheetCostModel:
    """Op and transfer times from datasheet peaks and published efficiencies.

    Every method broadcasts over numpy arrays (see `CostModel`)."""

    link_efficiency: float = LINK_EFFICIENCY

    def label(self, gpu: str) -> str:
        return "measured CPU peak" if gpu_spec(gpu).measured else DATASHEET_LABEL

    def gemm_time_s(
        self,
        gpu: str,
        flops: FloatOrArray,
        *,
        bytes_moved: FloatOrArray | None = None,
        calls: FloatOrArray = 1,
    ) -> FloatOrArray:
        # Peak x efficiency of large GEMMs: operand bytes and launch counts are not modelled.
        spec = gpu_spec(gpu)
        return flops / (spec.peak_flops * spec.gemm_efficiency)

    def attention_time_s(
        self,
        gpu: str,
        pairs: FloatOrArray,
        heads: FloatOrArray,
        head_dim: int,
        *,
        backward: bool,
        q_tokens: FloatOrArray | None = None,
        kv_tokens: FloatOrArray | None = None,
        calls: FloatOrArray = 1,
    ) -> FloatOrArray:
        spec = gpu_spec(gpu)
        # Forward: 4·D FLOPs per pair and head; FlashAttention's backward: 2.5x (see flops.py).
        flops = 4.0 * head_dim * pairs * heads * (2.5 if backward else 1.0)
        efficiency = spec.attention_bwd_efficiency if backward else spec.attention_fwd_efficiency
        return flops / (spec.peak_flops * efficiency)

    def memory_bound_time_s(
        self, gpu: str, bytes_moved: FloatOrArray, *, calls: FloatOrArray = 1
    ) -> FloatOrArray:
        return bytes_moved / (gpu_spec(gpu).hbm_GBps * 1e9)

    def transfer_time_s(
        self, bytes_moved: FloatOrArray, bandwidth_GBps: FloatOrArray, latency_s: FloatOrArray
    ) -> FloatOrArray:
        seconds = np.where(
            np.asarray(bytes_moved) > 0,
            latency_s + np.divide(bytes_moved, bandwidth_GBps * 1e9 * self.link_efficiency),
            0.0,  # nothing to send: no message, no latency
        )
        return float(seconds) if seconds.ndim == 0 else seconds

    def link_parameters(self, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """The cluster's declared links (see `declared_link_parameters`); the link efficiency
        is applied in `transfer_time_s`, not here."""
        return declared_link_parameters(cluster)

    def memory_calibration(self, gpu: str) -> None:
        """None: the datasheet model has no measured peaks."""
        return None


def declared_link_parameters(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """[node, node] bandwidth (GB/s) and latency (s), as `Cluster.link_GBps` / `link_latency_s`
    give them (nominal: catalog intra-node links, the cluster file's network), built in one
    pass instead of one name lookup per pair."""
    count = len(cluster.nodes)
    index = {node.name: i for i, node in enumerate(cluster.nodes)}
    bandwidth = np.full((count, count), float(cluster.inter_node_GBps))
    latency = np.full((count, count), cluster.inter_node_latency_us * 1e-6)
    for a, b, gbps in reversed(cluster.overrides):  # reversed: the first matching one wins
        bandwidth[index[a], index[b]] = bandwidth[index[b], index[a]] = gbps
    for i, node in enumerate(cluster.nodes):
        bandwidth[i, i] = node.intra_node_GBps
        latency[i, i] = gpu_spec(node.gpu).intra_node_latency_us * 1e-6
    return bandwidth, latency
