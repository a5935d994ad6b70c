"""Cost-model backends written before the protocol's keywords and `link_parameters` existed.

Such a backend (tests' round-number models, third-party ones) lacks `link_parameters` and may
refuse the keyword-only arguments the simulator now passes. `with_full_protocol` wraps it so
that the simulator can treat every backend alike: the wrapper drops the new keywords and
gives the cluster's declared links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import CostModel, FloatOrArray
from hexiseq.costmodel.datasheet import declared_link_parameters


def with_full_protocol(cost: Any) -> CostModel:
    """`cost` itself when it has `link_parameters`, else a wrapper that adds it."""
    return cost if hasattr(cost, "link_parameters") else _LegacyCostModel(cost)


@dataclass(frozen=True)
class _LegacyCostModel:
    """A pre-keyword backend seen through the current protocol."""

    inner: Any

    def label(self, gpu: str) -> str:
        return self.inner.label(gpu)

    def gemm_time_s(self, gpu: str, flops: FloatOrArray, **_: Any) -> FloatOrArray:
        return self.inner.gemm_time_s(gpu, flops)

    def attention_time_s(
        self,
        gpu: str,
        pairs: FloatOrArray,
        heads: FloatOrArray,
        head_dim: int,
        *,
        backward: bool,
        **_: Any,
    ) -> FloatOrArray:
        return self.inner.attention_time_s(gpu, pairs, heads, head_dim, backward=backward)

    def memory_bound_time_s(self, gpu: str, bytes_moved: FloatOrArray, **_: Any) -> FloatOrArray:
        return self.inner.memory_bound_time_s(gpu, bytes_moved)

    def transfer_time_s(
        self, bytes_moved: FloatOrArray, bandwidth_GBps: FloatOrArray, latency_s: FloatOrArray
    ) -> FloatOrArray:
        return self.inner.transfer_time_s(bytes_moved, bandwidth_GBps, latency_s)

    def link_parameters(self, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        return declared_link_parameters(cluster)
