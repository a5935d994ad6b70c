"""Tier 2: `CPHPAttention` on 2-4 real gloo ranks in spawned processes.

Each spawn runs several random layouts (hypothesis picks the seed) to keep the suite fast:
zigzag and shuffled non-contiguous ranges, 1-3 groups, uneven heads, GQA ratio 1/2/4,
causal and full attention; output and dQ/dK/dV against a float64 single-process reference.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import Case, run_random_cases
from distributed import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from traffic_cases import check_traffic

from hexiseq import InputError, build_uniform_layout, build_zigzag_layout
from hexiseq.runtime._routes import fold_transfers

pytestmark = pytest.mark.multiproc

CASES_PER_SPAWN = 8


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(max_examples=1, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_layouts_match_single_process_reference(world_size, seed):
    run_distributed(run_random_cases, world_size, seed, CASES_PER_SPAWN)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_many_random_layouts_match_single_process_reference(world_size, seed):
    run_distributed(run_random_cases, world_size, seed, 4 * CASES_PER_SPAWN)


def traffic_layout():
    """Two groups with GQA boundaries: K/V head 1 shared by ranks 2 and 0, head 0 by 1 and 3."""
    return build_zigzag_layout(
        40, 8, 4, [[2, 0], [3, 1]], [24, 16], [[1, 2], [2, 1]], [[3, 5], [1, 7]]
    )


def test_traffic_matches_the_simulator_model_and_the_documented_differences():
    layout = traffic_layout()
    assert all(fold_transfers(layout, g) for g in range(2))  # both groups fold a shared head
    run_distributed(check_traffic, 4, Case(traffic_layout(), True, batch=2, seed=5))


def refuse_on_every_rank(rank: int, world_size: int) -> None:
    """Every rank refuses, with the same message, before any communication; afterwards the
    ranks still work together."""
    from hexiseq.runtime import CPHPAttention

    with pytest.raises(InputError, match="layout is for 3 ranks"):
        CPHPAttention(build_uniform_layout(12, 4, 2, [3]))
    layout = build_uniform_layout(12, 4, 2, [1, 1])
    attention = CPHPAttention(layout)
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(InputError, match=f"rank {rank} k has shape"):
        attention(q, torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8))
    out = attention(q, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8))
    assert out.shape == q.shape


def test_refusals_on_every_rank_do_not_hang():
    run_distributed(refuse_on_every_rank, 2, timeout_s=30)
