"""Causal (query, key) pair counts between the groups' segments, for every ring step (pure).

At ring step s group g attends its queries to the block of group g - s; how much work that is
is the number of causal pairs (key <= query) between the two segments. Counted exactly for all
G x G group pairs at once with numpy instead of G² calls of `layout.causal_pair_count`.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hexiseq.layout import AttentionLayout


def causal_pair_matrix(layout: AttentionLayout, group_of: np.ndarray) -> np.ndarray:
    """[query group, key group] exact causal (q, k) pair counts, k <= q, between all segments:
    `causal_pair_count(segment(g), segment(h))` for every g, h at once (int64).

    Pair counts add up over disjoint pieces, so it walks the token ranges in sequence order:
    a range sees every earlier range in full and itself as a triangle. Consecutive ranges of
    one group form one run (a + b tokens: T(a + b) = T(a) + T(b) + a·b, T(n) = n(n+1)/2), so
    a zigzag layout has about two runs per group. Needs disjoint ranges, as every valid
    layout has; raises ValueError otherwise.
    """
    starts, ends, owners = _ranges_in_order(layout, group_of)
    if np.any(starts[1:] < ends[:-1]):
        raise ValueError("layout token ranges overlap; simulate only validated layouts")
    lengths, positions = _runs_by_group(ends - starts, owners, len(layout.groups))
    pairs = np.zeros((len(lengths), len(lengths)), dtype=np.int64)
    for query in range(lengths.shape[1]):
        for key in range(lengths.shape[1]):
            later = positions[:, query, None] > positions[None, :, key]
            np.add(pairs, np.outer(lengths[:, query], lengths[:, key]), out=pairs, where=later)
    diagonal = np.arange(len(lengths))
    pairs[diagonal, diagonal] += (lengths * (lengths + 1) // 2).sum(axis=1)
    return pairs


def zigzag_pair_matrix(chunks: np.ndarray) -> np.ndarray:
    """`causal_pair_matrix` of a generalized zigzag layout from its [group] chunk lengths c
    (`AttentionLayout.zigzag_chunks`), in closed form: the front chunks lie in ring order
    before every back chunk, and the back chunks in reverse ring order, so two groups see
    each other's chunks in full twice (2·c_g·c_h pairs: g's back chunk sees h's front chunk,
    and one of them sees the other's chunk of the same half), and a group sees its own
    front chunk as a triangle, its back chunk as a triangle and its front chunk in full from
    its back chunk: c(c+1)/2 · 2 + c² = 2c² + c."""
    pairs = 2 * np.outer(chunks, chunks)
    diagonal = np.arange(len(chunks))
    pairs[diagonal, diagonal] += chunks
    return pairs


def _ranges_in_order(
    layout: AttentionLayout, group_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Starts, ends and owning groups of all non-empty token ranges, sorted by start."""
    flat = [
        (start, end, rank)
        for rank, ranges in enumerate(layout.token_ranges)
        for start, end in ranges
        if start < end
    ]
    table = np.array(sorted(flat), dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], group_of[table[:, 2]]


def _runs_by_group(
    lengths: np.ndarray, owners: np.ndarray, group_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """[group, slot] lengths and sequence positions of each group's runs (maximal stretches of
    consecutive ranges of one group), padded with empty runs."""
    first = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
    run_lengths, run_owners = np.add.reduceat(lengths, first), owners[first]
    order = np.argsort(run_owners, kind="stable")
    counts = np.bincount(run_owners, minlength=group_count)
    slots = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded_lengths = np.zeros((group_count, counts.max()), dtype=np.int64)
    padded_positions = np.zeros((group_count, counts.max()), dtype=np.int64)
    padded_lengths[run_owners[order], slots] = run_lengths[order]
    padded_positions[run_owners[order], slots] = order
    return padded_lengths, padded_positions


def steps_by_column(by_group: np.ndarray) -> np.ndarray:
    """[s, g] = by_group[g, (g - s) % G]: what group g sees at ring step s, for a [query group,
    key group] matrix, step-major (each ring step reads one row). A strided view of the
    column-doubled matrix, copied once."""
    count = by_group.shape[0]
    doubled = np.concatenate([by_group, by_group], axis=1)
    # doubled[g, G + g - s] = by_group[g, (g - s) % G]: from doubled[0, G], a step goes one
    # column back and a group one row and one column on.
    row_stride, column_stride = doubled.strides
    start = doubled[:, count:]
    view = as_strided(
        start, shape=(count, count), strides=(-column_stride, row_stride + column_stride)
    )
    return view.copy()


def steps_of_sequence(values: np.ndarray) -> np.ndarray:
    """[s, g] = values[(g - s) % G] (what group g holds at ring step s of a per-group
    [G] quantity) as a read-only strided view, without copying."""
    count = len(values)
    doubled = np.concatenate([values, values])
    (stride,) = doubled.strides
    view = as_strided(doubled[count:], shape=(count, count), strides=(-stride, stride))
    view.flags.writeable = False
    return view
