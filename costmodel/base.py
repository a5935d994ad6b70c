"""The interface every cost-model backend implements (datasheet, fitted profiles)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from hexiseq.cluster import Cluster
    from hexiseq.costmodel.memory import MemoryCalibration

FloatOrArray = float | np.ndarray
"""A number, or a numpy array of numbers; cost-model methods broadcast over arrays."""


class CostModel(Protocol):
    """Predicts op times on a GPU type and transfer times on a link, in seconds.

    Every numeric argument may be a float or a numpy array (int or float); arrays broadcast
    against each other and the result is an array of the broadcast shape, element by element
    what the call with floats would return. The step simulator relies on this: it calls each
    method once per GPU type with the arrays of all ranks of that type and all ring steps,
    not once per rank, so a backend must not branch on a numeric argument with `if`.

    The keyword-only arguments after `*` say more about the work for backends that can use it
    (a fitted model's bytes and per-call terms); a backend may ignore them. Sums: `flops` and
    `bytes_moved` are totals over `calls` kernel launches of the same kind.
    """

    def label(self, gpu: str) -> str:
        """Where this model's numbers for `gpu` come from, e.g. "datasheet estimate"."""
        ...

    def gemm_time_s(
        self,
        gpu: str,
        flops: FloatOrArray,
        *,
        bytes_moved: FloatOrArray | None = None,
        calls: FloatOrArray = 1,
    ) -> FloatOrArray:
        """Time of dense matmuls doing `flops` FLOPs (large, well-shaped GEMMs); `bytes_moved`:
        bytes their operands read and write, (m·k + k·n + m·n)·element size per GEMM (None:
        unknown); `calls`: how many GEMMs."""
        ...

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
        """Time of `calls` flash-attention blocks over `pairs` (query, key) pairs in all, for
        `heads` heads; `q_tokens` / `kv_tokens`: query and key lengths of one block, whose
        q_tokens x kv_tokens box holds more than its share of `pairs` when a causal mask
        removes some (None: unknown); `kernel`: the attention backend (`hexiseq.kernels`),
        None: the one the runtime runs on `gpu` (`attention_kernel`)."""
        ...

    def memory_bound_time_s(
        self, gpu: str, bytes_moved: FloatOrArray, *, calls: FloatOrArray = 1
    ) -> FloatOrArray:
        """Time of `calls` bandwidth-bound elementwise/norm kernels moving `bytes_moved` bytes,
        per-kernel launch costs included (the step simulator books what `calls` adds over one
        kernel as launch overhead)."""
        ...

    def transfer_time_s(
        self, bytes_moved: FloatOrArray, bandwidth_GBps: FloatOrArray, latency_s: FloatOrArray
    ) -> FloatOrArray:
        """Time to move `bytes_moved` over a link of `bandwidth_GBps` (one direction): 0 where
        `bytes_moved` is 0 (no message is sent, so no latency either)."""
        ...

    def link_parameters(self, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """[node, node] bandwidth (GB/s, one direction, per GPU) and per-message latency (s)
        of the links between the nodes of `cluster`, as `transfer_time_s` takes them."""
        ...

    def memory_calibration(self, gpu: str) -> MemoryCalibration | None:
        """The memory model's calibration for `gpu` from measured peaks; None: uncalibrated."""
        ...


def memory_calibrations(cost: CostModel, gpus: Iterable[str]) -> dict[str, MemoryCalibration]:
    """`gpu` -> its calibration, for the `gpus` the cost model has one for."""
    found = {gpu: cost.memory_calibration(gpu) for gpu in set(gpus)}
    return {gpu: calibration for gpu, calibration in found.items() if calibration is not None}
