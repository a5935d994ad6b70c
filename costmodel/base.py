"""The interface every cost-model backend implements (datasheet now, fitted profiles later)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

FloatOrArray = float | np.ndarray
"""A number, or a numpy array of numbers; cost-model methods broadcast over arrays."""


class CostModel(Protocol):
    """Predicts op times on a GPU type and transfer times on a link, in seconds.

    Every numeric argument may be a float or a numpy array (int or float); arrays broadcast
    against each other and the result is an array of the broadcast shape, element by element
    what the call with floats would return. The step simulator relies on this: it calls each
    method once per GPU type with the arrays of all ranks of that type and all ring steps,
    not once per rank, so a backend must not branch on a numeric argument with `if`.
    """

    def label(self, gpu: str) -> str:
        """Where this model's numbers for `gpu` come from, e.g. "datasheet estimate"."""
        ...

    def gemm_time_s(self, gpu: str, flops: FloatOrArray) -> FloatOrArray:
        """Time of dense matmuls doing `flops` FLOPs (large, well-shaped GEMMs)."""
        ...

    def attention_time_s(
        self, gpu: str, pairs: FloatOrArray, heads: FloatOrArray, head_dim: int, *, backward: bool
    ) -> FloatOrArray:
        """Time of a flash-attention block over `pairs` (query, key) pairs for `heads` heads."""
        ...

    def memory_bound_time_s(self, gpu: str, bytes_moved: FloatOrArray) -> FloatOrArray:
        """Time of bandwidth-bound elementwise/norm kernels moving `bytes_moved` bytes."""
        ...

    def transfer_time_s(
        self, bytes_moved: FloatOrArray, bandwidth_GBps: FloatOrArray, latency_s: FloatOrArray
    ) -> FloatOrArray:
        """Time to move `bytes_moved` over a link of `bandwidth_GBps` (one direction): 0 where
        `bytes_moved` is 0 (no message is sent, so no latency either)."""
        ...
