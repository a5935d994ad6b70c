"""The step simulator's count of a block's elementwise work against the runtime's operators
(`benchmarks/step_census.py`: the real step on CPU under a dispatch-mode census).

The simulator counts 97 % of the bytes and 96-99 % of the kernels of the runtime's one-rank
step on CPU (RESULTS.md `step_census`; RMSNorm as its math, as a CPU rank runs it); the bands
hold that, so a change to the runtime's kernels, or to the counts, that widens the gap fails
here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


from hexiseq import ModelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from step_census import measured_block, modelled_block  # noqa: E402

BYTES_BAND = (0.92, 1.05)
KERNELS_BAND = (0.92, 1.08)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_simulator_counts_what_a_block_really_moves(one_rank_group, checkpointing):
    model = ModelSpec.preset("small")
    measured = measured_block(model, checkpointing)
    modelled = modelled_block(model, checkpointing)
    ratio = modelled.bytes_per_token / measured.bytes_per_token
    assert BYTES_BAND[0] <= ratio <= BYTES_BAND[1], (ratio, measured.top)
    kernels = modelled.kernels / measured.kernels
    assert KERNELS_BAND[0] <= kernels <= KERNELS_BAND[1], (measured.kernels, modelled.kernels)
