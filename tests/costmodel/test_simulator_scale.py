"""The vectorized simulator's building blocks against their one-at-a-time definitions, and a
simulation at the largest size the plan search uses (1024 ranks, one per HP group)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq import (
    AttentionLayout,
    Cluster,
    ModelSpec,
    TrainSpec,
    build_uniform_layout,
    build_zigzag_layout,
)
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.costmodel._pairs import (
    causal_pair_matrix,
    steps_by_column,
    steps_of_sequence,
    zigzag_pair_matrix,
)
from hexiseq.costmodel._state import _layout_arrays
from hexiseq.costmodel.datasheet import declared_link_parameters
from hexiseq.layout import causal_pair_count

GPU_CYCLE = ("H100-SXM", "A100-80G", "L40S", "RTX-4090")


def mixed_cluster(gpus: int) -> Cluster:
    nodes = [
        {"name": f"node{i}", "gpu": GPU_CYCLE[i % len(GPU_CYCLE)], "count": 8}
        for i in range(gpus // 8)
    ]
    return Cluster.from_dict(
        {"name": f"mixed-{gpus}", "nodes": nodes, "network": {"inter_node_GBps": 50}}
    )


def pair_matrix_by_definition(layout):
    groups = range(len(layout.groups))
    return [
        [causal_pair_count(layout.segment(g), layout.segment(h)) for h in groups] for g in groups
    ]


@st.composite
def zigzag_layouts(draw):
    """Uneven zigzag layouts: 1-5 groups of 1-3 ranks in shuffled rank order."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    ranks = draw(st.permutations(range(sum(sizes))))
    groups, first = [], 0
    for size in sizes:
        groups.append(list(ranks[first : first + size]))
        first += size
    quantum = draw(st.sampled_from([1, 4]))
    lengths = [2 * quantum * draw(st.integers(size, 3 * size)) for size in sizes]
    weights = [[draw(st.floats(0.1, 3.0)) for _ in range(size)] for size in sizes]
    heads = [[1] * (size - 1) + [4 - (size - 1)] for size in sizes]
    return build_zigzag_layout(
        sum(lengths), 4, 2, groups, lengths, weights, heads, chunk_quantum=quantum
    )


@settings(max_examples=60, deadline=None)
@given(zigzag_layouts())
def test_causal_pair_matrix_counts_every_segment_pair_exactly(layout):
    group_of = _layout_arrays(layout)["group_of"]
    matrix = causal_pair_matrix(layout, group_of)
    assert matrix.tolist() == pair_matrix_by_definition(layout)


@pytest.mark.parametrize("zigzag", [True, False])
def test_causal_pair_matrix_on_uniform_layouts(zigzag):
    layout = build_uniform_layout(96, 4, 2, [2, 1, 3], zigzag=zigzag)
    matrix = causal_pair_matrix(layout, _layout_arrays(layout)["group_of"])
    assert matrix.tolist() == pair_matrix_by_definition(layout)
    # Every (q, k) pair with k <= q is counted once: the matrix sums to S(S+1)/2.
    assert matrix.sum() == 96 * 97 // 2


@settings(max_examples=60, deadline=None)
@given(zigzag_layouts())
def test_a_zigzag_layouts_pairs_in_closed_form_are_the_counted_ones(layout):
    """The simulator prices a zigzag layout's ring from its chunk lengths alone
    (`zigzag_pair_matrix`); a layout read back from its dict finds them again by checking its
    ranges (`AttentionLayout.zigzag_chunks`), and they are the builder's."""
    chunks = layout.zigzag_chunks
    assert chunks == tuple(length // 2 for length in layout.segment_lengths)
    assert AttentionLayout.from_dict(layout.to_dict()).zigzag_chunks == chunks
    closed = zigzag_pair_matrix(np.asarray(chunks, dtype=np.int64))
    assert closed.tolist() == pair_matrix_by_definition(layout)


def test_only_zigzag_layouts_have_zigzag_chunks():
    assert build_uniform_layout(96, 4, 2, [2, 1, 3]).zigzag_chunks == (16, 16, 16)
    assert build_uniform_layout(96, 4, 2, [2, 1, 3], zigzag=False).zigzag_chunks is None
    # the front chunks in another order than the ring's: not a zigzag of this ring
    swapped = AttentionLayout(
        seq_len=8,
        num_heads=1,
        num_kv_heads=1,
        groups=((0,), (1,)),
        token_ranges=(((2, 4), (4, 6)), ((0, 2), (6, 8))),
        head_ranges=((0, 1), (0, 1)),
    )
    assert swapped.zigzag_chunks is None


def test_causal_pair_matrix_rejects_overlapping_ranges():
    # Not a valid layout (never validated): ranks 0 and 1 both own tokens [4, 6).
    layout = AttentionLayout(
        seq_len=8,
        num_heads=1,
        num_kv_heads=1,
        groups=((0,), (1,)),
        token_ranges=(((0, 6),), ((4, 8),)),
        head_ranges=((0, 1), (0, 1)),
    )
    with pytest.raises(ValueError, match="token ranges overlap"):
        causal_pair_matrix(layout, np.array([0, 1]))


def test_step_major_tables_read_the_block_each_step_brings():
    for count in (1, 2, 5):
        by_group = np.arange(count * count).reshape(count, count) * 3 + 1
        per_group = np.arange(count) * 10 + 1
        rolled, held = steps_by_column(by_group), steps_of_sequence(per_group)
        for group in range(count):
            for step in range(count):
                assert rolled[step, group] == by_group[group, (group - step) % count]
                assert held[step, group] == per_group[(group - step) % count]


def test_link_matrices_match_the_cluster_links():
    cluster = Cluster.from_dict(
        {
            "name": "links",
            "nodes": [
                {"name": "a", "gpu": "H100-SXM", "count": 1},
                {"name": "b", "gpu": "L40S", "count": 1, "intra_node_GBps": 20},
                {"name": "c", "gpu": "A100-80G", "count": 1},
            ],
            "network": {
                "inter_node_GBps": 50,
                "inter_node_latency_us": 7,
                "overrides": [{"a": "c", "b": "a", "GBps": 12.5}],
            },
        }
    )
    bandwidth, latency = declared_link_parameters(cluster)
    names = [node.name for node in cluster.nodes]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            assert bandwidth[i, j] == cluster.link_GBps(a, b)
            assert latency[i, j] == cluster.link_latency_s(a, b)


def test_a_thousand_groups_of_one_rank():
    # The plan search's largest case: 1024 GPUs of four types, one rank per HP group, so the
    # ring has 1024 steps. No wall-time assertion (tests never time); benchmarks/ does.
    cluster = mixed_cluster(1024)
    model = ModelSpec.preset("llama3-8b")
    seq_len = 1 << 20
    layout = build_uniform_layout(seq_len, model.heads, model.kv_heads, [1] * 1024)
    prediction = simulate_step(
        cluster, model, TrainSpec(seq_len=seq_len), layout, DatasheetCostModel()
    )
    assert math.isfinite(prediction.step_time_s) and prediction.step_time_s > 0
    assert len(prediction.rank_times) == len(prediction.memory) == 1024
    for rank in prediction.rank_times:
        parts = rank.to_dict().values()
        assert all(part >= -1e-9 for part in parts)
        assert sum(parts) == pytest.approx(prediction.step_time_s, rel=1e-9)
    assert prediction.rank_times[0].attention_s > 0
