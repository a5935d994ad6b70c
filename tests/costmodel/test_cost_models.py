"""What every cost-model backend must do (the `CostModel` protocol), run on each backend.

The step simulator calls each method once per GPU type with the arrays of all its ranks and
ring steps, so every backend must broadcast over numpy arrays and give, element by element,
exactly what the call with plain numbers gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fit_gpu import h100_sources

from hexiseq.costmodel import DatasheetCostModel, FittedCostModel, fit_cost_model

PAIRS = np.array([[0, 10, 1_000_000], [5, 12_345, 7]], dtype=np.int64)
HEADS = np.array([[1], [7]], dtype=np.int64)
BYTES = np.array([0, 1, 4096, 3 * 10**9], dtype=np.int64)
BANDWIDTH_GBPS = np.array([900.0, 50.0, 12.5, 25.0])
LATENCY_S = np.array([2e-6, 1e-5, 0.0, 1e-5])


GPU = "H100-SXM"  # the GPU type the fitted backend has fits for (the shared H100 profile)
PROFILED_KERNEL = "flash"  # the attention kernel that profile timed


@pytest.fixture(scope="module")
def h100_fitted() -> FittedCostModel:
    """The fitted backend on the shared real H100 profile (fits that missed a goal forced in,
    so that every op family answers from its fit)."""
    return FittedCostModel(fit_cost_model(h100_sources()), forced=True)


@pytest.fixture(params=["datasheet", "round numbers", "fitted"])
def cost(request, round_cost, h100_fitted):
    backends = {"datasheet": DatasheetCostModel(), "round numbers": round_cost,
                "fitted": h100_fitted}  # fmt: skip
    return backends[request.param]


def test_the_fitted_backend_answers_from_its_fits_not_the_datasheet(h100_fitted):
    """Else the suite would run the fitted backend's datasheet fallback only."""
    datasheet = DatasheetCostModel()
    kernel = PROFILED_KERNEL
    calls = [
        lambda c: c.gemm_time_s(GPU, 1e12),
        lambda c: c.memory_bound_time_s(GPU, 1e9),
        lambda c: c.attention_time_s(GPU, 10**8, 8, 128, backward=False, kernel=kernel),
        lambda c: c.attention_time_s(GPU, 10**8, 8, 128, backward=True, kernel=kernel),
    ]
    for call in calls:
        assert call(h100_fitted) != call(datasheet)


@pytest.mark.parametrize("backward", [False, True])
def test_attention_time_broadcasts_like_scalar_calls(cost, backward):
    kernel = PROFILED_KERNEL
    seconds = cost.attention_time_s(GPU, PAIRS, HEADS, 128, backward=backward, kernel=kernel)
    assert seconds.shape == PAIRS.shape
    for (row, column), pairs in np.ndenumerate(PAIRS):
        heads = int(HEADS[row, 0])
        expected = cost.attention_time_s(GPU, int(pairs), heads, 128, backward=backward,
                                         kernel=kernel)  # fmt: skip
        assert seconds[row, column] == expected


def test_gemm_and_memory_bound_times_broadcast_like_scalar_calls(cost):
    gemm = cost.gemm_time_s(GPU, BYTES.astype(np.float64))
    memory = cost.memory_bound_time_s(GPU, BYTES)
    for i, value in enumerate(BYTES.tolist()):
        assert gemm[i] == cost.gemm_time_s(GPU, float(value))
        assert memory[i] == cost.memory_bound_time_s(GPU, value)


def test_gemm_and_memory_bound_times_broadcast_over_rank_by_part_tables(cost):
    """The simulator prices all of a step's GEMMs, and all its bandwidth-bound kernels, as
    one [rank, part] table per GPU type, with per-element operand bytes and kernel counts."""
    moved = np.array([[0.0, 4096.0, 3e9], [1.0, 5e6, 7e8]])
    flops = np.array([[1e9, 2e12, 5e10], [0.0, 3e6, 8e11]])
    calls = np.array([[1.0, 3.0, 0.0], [4.0, 1.0, 96.0]])
    gemm = cost.gemm_time_s(GPU, flops, bytes_moved=moved, calls=calls)
    memory = cost.memory_bound_time_s(GPU, moved, calls=calls)
    for (i, j), value in np.ndenumerate(moved):
        assert gemm[i, j] == cost.gemm_time_s(
            GPU, float(flops[i, j]), bytes_moved=float(value), calls=int(calls[i, j])
        )
        assert memory[i, j] == cost.memory_bound_time_s(GPU, float(value), calls=int(calls[i, j]))


def test_transfer_time_broadcasts_and_is_zero_without_bytes(cost):
    seconds = cost.transfer_time_s(BYTES[:, None], BANDWIDTH_GBPS, LATENCY_S)
    assert seconds.shape == (len(BYTES), len(BANDWIDTH_GBPS))
    assert np.all(seconds[0] == 0.0)  # no bytes: no message, so no latency either
    for (i, j), value in np.ndenumerate(seconds):
        scalar = cost.transfer_time_s(int(BYTES[i]), BANDWIDTH_GBPS[j], LATENCY_S[j])
        assert value == scalar


def test_scalar_calls_return_plain_numbers(cost):
    assert isinstance(cost.transfer_time_s(0, 50.0, 1e-5), float)
    assert isinstance(cost.transfer_time_s(1024, 50.0, 1e-5), float)
