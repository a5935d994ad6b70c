"""The ring's fast paths against its general path and the single-process reference.

Rows nothing has reached are written, not merged or added (`OnlineSoftmax`, `RowSum`); K/V
heads of whole GQA groups are repeated and summed back over a view (`HeadExpansion` by
repeats), not gathered and scatter-added. Each must give what the general path gives (fp32
relative error <= 1e-5, on fresh random inputs); uneven head splits keep the general path.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import TOLERANCE, Case, check_case, relative_error
from distributed import run_distributed

from hexiseq import AttentionLayout, build_zigzag_layout
from hexiseq.runtime._block import (
    HeadExpansion,
    OnlineSoftmax,
    RowSum,
    Untouched,
    block_gradients,
    expansion_index,
    head_expansion,
)
from hexiseq.runtime._ring import RingContext
from hexiseq.runtime._routes import build_rank_routes
from hexiseq.runtime._tiles import Tile, block_tiles
from hexiseq.runtime.kernels import block_forward

SCALE = 0.35


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert expected.abs().sum() > 0  # a comparison of zeros proves nothing
    error = relative_error(actual, expected.double())
    assert error <= TOLERANCE, error


# --- untouched rows ---------------------------------------------------------------------------


def test_untouched_hands_out_each_row_once():
    untouched = Untouched(10)
    assert untouched.take(2, 5) == [(2, 5)]
    assert untouched.take(0, 8) == [(0, 2), (5, 8)]
    assert untouched.take(3, 7) == []
    assert untouched.ranges == [(8, 10)]
    assert Untouched(0).take(0, 0) == []


# --- online softmax ---------------------------------------------------------------------------


def general_merge(q_BHLD, results):
    """The general path alone: state from zeros/-inf, every result merged with logaddexp."""
    out = torch.zeros(q_BHLD.shape)
    lse = torch.full(q_BHLD.shape[:3], float("-inf"))
    for rows, block_out, block_lse in results:
        new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
        finite = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
        old_weight = torch.exp(lse[:, :, rows] - finite)[..., None]
        new_weight = torch.exp(block_lse - finite)[..., None]
        out[:, :, rows] = old_weight * out[:, :, rows] + new_weight * block_out.float()
        lse[:, :, rows] = new_lse
    return out, lse


def block_results(q_BHLD, row_slices, seed):
    """A forward result of a fresh random K/V block for each slice of rows."""
    batch, heads, _, head_dim = q_BHLD.shape
    results = []
    for i, rows in enumerate(row_slices):
        k, v = (
            randn(batch, heads, 5, head_dim, seed=seed + 2 * i + j, dtype=q_BHLD.dtype)
            for j in (1, 2)
        )
        results.append((rows, *block_forward(q_BHLD[:, :, rows], k, v, causal=False, scale=SCALE)))
    return results


def merged(q_BHLD, results):
    state = OnlineSoftmax(q_BHLD)
    for rows, out, lse in results:
        state.merge(rows, out.clone(), lse.clone())
    return state


def test_a_first_result_over_every_row_is_the_state_as_it_is():
    q = randn(2, 3, 6, 8, seed=1)
    ((rows, out, lse),) = block_results(q, [slice(0, 6)], seed=2)
    state = OnlineSoftmax(q)
    state.merge(rows, out, lse)
    assert state.out_BHLD is out and state.lse_BHL is lse  # nothing allocated, nothing merged


@pytest.mark.parametrize(
    "row_slices",
    [
        [slice(None), slice(0, 4), slice(2, 6)],  # adopted, then merged
        [slice(0, 3), slice(3, 6), slice(0, 6)],  # written row by row, then merged
        [slice(1, 4), slice(0, 2), slice(3, 6), slice(2, 5)],  # overlaps half fresh rows
    ],
    ids=["adopted", "written", "partly-fresh"],
)
def test_fresh_rows_written_equal_the_general_merge(row_slices):
    q = randn(2, 3, 6, 8, seed=3)
    results = block_results(q, row_slices, seed=4)
    state = merged(q, results)
    want_out, want_lse = general_merge(q, results)
    assert_close(state.out_BHLD, want_out)
    assert_close(state.lse_BHL, want_lse)


def test_rows_no_block_reached_stay_minus_infinity_and_zero():
    q = randn(1, 2, 9, 8, seed=5)
    results = block_results(q, [slice(2, 4), slice(6, 8), slice(3, 7)], seed=6)
    state = merged(q, results)
    untouched = [0, 1, 8]
    assert torch.isneginf(state.lse_BHL[:, :, untouched]).all()
    assert torch.equal(state.out_BHLD[:, :, untouched], torch.zeros(1, 2, 3, 8))
    assert not torch.isnan(state.out_BHLD).any()
    want_out, want_lse = general_merge(q, results)
    assert_close(state.out_BHLD, want_out)
    assert torch.equal(torch.isinf(state.lse_BHL), torch.isinf(want_lse))
    assert OnlineSoftmax(q).lse_BHL.isneginf().all()  # nothing merged at all


def test_an_adopted_bfloat16_output_needs_no_fp32_round_trip():
    q = randn(1, 2, 4, 8, seed=7, dtype=torch.bfloat16)
    ((rows, out, lse),) = block_results(q, [slice(None)], seed=8)
    state = OnlineSoftmax(q)
    state.merge(rows, out, lse)
    assert state.output(torch.bfloat16) is out
    assert torch.equal(state.out_BHLD, out.float())


# --- gradient sums ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row_slices",
    [[slice(None)], [slice(None), slice(1, 3)], [slice(0, 2), slice(4, 5), slice(1, 5)]],
    ids=["adopted", "adopted-then-added", "written-partly-fresh"],
)
def test_row_sum_equals_zeros_plus_adds(row_slices):
    shape = (2, 3, 5, 4)
    parts = [randn(2, 3, len(range(5)[s]), 4, seed=10 + i) for i, s in enumerate(row_slices)]
    total = RowSum(shape, torch.device("cpu"))
    want = torch.zeros(shape, dtype=torch.float64)
    for rows, part in zip(row_slices, parts):
        total.add(rows, part.clone())
        want[:, :, rows] += part.double()
    got = total.finish()
    assert got.dtype == torch.float32
    assert_close(got, want)
    unreached = want.abs().sum(dim=(0, 1, 3)) == 0
    assert torch.equal(got[:, :, unreached], torch.zeros_like(got[:, :, unreached]))


def test_row_sum_into_a_buffer_ignores_what_it_held():
    buffer = torch.full((2, 6, 3), float("nan"))
    part = randn(2, 3, 3, seed=12, dtype=torch.bfloat16)
    total = RowSum.into(buffer)
    total.add(slice(1, 4), part)
    total.add(slice(2, 4), part[:, 1:])
    assert total.finish() is buffer
    want = torch.zeros(2, 6, 3, dtype=torch.float64)
    want[:, 1:4] += part.double()
    want[:, 2:4] += part[:, 1:].double()
    assert_close(buffer, want)


def test_a_single_bfloat16_contribution_keeps_its_dtype_until_a_second_one():
    part = randn(1, 2, 4, 3, seed=13, dtype=torch.bfloat16)
    alone = RowSum(part.shape, part.device)
    alone.add(slice(None), part)
    assert alone.finish() is part
    both = RowSum(part.shape, part.device)
    both.add(slice(None), part.clone())
    both.add(slice(0, 2), part[:, :, :2])
    want = part.double()
    want[:, :, :2] *= 2
    assert both.finish().dtype == torch.float32
    assert_close(both.finish(), want)


# --- head expansion ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads,ratio,repeats",
    [
        ((0, 8), 1, 1),  # no GQA
        ((4, 12), 4, 4),  # whole groups
        ((0, 24), 3, 3),  # llama3.2-3b on one rank
        ((2, 6), 4, 2),  # half groups: each K/V head serves 2 of the rank's heads
        ((0, 2), 4, 2),
        ((1, 6), 4, None),  # an uneven split: the general path
        ((3, 9), 4, None),
    ],
)
def test_expansion_by_repeats_only_where_exact(heads, ratio, repeats):
    kv_heads = (heads[0] // ratio, -(-heads[1] // ratio))
    index = expansion_index(heads, kv_heads, ratio)
    expansion = head_expansion(index, torch.device("cpu"))
    if repeats is None:
        assert expansion.index.tolist() == index
        return
    assert expansion == HeadExpansion(repeats, None)
    assert index == [i // repeats for i in range(len(index))]


@pytest.mark.parametrize("heads,ratio", [((4, 12), 4), ((2, 6), 4), ((1, 6), 4), ((0, 6), 1)])
def test_expand_and_reduce_equal_gather_and_scatter_add(heads, ratio):
    kv_heads = (heads[0] // ratio, -(-heads[1] // ratio))
    index = expansion_index(heads, kv_heads, ratio)
    expansion = head_expansion(index, torch.device("cpu"))
    kv = randn(2, 2, kv_heads[1] - kv_heads[0], 5, 4, seed=14)
    assert torch.equal(expansion.expand(kv), kv.index_select(2, torch.tensor(index)))
    d = randn(2, len(index), 5, 4, seed=15, dtype=torch.bfloat16)
    want = torch.zeros(2, kv.shape[2], 5, 4, dtype=torch.float64)
    want.index_add_(1, torch.tensor(index), d.double())
    assert_close(expansion.reduce(d, kv.shape[2]), want)


# --- block gradients --------------------------------------------------------------------------


def staircase(query_ranges, key_ranges) -> tuple[Tile, ...]:
    return block_tiles(query_ranges, key_ranges, causal=True)


TILINGS = {
    "one-tile": ([(0, 8)], [(0, 8)]),  # the own block of a zigzag layout
    "staircase": ([(0, 3), (6, 9)], [(1, 5), (7, 11)]),  # 3 rows x 8 keys, several tiles
    "unreached-keys": ([(4, 10)], [(2, 14)]),  # keys after every query get no gradient
}


def block_inputs(rows, keys, heads, kv_heads, seed):
    q = randn(2, heads, rows, 8, seed=seed)
    kv = randn(2, 2, kv_heads, keys, 8, seed=seed + 1)
    dout = randn(2, heads, rows, 8, seed=seed + 2)
    return q, kv, dout


def global_forward(q, kv, tiles, expansion):
    state = OnlineSoftmax(q)
    k, v = expansion.expand(kv)
    for tile in tiles:
        q_tile, k_tile, v_tile = q[:, :, tile.rows], k[:, :, tile.keys], v[:, :, tile.keys]
        state.merge(
            tile.rows, *block_forward(q_tile, k_tile, v_tile, causal=tile.causal, scale=SCALE)
        )
    return state.out_BHLD, state.lse_BHL


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (3, 3)], ids=["gqa", "mha"])
def test_block_gradients_equal_the_general_path(tiling, heads, kv_heads):
    """Repeats vs an explicit gather index, one tile vs a staircase; dQ summed over two
    passes, as over two ring steps."""
    tiles = staircase(*TILINGS[tiling])
    rows, keys = max(t.row_end for t in tiles), sum(b - a for a, b in TILINGS[tiling][1])
    q, kv, dout = block_inputs(rows, keys, heads, kv_heads, seed=16)
    ratio = heads // kv_heads
    index = [h // ratio for h in range(heads)]
    fast, general = head_expansion(index, q.device), HeadExpansion(1, torch.tensor(index))
    assert fast.index is None
    out, lse = global_forward(q, kv, tiles, general)
    saved = (dout, q, out, lse)
    results = []
    for expansion in (fast, general):
        dq = RowSum(q.shape, q.device)
        dkv = [block_gradients(dq, saved, kv, tiles, expansion, SCALE) for _ in range(2)]
        results.append((dq.finish(), *dkv))
    for got, want in zip(*results):
        assert_close(got, want.double())
    if tiling == "unreached-keys":
        dkv = results[0][1]
        assert torch.equal(dkv[:, :, :, 8:], torch.zeros_like(dkv[:, :, :, 8:]))


def test_block_gradients_of_one_tile_match_autograd():
    tiles = staircase([(0, 6)], [(0, 6)])
    q, kv, dout = block_inputs(6, 6, 6, 2, seed=20)
    expansion = head_expansion([h // 3 for h in range(6)], q.device)
    out, lse = global_forward(q, kv, tiles, expansion)
    dq = RowSum(q.shape, q.device)
    dkv = block_gradients(dq, (dout, q, out, lse), kv, tiles, expansion, SCALE)
    leaves = [x.double().requires_grad_() for x in (q, kv)]
    k, v = leaves[1].repeat_interleave(3, dim=2)
    scores = (leaves[0] @ k.transpose(-1, -2) * SCALE).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")
    )
    (torch.softmax(scores, dim=-1) @ v).backward(dout.double())
    assert_close(dq.finish(), leaves[0].grad)
    assert_close(dkv, leaves[1].grad)


# --- the ring ---------------------------------------------------------------------------------


def test_ring_context_picks_repeats_for_whole_groups_and_the_index_for_split_ones():
    layout = uneven_layout()
    expansions = [
        RingContext(build_rank_routes(layout, rank), layout.gqa_ratio).indices(torch.device("cpu"))
        for rank in range(layout.world_size)
    ]
    assert expansions[0].expansion == HeadExpansion(3, None)  # heads 0-2 of K/V head 0
    assert expansions[1].expansion.index.tolist() == [0, 1, 1, 1, 1]  # heads 3-7
    assert expansions[2].expansion == HeadExpansion(4, None)  # all heads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [6, 3, 2], ids=["mha", "gqa2", "gqa3"])
def test_one_step_ring_matches_reference(one_rank_group, causal, kv_heads):
    """One rank, one ring step, one tile: adopted forward state, dQ and dK/dV written, K/V by
    repeats; against the float64 reference."""
    layout = build_zigzag_layout(14, 6, kv_heads, [[0]], [14], [[1]], [[6]])
    check_case(Case(layout, causal, batch=2, seed=21), rank=0)


def uneven_layout() -> AttentionLayout:
    """Two groups, 3 ranks, GQA ratio 4, shuffled non-contiguous tokens: rank 0 has heads 0-2
    (K/V head 0 by repeats), rank 1 heads 3-7 (split groups: the general path), rank 2 all;
    blocks cut into several tiles."""
    layout = AttentionLayout(
        seq_len=24,
        num_heads=8,
        num_kv_heads=2,
        groups=((0, 1), (2,)),
        token_ranges=(
            ((0, 3), (10, 14)),
            ((5, 8), (18, 20)),
            ((3, 5), (8, 10), (14, 18), (20, 24)),
        ),
        head_ranges=((0, 3), (3, 8), (0, 8)),
    )
    layout.validate()
    return layout


def check_uneven_cases(rank: int, world_size: int) -> None:
    """Tier-2 worker: the uneven layout, causal and not, against the reference."""
    for seed, causal in enumerate((True, False)):
        check_case(Case(uneven_layout(), causal, batch=2, seed=30 + seed), rank)


@pytest.mark.multiproc
def test_multi_step_ring_with_split_groups_matches_reference():
    run_distributed(check_uneven_cases, 3)
