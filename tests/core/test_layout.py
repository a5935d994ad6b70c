"""Tier 0 tests for the CP–HP attention layout (docs/design.md §3): pure logic, no process
group."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq.layout import (
    AttentionLayout,
    apportion,
    build_uniform_layout,
    build_zigzag_layout,
    causal_pair_count,
    full_pair_count,
    zigzag_segment_lengths,
)

FAST = settings(max_examples=100, deadline=None)


def assert_partitions(ranges, end):
    """The half-open ranges cover [0, end) exactly once."""
    cursor = 0
    for start, stop in sorted(ranges):
        assert start == cursor, f"gap or overlap at {cursor}: {sorted(ranges)}"
        cursor = stop
    assert cursor == end


def single_rank_groups_layout(half_lengths):
    """Zigzag layout with one rank per group and segment lengths 2 * half_lengths."""
    count = len(half_lengths)
    return build_zigzag_layout(
        seq_len=2 * sum(half_lengths),
        num_heads=4,
        num_kv_heads=2,
        groups=[[g] for g in range(count)],
        segment_lengths=[2 * h for h in half_lengths],
        token_weights=[[1.0]] * count,
        head_counts=[[4]] * count,
    )


# --- generalized zigzag: causal balance ----------------------------------------------------------


@FAST
@given(st.lists(st.integers(1, 500), min_size=1, max_size=6))
def test_zigzag_causal_work_is_proportional_to_segment_length(half_lengths):
    layout = single_rank_groups_layout(half_lengths)
    seq_len = layout.seq_len
    for g, half in enumerate(half_lengths):
        segment_length = 2 * half
        pairs = causal_pair_count(layout.segment(g), [(0, seq_len)])
        assert pairs == segment_length * (seq_len + 1) // 2
        assert layout.segment_length(g) == segment_length
    total = sum(
        causal_pair_count(layout.segment(g), [(0, seq_len)]) for g in range(len(half_lengths))
    )
    assert total == seq_len * (seq_len + 1) // 2


@st.composite
def zigzag_inputs(draw):
    ratio = draw(st.sampled_from([1, 2, 4]))
    num_kv_heads = draw(st.sampled_from([1, 2, 3, 7]))
    num_heads = ratio * num_kv_heads
    quantum = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, min(4, num_heads)), min_size=1, max_size=4))
    ranks = draw(st.permutations(range(sum(sizes))))
    groups, start = [], 0
    for size in sizes:
        groups.append(list(ranks[start : start + size]))
        start += size
    weights = [draw(st.lists(st.floats(1.0, 4.0), min_size=m, max_size=m)) for m in sizes]
    # Chunks of at least 4 * quantum per member keep every quota >= quantum (weights within 4x),
    # so the minimum of one quantum never binds and shares stay within a quantum of proportional.
    chunks = [quantum * m * 4 * draw(st.integers(1, 6)) for m in sizes]
    head_counts = [draw(head_composition(num_heads, m)) for m in sizes]
    return {
        "seq_len": 2 * sum(chunks),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "groups": groups,
        "segment_lengths": [2 * c for c in chunks],
        "token_weights": weights,
        "head_counts": head_counts,
        "chunk_quantum": quantum,
    }


def head_composition(num_heads, parts):
    """Random split of num_heads into `parts` positive counts (uneven in general)."""
    if parts == 1:
        return st.just([num_heads])
    cut_points = st.lists(
        st.integers(1, num_heads - 1), min_size=parts - 1, max_size=parts - 1, unique=True
    )
    return cut_points.map(lambda cuts: counts_between([0, *sorted(cuts), num_heads]))


def counts_between(bounds):
    return [end - start for start, end in zip(bounds, bounds[1:], strict=False)]


@FAST
@given(zigzag_inputs())
def test_zigzag_layout_partitions_tokens_and_heads(inputs):
    layout = build_zigzag_layout(**inputs)
    layout.validate()
    assert layout.world_size == sum(len(m) for m in inputs["groups"])
    assert_partitions([r for ranges in layout.token_ranges for r in ranges], inputs["seq_len"])
    for g, members in enumerate(inputs["groups"]):
        assert_partitions([layout.head_ranges[rank] for rank in members], inputs["num_heads"])
        assert [layout.num_heads_of(rank) for rank in members] == inputs["head_counts"][g]
        assert all(layout.group_of(rank) == g for rank in members)
        assert layout.segment_length(g) == inputs["segment_lengths"][g]


@FAST
@given(zigzag_inputs())
def test_zigzag_token_shares_are_within_one_quantum_of_proportional(inputs):
    layout = build_zigzag_layout(**inputs)
    quantum = inputs["chunk_quantum"]
    for g, members in enumerate(inputs["groups"]):
        chunk = inputs["segment_lengths"][g] // 2
        weights = [Fraction(w) for w in inputs["token_weights"][g]]
        for rank, weight in zip(members, weights, strict=True):
            front, back = layout.token_ranges[rank]
            assert front[1] - front[0] == back[1] - back[0]
            piece = front[1] - front[0]
            assert piece % quantum == 0
            assert abs(piece - chunk * weight / sum(weights)) < quantum


# --- pair counts ---------------------------------------------------------------------------------

small_ranges = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 30)).map(sorted).map(tuple), max_size=4
)


@FAST
@given(small_ranges, small_ranges)
def test_causal_pair_count_matches_brute_force(query_ranges, key_ranges):
    expected = sum(
        1
        for qa, qb in query_ranges
        for ka, kb in key_ranges
        for q in range(qa, qb)
        for k in range(ka, kb)
        if k <= q
    )
    assert causal_pair_count(query_ranges, key_ranges) == expected


@FAST
@given(small_ranges, small_ranges)
def test_full_pair_count_matches_brute_force(query_ranges, key_ranges):
    expected = sum((qb - qa) * (kb - ka) for qa, qb in query_ranges for ka, kb in key_ranges)
    assert full_pair_count(query_ranges, key_ranges) == expected


def test_causal_pair_count_on_a_million_tokens_is_closed_form():
    n = 1 << 20
    assert causal_pair_count([(0, n)], [(0, n)]) == n * (n + 1) // 2
    assert causal_pair_count([(0, n // 2)], [(n // 2, n)]) == 0


# --- apportion -----------------------------------------------------------------------------------


def test_apportion_splits_heads_as_evenly_as_possible():
    assert apportion(52, [1] * 8) == [7, 7, 7, 7, 6, 6, 6, 6]


def test_apportion_breaks_ties_by_index_and_respects_quantum():
    assert apportion(5, [1, 1]) == [3, 2]
    assert apportion(12, [1, 1, 1, 1], quantum=2) == [4, 4, 2, 2]


def test_apportion_raises_small_entries_to_the_minimum_and_shares_the_rest():
    assert apportion(101, [1, 100], minimum=1) == [1, 100]
    assert apportion(10, [0, 1, 1], minimum=2) == [2, 4, 4]


@FAST
@given(
    st.integers(0, 200),
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
    st.integers(1, 4),
)
def test_apportion_sums_to_total_in_multiples_of_quantum(units, weights, quantum):
    minimum = quantum if units >= len(weights) else 0
    shares = apportion(units * quantum, weights, quantum=quantum, minimum=minimum)
    assert sum(shares) == units * quantum
    assert all(s % quantum == 0 and s >= minimum for s in shares)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((10, [1, -1]), {}, r"weight 1 is -1; need finite and >= 0"),
        ((10, [0, 0]), {}, r"weights sum to zero"),
        ((10, [1, 1]), {"quantum": 4}, r"total=10 is not a non-negative multiple of 4"),
        ((10, [1, 1, 1]), {"minimum": 4}, r"cannot give each of 3 entries minimum=4"),
        ((10, [1]), {"quantum": 2, "minimum": 3}, r"minimum=3 is not a non-negative multiple"),
        ((10, []), {}, r"weights is empty"),
    ],
)
def test_apportion_rejects_bad_input(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apportion(*args, **kwargs)


def test_zigzag_segment_lengths_are_multiples_of_two_chunks():
    assert zigzag_segment_lengths(16, [1, 3]) == [4, 12]
    assert zigzag_segment_lengths(24, [1, 1, 1], chunk_quantum=2) == [8, 8, 8]
    with pytest.raises(ValueError, match=r"total=15 is not a non-negative multiple of 2"):
        zigzag_segment_lengths(15, [1, 1])


# --- uniform layouts -----------------------------------------------------------------------------


def test_uniform_zigzag_with_four_single_rank_groups_is_standard_zigzag():
    layout = build_uniform_layout(16, 8, 2, [1, 1, 1, 1])
    assert layout.groups == ((0,), (1,), (2,), (3,))
    assert layout.token_ranges == (
        ((0, 2), (14, 16)),
        ((2, 4), (12, 14)),
        ((4, 6), (10, 12)),
        ((6, 8), (8, 10)),
    )
    assert layout.head_ranges == ((0, 8),) * 4
    assert [layout.segment_length(g) for g in range(4)] == [4, 4, 4, 4]
    assert layout.segment(3) == ((6, 10),)


def test_uniform_zigzag_splits_each_chunk_inside_a_group():
    layout = build_uniform_layout(16, 8, 2, [2, 2])
    assert layout.token_ranges == (
        ((0, 2), (12, 14)),
        ((2, 4), (14, 16)),
        ((4, 6), (8, 10)),
        ((6, 8), (10, 12)),
    )
    assert layout.head_ranges == ((0, 4), (4, 8), (0, 4), (4, 8))
    assert layout.segment(0) == ((0, 4), (12, 16))


def test_uniform_contiguous_layout_cuts_in_ring_order():
    layout = build_uniform_layout(12, 4, 4, [2, 2], zigzag=False)
    assert layout.token_ranges == (((0, 3),), ((3, 6),), ((6, 9),), ((9, 12),))
    assert layout.segment(1) == ((6, 12),)


def test_uniform_layout_splits_uneven_heads():
    layout = build_uniform_layout(32, 52, 4, [8])
    assert [layout.num_heads_of(rank) for rank in range(8)] == [7, 7, 7, 7, 6, 6, 6, 6]


# --- builder errors ------------------------------------------------------------------------------


def zigzag_kwargs(**overrides):
    kwargs = {
        "seq_len": 16,
        "num_heads": 8,
        "num_kv_heads": 2,
        "groups": [[1, 0], [2]],
        "segment_lengths": [8, 8],
        "token_weights": [[1, 1], [1]],
        "head_counts": [[4, 4], [8]],
    }
    return {**kwargs, **overrides}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"segment_lengths": [8, 6], "chunk_quantum": 2},
            r"group 1 segment length 6 is not allowed; need a positive multiple of "
            r"2\*chunk_quantum=4",
        ),
        ({"segment_lengths": [8, 6]}, r"segment lengths sum to 14; need seq_len=16"),
        ({"head_counts": [[4, 3], [8]]}, r"group 0 head counts \[4, 3\] are not allowed"),
        ({"token_weights": [[1], [1]]}, r"group 0 has 2 members but 1 token weights"),
        ({"groups": [[1, 0], [3]]}, r"group 1 has unknown rank 3; ranks are 0..2"),
        ({"segment_lengths": [2, 14]}, r"group 0 chunks of 1 tokens cannot give each of its 2"),
    ],
)
def test_build_zigzag_layout_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_zigzag_layout(**zigzag_kwargs(**overrides))


def test_build_zigzag_layout_indexes_by_global_rank():
    layout = build_zigzag_layout(**zigzag_kwargs())
    assert layout.token_ranges[1] == ((0, 2), (12, 14))
    assert layout.token_ranges[0] == ((2, 4), (14, 16))
    assert layout.head_ranges[1] == (0, 4)
    assert layout.group_of(0) == 0 and layout.group_of(2) == 1


# --- validate ------------------------------------------------------------------------------------


def base_layout():
    """Four ranks in two HP groups, 16 tokens, 8 heads, 2 KV heads."""
    return build_uniform_layout(16, 8, 2, [2, 2])


def with_token_ranges(**by_rank):
    layout = base_layout()
    ranges = list(layout.token_ranges)
    for name, value in by_rank.items():
        ranges[int(name[1:])] = value
    return dataclasses.replace(layout, token_ranges=tuple(ranges))


def with_head_ranges(**by_rank):
    layout = base_layout()
    ranges = list(layout.head_ranges)
    for name, value in by_rank.items():
        ranges[int(name[1:])] = value
    return dataclasses.replace(layout, head_ranges=tuple(ranges))


BROKEN_LAYOUTS = {
    "seq_len not positive": (
        lambda: dataclasses.replace(base_layout(), seq_len=0),
        r"seq_len=0 is not allowed; need a positive integer",
    ),
    "num_heads not positive": (
        lambda: dataclasses.replace(base_layout(), num_heads=-8),
        r"num_heads=-8 is not allowed",
    ),
    "kv heads do not divide heads": (
        lambda: dataclasses.replace(base_layout(), num_kv_heads=3),
        r"num_kv_heads=3 does not divide num_heads=8",
    ),
    "head ranges count differs": (
        lambda: dataclasses.replace(base_layout(), head_ranges=((0, 8),) * 3),
        r"3 head ranges for 4 token-range entries",
    ),
    "no groups": (
        lambda: dataclasses.replace(base_layout(), groups=()),
        r"groups is empty",
    ),
    "empty group": (
        lambda: dataclasses.replace(base_layout(), groups=((0, 1, 2, 3), ())),
        r"group 1 is empty",
    ),
    "rank in two groups": (
        lambda: dataclasses.replace(base_layout(), groups=((0, 1, 3), (2, 3))),
        r"layout: rank 3 appears in groups 0 and 1",
    ),
    "unknown rank": (
        lambda: dataclasses.replace(base_layout(), groups=((0, 1), (2, 3, 7))),
        r"group 1 has unknown rank 7; ranks are 0..3",
    ),
    "rank in no group": (
        lambda: dataclasses.replace(base_layout(), groups=((0, 1), (2,))),
        r"rank 3 is in no group",
    ),
    "rank owns no tokens": (
        lambda: with_token_ranges(r2=()),
        r"rank 2 owns no tokens",
    ),
    "empty token range": (
        lambda: with_token_ranges(r0=((0, 2), (5, 5))),
        r"rank 0 token range \(5, 5\) is not allowed; need 0 <= start < end <= seq_len=16",
    ),
    "token range past the end": (
        lambda: with_token_ranges(r1=((2, 4), (14, 17))),
        r"rank 1 token range \(14, 17\) is not allowed",
    ),
    "token ranges unsorted": (
        lambda: with_token_ranges(r0=((12, 14), (0, 2))),
        r"rank 0 token ranges \[\(12, 14\), \(0, 2\)\] are not sorted",
    ),
    "token gap": (
        lambda: with_token_ranges(r1=((3, 4), (14, 16))),
        r"tokens \[2, 3\) are owned by no rank; token ranges must partition \[0, 16\) exactly",
    ),
    "token gap at the end": (
        lambda: with_token_ranges(r1=((2, 4), (14, 15))),
        r"tokens \[15, 16\) are owned by no rank",
    ),
    "token overlap": (
        lambda: with_token_ranges(r0=((0, 3), (12, 14))),
        r"tokens \[2, 3\) are owned by both rank 0 and rank 1",
    ),
    "head range out of bounds": (
        lambda: with_head_ranges(r1=(4, 9)),
        r"rank 1 head range \(4, 9\) is not allowed; need 0 <= start < end <= num_heads=8",
    ),
    "head gap in a group": (
        lambda: with_head_ranges(r3=(5, 8)),
        r"group 1 heads \[4, 5\) are owned by no rank; within a group head ranges must "
        r"partition \[0, 8\)",
    ),
    "head overlap in a group": (
        lambda: with_head_ranges(r0=(0, 5)),
        r"group 0 heads \[4, 5\) are owned by both rank 0 and rank 1",
    ),
}


@pytest.mark.parametrize("rule", list(BROKEN_LAYOUTS))
def test_validate_rejects_each_broken_rule(rule):
    make_layout, message = BROKEN_LAYOUTS[rule]
    layout = make_layout()
    with pytest.raises(ValueError, match=message):
        layout.validate()


def test_validate_accepts_the_base_layout():
    base_layout().validate()


# --- accessors and serialization -----------------------------------------------------------------


def test_kv_head_range_shares_boundary_kv_heads():
    layout = build_zigzag_layout(
        seq_len=12,
        num_heads=8,
        num_kv_heads=2,
        groups=[[0, 1, 2]],
        segment_lengths=[12],
        token_weights=[[1, 1, 1]],
        head_counts=[[3, 3, 2]],
    )
    assert layout.gqa_ratio == 4
    assert layout.head_ranges == ((0, 3), (3, 6), (6, 8))
    assert [layout.kv_head_range(rank) for rank in range(3)] == [(0, 1), (0, 2), (1, 2)]


def test_num_tokens_counts_both_chunks():
    layout = build_uniform_layout(16, 8, 2, [2, 2])
    assert [layout.num_tokens(rank) for rank in range(4)] == [4, 4, 4, 4]
    assert layout.world_size == 4


def test_to_dict_from_dict_round_trip():
    layout = build_zigzag_layout(**zigzag_kwargs())
    data = json.loads(json.dumps(layout.to_dict()))
    assert AttentionLayout.from_dict(data) == layout


def test_from_dict_rejects_missing_fields_and_broken_layouts():
    data = build_uniform_layout(16, 8, 2, [2, 2]).to_dict()
    with pytest.raises(ValueError, match=r"missing field\(s\) head_ranges"):
        AttentionLayout.from_dict({k: v for k, v in data.items() if k != "head_ranges"})
    with pytest.raises(ValueError, match=r"rank 3 appears in groups 0 and 1"):
        AttentionLayout.from_dict({**data, "groups": [[0, 1, 3], [2, 3]]})
