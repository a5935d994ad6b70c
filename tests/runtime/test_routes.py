"""Tier 0: the runtime's communication plan (pure), checked against the simulator's model."""

from __future__ import annotations

import random
from collections import Counter

from attention_cases import random_layout
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq import build_zigzag_layout
from hexiseq.costmodel._traffic import ring_senders
from hexiseq.runtime._routes import (
    build_rank_routes,
    fold_transfers,
    lowest_holders,
    ring_dkv_transfers,
    ring_kv_transfers,
)

SEEDS = settings(max_examples=60, deadline=None)


def layouts(seed):
    rng = random.Random(seed)
    return [random_layout(rng, world_size) for world_size in (1, 2, 3, 4, 5, 7)]


@SEEDS
@given(st.integers(0, 2**32 - 1))
def test_kv_hops_match_the_simulator_ring_senders(seed):
    for layout in layouts(seed):
        model = ring_senders(layout)
        hops = [t for g in range(len(layout.groups)) for t in ring_kv_transfers(layout, g)]
        for rank in range(layout.world_size):
            first, last = model.first_link[rank], model.first_link[rank + 1 : rank + 2]
            end = last[0] if len(last) else len(model.senders)
            assert {t.sender for t in hops if t.receiver == rank} == set(
                model.senders[first:end].tolist()
            )
            received = sum(t.num_heads for t in hops if t.receiver == rank)
            sent = sum(t.num_heads for t in hops if t.sender == rank)
            assert received == model.kv_heads_in[rank]
            assert sent == model.heads_out[rank]


@SEEDS
@given(st.integers(0, 2**32 - 1))
def test_each_receiver_gets_each_kv_head_it_needs_once(seed):
    for layout in layouts(seed):
        for g, members in enumerate(layout.groups):
            previous = layout.groups[g - 1]
            for rank in members:
                heads = [
                    h
                    for t in ring_kv_transfers(layout, g)
                    if t.receiver == rank
                    for h in range(*t.kv_heads)
                ]
                assert sorted(heads) == list(range(*layout.kv_head_range(rank)))
                for t in ring_kv_transfers(layout, g):
                    assert t.sender in previous


@SEEDS
@given(st.integers(0, 2**32 - 1))
def test_dkv_accumulator_of_each_head_travels_keeper_to_keeper_once(seed):
    for layout in layouts(seed):
        for g, members in enumerate(layout.groups):
            keepers = lowest_holders(layout, members)
            previous_keepers = lowest_holders(layout, layout.groups[g - 1])
            carried = Counter(h for t in ring_dkv_transfers(layout, g) for h in range(*t.kv_heads))
            assert carried == Counter(range(layout.num_kv_heads))
            for t in ring_dkv_transfers(layout, g):
                for h in range(*t.kv_heads):
                    assert (t.sender, t.receiver) == (previous_keepers[h], keepers[h])


@SEEDS
@given(st.integers(0, 2**32 - 1))
def test_every_shared_head_is_folded_into_its_keeper_once(seed):
    for layout in layouts(seed):
        for g, members in enumerate(layout.groups):
            keepers = lowest_holders(layout, members)
            folded = Counter(
                (t.sender, h) for t in fold_transfers(layout, g) for h in range(*t.kv_heads)
            )
            expected = Counter(
                (rank, h)
                for rank in members
                for h in range(*layout.kv_head_range(rank))
                if keepers[h] != rank
            )
            assert folded == expected
            for t in fold_transfers(layout, g):
                assert t.receiver == keepers[t.kv_heads[0]] and t.receiver in members


@SEEDS
@given(st.integers(0, 2**32 - 1))
def test_at_most_one_message_per_pair_and_kind(seed):
    for layout in layouts(seed):
        for g in range(len(layout.groups)):
            for transfers in (
                ring_kv_transfers(layout, g),
                ring_dkv_transfers(layout, g),
                fold_transfers(layout, g),
            ):
                pairs = [(t.sender, t.receiver) for t in transfers]
                assert len(pairs) == len(set(pairs))


def test_rank_routes_pick_this_ranks_side_of_every_hop():
    layout = random_layout(random.Random(3), 4)
    for rank in range(layout.world_size):
        routes = build_rank_routes(layout, rank)
        assert all(t.receiver == rank for t in routes.kv_in + routes.dkv_in + routes.fold_in)
        assert all(t.sender == rank for t in routes.kv_out + routes.dkv_out + routes.fold_out)
        assert routes.members == layout.groups[routes.group_index]
        assert routes.heads == layout.head_ranges[rank]


def test_one_group_has_no_ring_hops_and_no_folds():
    # Three members sharing K/V head 0 at GQA boundaries: with one group, the step-0
    # gradients stay with their holders and the all-to-all back sums them.
    layout = build_zigzag_layout(12, 4, 1, [[0, 1, 2]], [12], [[1, 1, 1]], [[1, 2, 1]])
    assert fold_transfers(layout, 0)
    for rank in range(3):
        routes = build_rank_routes(layout, rank)
        assert routes.num_groups == 1
        assert not (routes.kv_in or routes.kv_out or routes.dkv_in or routes.dkv_out)
        assert not (routes.fold_in or routes.fold_out)
