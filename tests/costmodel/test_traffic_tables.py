"""The simulator's ring traffic tables, built with numpy over all ranks, against a rank-by-rank
reference written straight from their definitions (`costmodel/_traffic.py`)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hexiseq.costmodel._traffic import dkv_ring_senders, fold_links, ring_senders, ring_traffic
from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout, kv_keepers


def reference_senders(layout: AttentionLayout):
    """(senders of each rank, K/V heads in, heads out) of the forward hop, rank by rank."""
    world, count = layout.world_size, len(layout.groups)
    heads_out, heads_in = [0] * world, [0] * world
    senders_of: list[list[int]] = [[] for _ in range(world)]
    for position, members in enumerate(layout.groups):
        holder = kv_keepers(layout, layout.groups[(position - 1) % count])
        for rank in members:
            low, high = layout.kv_head_range(rank)
            for head in range(low, high):
                heads_out[holder[head]] += 1
            senders_of[rank] = sorted({holder[head] for head in range(low, high)})
            heads_in[rank] = high - low
    return senders_of, heads_in, heads_out


def reference_dkv_senders(layout: AttentionLayout):
    """The same for the dK/dV hop: keeper to keeper; a rank keeping nothing links itself."""
    world, count = layout.world_size, len(layout.groups)
    heads_out, heads_in = [0] * world, [0] * world
    senders_of: list[set[int]] = [set() for _ in range(world)]
    for position, members in enumerate(layout.groups):
        previous = kv_keepers(layout, layout.groups[(position - 1) % count])
        for head, keeper in kv_keepers(layout, members).items():
            senders_of[keeper].add(previous[head])
            heads_in[keeper] += 1
            heads_out[previous[head]] += 1
    rows = [sorted(senders) or [rank] for rank, senders in enumerate(senders_of)]
    return rows, heads_in, heads_out


def reference_folds(layout: AttentionLayout) -> dict[tuple[int, int], int]:
    pairs: dict[tuple[int, int], int] = {}
    for members in layout.groups:
        keeper_of = kv_keepers(layout, members)
        for rank in members:
            low, high = layout.kv_head_range(rank)
            for head in range(low, high):
                if keeper_of[head] != rank:
                    pairs[(rank, keeper_of[head])] = pairs.get((rank, keeper_of[head]), 0) + 1
    return pairs


def random_layout(rng: random.Random) -> AttentionLayout:
    """Groups of random sizes over shuffled ranks, uneven head splits, a GQA ratio of 1-8."""
    kv_heads = rng.choice([1, 2, 4, 8])
    heads = kv_heads * rng.choice([1, 2, 3, 4, 8])
    world = rng.randint(1, 24)
    ranks = list(range(world))
    rng.shuffle(ranks)
    groups, start = [], 0
    while start < world:
        size = rng.randint(1, min(heads, world - start))
        groups.append(ranks[start : start + size])
        start += size
    head_counts = [_uneven_split(rng, heads, len(g)) for g in groups]
    seq_len = 4 * world * 8
    segments = apportion(seq_len, [len(g) for g in groups], quantum=2, minimum=2 * len(groups[0]))
    weights = [[1.0] * len(g) for g in groups]
    return build_zigzag_layout(seq_len, heads, kv_heads, groups, segments, weights, head_counts)


def _uneven_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def assert_links(found, senders_of, heads_in, heads_out) -> None:
    flat = [s for row in senders_of for s in row]
    assert found.senders.tolist() == flat
    assert found.receivers.tolist() == [r for r, row in enumerate(senders_of) for _ in row]
    counts = [len(row) for row in senders_of]
    assert found.first_link.tolist() == list(np.cumsum(counts) - counts)
    assert found.kv_heads_in.tolist() == heads_in and found.heads_out.tolist() == heads_out
    width = max(counts)
    padded = [row + row[:1] * (width - len(row)) for row in senders_of]
    assert [c.tolist() for c in found.sender_columns] == [list(c) for c in zip(*padded)]
    for table in (found.senders, found.receivers, found.first_link, *found.sender_columns):
        assert table.dtype == np.int64


def one_by_one(layout: AttentionLayout):
    return ring_senders(layout), dkv_ring_senders(layout), fold_links(layout)


@pytest.mark.parametrize("tables", [one_by_one, ring_traffic])
@pytest.mark.parametrize("seed", range(60))
def test_traffic_tables_match_the_rank_by_rank_reference(seed, tables):
    layout = random_layout(random.Random(seed))
    senders, dkv_senders, folds = tables(layout)
    assert_links(senders, *reference_senders(layout))
    assert_links(dkv_senders, *reference_dkv_senders(layout))
    expected = reference_folds(layout)
    found = zip(folds.folders.tolist(), folds.keepers.tolist(), folds.heads.tolist())
    assert [((a, b), n) for a, b, n in found] == sorted(expected.items())
