"""The interface every cost-model backend implements (datasheet now, fitted profiles later)."""

from __future__ import annotations

from typing import Protocol


class CostModel(Protocol):
    """Predicts op times on a GPU type and transfer times on a link, in seconds."""

    def label(self, gpu: str) -> str:
        """Where this model's numbers for `gpu` come from, e.g. "datasheet estimate"."""
        ...

    def gemm_time_s(self, gpu: str, flops: float) -> float:
        """Time of dense matmuls doing `flops` FLOPs (large, well-shaped GEMMs)."""
        ...

    def attention_time_s(
        self, gpu: str, pairs: float, heads: float, head_dim: int, *, backward: bool
    ) -> float:
        """Time of a flash-attention block over `pairs` (query, key) pairs for `heads` heads."""
        ...

    def memory_bound_time_s(self, gpu: str, bytes_moved: float) -> float:
        """Time of bandwidth-bound elementwise/norm kernels moving `bytes_moved` bytes."""
        ...

    def transfer_time_s(
        self, bytes_moved: float, bandwidth_GBps: float, latency_s: float
    ) -> float:
        """Time to move `bytes_moved` over a link of `bandwidth_GBps` (one direction)."""
        ...
