"""A cost model with round numbers, so simulator results can be checked by hand."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hexiseq.costmodel.datasheet import declared_link_parameters


@dataclass(frozen=True)
class RoundNumberCost:
    """Attention: `seconds_per_pair_head` per (pair, head) forward, 2x backward; matmuls and
    bandwidth-bound kernels free; links: bytes / bandwidth, no latency or efficiency loss."""

    seconds_per_pair_head: float = 1e-6
    seconds_per_flop: float = 0.0

    def label(self, gpu: str) -> str:
        return "round numbers"

    def gemm_time_s(self, gpu: str, flops: float, **_shape) -> float:
        return flops * self.seconds_per_flop

    def attention_time_s(self, gpu, pairs, heads, head_dim, *, backward, **_shape):
        return pairs * heads * self.seconds_per_pair_head * (2.0 if backward else 1.0)

    def memory_bound_time_s(self, gpu: str, bytes_moved: float, **_shape) -> float:
        return 0.0 * bytes_moved  # free, in the shape of `bytes_moved`

    def transfer_time_s(self, bytes_moved, bandwidth_GBps, latency_s):
        # Broadcasts over arrays as the CostModel protocol asks (no `if` on the bytes).
        latency = np.where(np.asarray(bytes_moved) != 0, latency_s, 0.0)
        return bytes_moved / (bandwidth_GBps * 1e9) + latency

    def link_parameters(self, cluster):
        return declared_link_parameters(cluster)

    def memory_calibration(self, gpu):
        return None


@pytest.fixture
def round_cost() -> RoundNumberCost:
    return RoundNumberCost()


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group for the runtime's real step (memory and census tests)."""
    import os
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    dist = torch.distributed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from distributed import free_port

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
