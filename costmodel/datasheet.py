"""The datasheet cost model: peak x published efficiency per GPU, α + bytes/β links.

The embedded default until a device type has profiles (docs/design.md §6). The efficiencies and
their sources are in `hexiseq/data/gpus.yaml`; link bandwidth comes from the catalog (intra-node)
and the cluster file (inter-node). Attention is priced for the kernel the runtime really calls
on the device (`hexiseq.kernels.attention_kernel`), at that kernel's efficiency.

Every kernel costs at least `KERNEL_FLOOR_S`: when kernels are short the host cannot launch
them as fast as the GPU finishes them (eager PyTorch dispatches one op at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hexiseq.catalog import GpuSpec, gpu_spec
from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import FloatOrArray
from hexiseq.kernels import attention_kernel, training_dtype

DATASHEET_LABEL = "datasheet estimate"

# Collectives reach about 80 % of a link's nominal one-direction bandwidth: nccl-tests bus
# bandwidth on NVLink4 (H100) tops out near 370 GB/s of 450, and on a 400 Gb/s NIC near 45 of
# 50 GB/s. An assumption until `hexiseq profile links` measures each link (issue 5).
LINK_EFFICIENCY = 0.8

# Per-kernel floor: the time one eager PyTorch op takes from dispatch to done when its GPU work
# is negligible. Measured: hexiseq profile of H100-SXM (../shared/data/h100-profile.db), the
# elementwise points of 4K, 64K and 1M elements take 24.4, 21.6 and 20.9 µs (CUDA events
# around one call: host dispatch + launch), median 21.6 µs. A host property more than a GPU's,
# so it is used for every device type.
KERNEL_FLOOR_S = 21.6e-6

# The head size the catalog's attention efficiencies are quoted at (FA2/FA3 papers and the
# shared H100 SDPA rates use 128).
REFERENCE_HEAD_DIM = 128


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
        # Peak x efficiency of large GEMMs, never faster than the launch floor; operand bytes
        # are not modelled.
        spec = gpu_spec(gpu)
        return np.maximum(flops / (spec.peak_flops * spec.gemm_efficiency), calls * KERNEL_FLOOR_S)

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
        kernel: str | None = None,
    ) -> FloatOrArray:
        return pairs * heads * _pair_head_seconds(gpu, kernel, head_dim, backward)

    def memory_bound_time_s(
        self, gpu: str, bytes_moved: FloatOrArray, *, calls: FloatOrArray = 1
    ) -> FloatOrArray:
        spec = gpu_spec(gpu)
        bandwidth_Bps = spec.hbm_GBps * 1e9 * spec.memory_bound_efficiency
        return np.maximum(np.divide(bytes_moved, bandwidth_Bps), calls * KERNEL_FLOOR_S)

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


@lru_cache(maxsize=1024)
def _pair_head_seconds(gpu: str, kernel: str | None, head_dim: int, backward: bool) -> float:
    """`attention_seconds_per_pair_head` of a catalog GPU and its kernel (the kernel rule's
    where None): the catalog is read once, so this is computed once per such shape (a step
    simulation asks for it per GPU model, ring step table and pass)."""
    kernel = kernel or attention_kernel(gpu, training_dtype(gpu), head_dim)
    return attention_seconds_per_pair_head(gpu_spec(gpu), kernel, head_dim, backward)


def attention_seconds_per_pair_head(
    spec: GpuSpec, kernel: str, head_dim: int, backward: bool
) -> float:
    """Seconds of `kernel` per (query, key) pair and head on `spec`'s GPU.

    FLOPs: 4·D per pair and head forward, 2.5x that backward (FlashAttention-2's five matmuls
    against two, `hexiseq.flops`). The catalog's efficiency holds at head size 128. Where the
    GPU's special-function rate is known, the pair's one exponential (the softmax, recomputed
    in the backward) is costed apart from the matmuls: it does not shrink with the head size,
    so small heads run at a lower fraction of peak (FlashAttention-3, Shah et al. 2024, §3: the
    exp throughput is 256x below the matmul's on H100 while head size 128 does only 512x the
    FLOPs). Time = D x (matmul seconds per dimension) + 1 exp, which at D = 128 reproduces the
    catalog efficiency. FA2 does not overlap the two, so they add; FA3-class kernels overlap
    part of it, which makes this an upper bound for them at small heads.
    """
    factor = 2.5 if backward else 1.0
    efficiency = spec.kernel_efficiency(kernel, backward=backward)
    reference_s = 4.0 * REFERENCE_HEAD_DIM * factor / (spec.peak_flops * efficiency)
    if spec.special_function_tops is None or kernel in ("cpu_flash", "explicit"):
        return reference_s * head_dim / REFERENCE_HEAD_DIM
    exp_s = 1.0 / (spec.special_function_tops * 1e12)
    matmul_s = max(reference_s - exp_s, 0.5 * reference_s)  # inconsistent numbers: keep sane
    return matmul_s * head_dim / REFERENCE_HEAD_DIM + exp_s
