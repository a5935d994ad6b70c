"""Tier 0: a block's causal mask as mask-free tiles (pure)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq import build_zigzag_layout
from hexiseq.runtime._tiles import block_tiles, sorted_ranges


def positions(ranges):
    return np.array([p for start, end in ranges for p in range(start, end)], dtype=np.int64)


def coverage(tiles, rows, keys):
    """How many tiles cover each (row, key) pair."""
    count = np.zeros((rows, keys), dtype=np.int64)
    for tile in tiles:
        block = np.ones((tile.row_end - tile.row_start, tile.key_end - tile.key_start), int)
        if tile.causal:
            assert block.shape[0] == block.shape[1], f"causal tile {tile} is not square"
            block = np.tril(block)
        count[tile.rows, tile.keys] += block
    return count


def split_between(rng, seq_len, parts):
    """Cut [0, seq_len) into pieces and deal them at random to `parts` owners (each >= 1)."""
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(parts, seq_len - 1)))
    bounds = [0, *cuts, seq_len]
    pieces = list(zip(bounds, bounds[1:]))
    rng.shuffle(pieces)
    owners = list(range(parts)) + [rng.randrange(parts) for _ in pieces[parts:]]
    dealt = [[] for _ in range(parts)]
    for owner, piece in zip(owners, pieces):
        dealt[owner].append(piece)
    return [sorted_ranges(ranges) for ranges in dealt]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 60), st.booleans())
def test_tiles_cover_every_visible_pair_exactly_once(seed, seq_len, same_block):
    rng = random.Random(seed)
    query_ranges, key_ranges = split_between(rng, seq_len, 2)
    if same_block:
        key_ranges = query_ranges
    tiles = block_tiles(query_ranges, key_ranges, causal=True)
    query_positions, key_positions = positions(query_ranges), positions(key_ranges)
    visible = key_positions[None, :] <= query_positions[:, None]
    assert np.array_equal(coverage(tiles, len(query_positions), len(key_positions)), visible)


def test_full_attention_is_one_tile():
    tiles = block_tiles([(0, 3), (7, 9)], [(3, 7)], causal=False)
    assert [(t.rows, t.keys, t.causal) for t in tiles] == [(slice(0, 5), slice(0, 4), False)]


def test_invisible_block_has_no_tiles():
    assert block_tiles([(0, 4)], [(4, 9)], causal=True) == ()


def test_own_block_is_one_causal_square_even_when_not_contiguous():
    tiles = block_tiles([(0, 3), (8, 12)], [(0, 3), (8, 12)], causal=True)
    assert [(t.rows, t.keys, t.causal) for t in tiles] == [(slice(0, 7), slice(0, 7), True)]


def test_zigzag_blocks_are_single_tiles():
    groups = [[0], [1], [2], [3]]
    layout = build_zigzag_layout(40, 2, 2, groups, [8, 12, 6, 14], [[1]] * 4, [[2]] * 4)
    for g in range(4):
        for b in range(4):
            tiles = block_tiles(layout.segment(g), layout.segment(b), causal=True)
            assert len(tiles) == 1, (g, b, tiles)
