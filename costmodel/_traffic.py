"""Bytes each rank moves in the all-to-alls and ring steps of one attention layer (pure).

These counts are the simulator's communication volume; the runtime's measured volume is
compared against them (benchmarks/runtime.py), so they follow what the runtime sends:
K/V heads shared at a GQA boundary go to both owners, and each K/V head of a ring block is
sent by one holder in the previous group (the lowest rank that has it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.layout import AttentionLayout

BF16 = 2
FP32 = 4


@dataclass(frozen=True, slots=True)
class RingHop:
    """Who sends which K/V heads to a rank on the ring hop from the previous group."""

    senders: tuple[int, ...]
    kv_heads_in: int  # K/V heads this rank receives per block token


def kv_head_counts(layout: AttentionLayout) -> np.ndarray:
    """K/V heads each rank needs inside attention (GQA boundary heads counted by both owners)."""
    counts = [
        high - low for low, high in (layout.kv_head_range(r) for r in range(layout.world_size))
    ]
    return np.asarray(counts, dtype=np.int64)


def all_to_all_bytes(
    layout: AttentionLayout, members: tuple[int, ...], head_dim: int, *, q_heads: bool, kv: bool
) -> np.ndarray:
    """Matrix [i, j] of bytes member i sends member j in the sequence→head all-to-all.

    `q_heads` sends the query-head part (q, or the output/dO on the way back), `kv` the K/V part.
    The reverse direction (head→sequence) is the transpose of the same matrix.
    """
    tokens = np.array([layout.num_tokens(r) for r in members], dtype=np.float64)
    heads = np.array([layout.num_heads_of(r) for r in members], dtype=np.float64)
    kv_counts = kv_head_counts(layout)[list(members)].astype(np.float64)
    per_token = heads * q_heads + 2 * kv_counts * kv
    matrix = np.outer(tokens, per_token) * head_dim * BF16
    np.fill_diagonal(matrix, 0.0)
    return matrix


def ring_hops(layout: AttentionLayout) -> tuple[dict[int, RingHop], np.ndarray]:
    """For every rank, the ranks of the previous ring group that send it K/V heads; and for
    every rank, how many K/V heads per block token it sends on its outgoing hop."""
    hops: dict[int, RingHop] = {}
    heads_out = np.zeros(layout.world_size, dtype=np.int64)
    group_count = len(layout.groups)
    for position, members in enumerate(layout.groups):
        holder = _kv_holders(layout, layout.groups[(position - 1) % group_count])
        for rank in members:
            low, high = layout.kv_head_range(rank)
            senders = [holder[head] for head in range(low, high)]
            np.add.at(heads_out, senders, 1)
            hops[rank] = RingHop(tuple(sorted(set(senders))), high - low)
    return hops, heads_out


def _kv_holders(layout: AttentionLayout, members: tuple[int, ...]) -> dict[int, int]:
    holder: dict[int, int] = {}
    for rank in sorted(members):
        low, high = layout.kv_head_range(rank)
        for head in range(low, high):
            holder.setdefault(head, rank)
    return holder
