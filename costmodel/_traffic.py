"""Bytes each rank moves in the all-to-alls and ring steps of one attention layer (pure).

These counts are the simulator's communication volume; they follow what the runtime sends
(runtime/__init__.py and tests/runtime/traffic_cases.py):
- all-to-alls in the compute dtype; K/V heads shared at a GQA boundary go to both owners;
- each K/V head of a ring block is sent by its *keeper* in the previous group (the lowest rank
  holding it) to every rank of the next group that needs it, in the compute dtype;
- in the backward pass each head's FP32 dK/dV accumulator goes keeper to keeper; a non-keeper
  holder of a boundary head first *folds* its partial into the keeper inside the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.layout import AttentionLayout, kv_keepers

BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class RingSenders:
    """Who sends K/V heads to each rank on the ring hop from the previous group, as a list of
    links (sender → receiver) sorted by receiver: rank r's links are
    `first_link[r] : first_link[r + 1]`; every rank has at least one."""

    senders: np.ndarray  # [link] sending rank, in the previous group (int64)
    receivers: np.ndarray  # [link] receiving rank (int64)
    first_link: np.ndarray  # [rank] index of the rank's first link
    kv_heads_in: np.ndarray  # [rank] K/V heads it receives per block token
    heads_out: np.ndarray  # [rank] K/V heads per block token it sends on its outgoing hop
    # [slot][rank] the rank's senders again, one array per slot, padded with its first sender
    # (a repeated sender changes no maximum): a few gathers beat a reduceat per ring step.
    sender_columns: tuple[np.ndarray, ...]

    @property
    def one_per_rank(self) -> bool:
        """Whether every rank has exactly one sender (link i is rank i's)."""
        return len(self.senders) == len(self.first_link)

    def latest(self, times: np.ndarray) -> np.ndarray:
        """[rank] the latest of `times` ([rank]) over each rank's senders."""
        latest = times[self.sender_columns[0]]
        for column in self.sender_columns[1:]:
            np.maximum(latest, times[column], out=latest)
        return latest


def kv_head_counts(layout: AttentionLayout) -> np.ndarray:
    """K/V heads each rank needs inside attention (GQA boundary heads counted by both owners)."""
    counts = [
        high - low for low, high in (layout.kv_head_range(r) for r in range(layout.world_size))
    ]
    return np.asarray(counts, dtype=np.int64)


def all_to_all_bytes(
    layout: AttentionLayout,
    members: tuple[int, ...],
    head_dim: int,
    *,
    q_heads: bool,
    kv: bool,
    element_bytes: int = BF16,
) -> np.ndarray:
    """Matrix [i, j] of bytes member i sends member j in the sequence→head all-to-all.

    `q_heads` sends the query-head part (q, or the output/dO on the way back), `kv` the K/V part.
    The reverse direction (head→sequence) is the transpose of the same matrix.
    """
    index = list(members)
    tokens = np.array([layout.num_tokens(r) for r in members], dtype=np.float64)
    heads = np.array([layout.num_heads_of(r) for r in members], dtype=np.float64)
    kv_counts = kv_head_counts(layout)[index].astype(np.float64)
    matrix = batched_all_to_all_bytes(
        tokens[None, :],
        heads[None, :],
        kv_counts[None, :],
        head_dim,
        q_heads=q_heads,
        kv=kv,
        element_bytes=element_bytes,
    )
    return matrix[0]


def batched_all_to_all_bytes(
    tokens: np.ndarray,
    heads: np.ndarray,
    kv_heads: np.ndarray,
    head_dim: int,
    *,
    q_heads: bool,
    kv: bool,
    element_bytes: int = BF16,
) -> np.ndarray:
    """`all_to_all_bytes` of many groups at once: [group, i, j] from [group, member] tokens,
    query heads and K/V heads (padding members with 0 tokens send and receive nothing)."""
    per_token = heads * q_heads + 2 * kv_heads * kv
    matrix = tokens[:, :, None] * per_token[:, None, :] * head_dim * element_bytes
    diagonal = np.arange(matrix.shape[1])
    matrix[:, diagonal, diagonal] = 0.0
    return matrix


def ring_senders(layout: AttentionLayout) -> RingSenders:
    """For every rank, the ranks of the previous ring group that send it K/V heads; and for
    every rank, how many K/V heads per block token it sends on its outgoing hop."""
    world = layout.world_size
    heads_out, kv_heads_in = [0] * world, [0] * world
    senders_of: list[list[int]] = [[] for _ in range(world)]
    group_count = len(layout.groups)
    for position, members in enumerate(layout.groups):
        holder = kv_keepers(layout, layout.groups[(position - 1) % group_count])
        for rank in members:
            low, high = layout.kv_head_range(rank)
            for head in range(low, high):
                heads_out[holder[head]] += 1
            senders_of[rank] = sorted({holder[head] for head in range(low, high)})
            kv_heads_in[rank] = high - low
    return _links(senders_of, kv_heads_in, heads_out)


def dkv_ring_senders(layout: AttentionLayout) -> RingSenders:
    """The backward hops of the FP32 dK/dV accumulators: each K/V head goes from its keeper
    in the previous group to its keeper in this group. A rank that keeps no head receives
    nothing (a link to itself with no heads)."""
    world = layout.world_size
    heads_out, heads_in = [0] * world, [0] * world
    senders_of: list[set[int]] = [set() for _ in range(world)]
    group_count = len(layout.groups)
    for position, members in enumerate(layout.groups):
        previous = kv_keepers(layout, layout.groups[(position - 1) % group_count])
        for head, keeper in kv_keepers(layout, members).items():
            senders_of[keeper].add(previous[head])
            heads_in[keeper] += 1
            heads_out[previous[head]] += 1
    rows = [sorted(senders) or [rank] for rank, senders in enumerate(senders_of)]
    return _links(rows, heads_in, heads_out)


@dataclass(frozen=True)
class FoldLinks:
    """Inside each group, a non-keeper holder of a boundary K/V head hands the keeper its FP32
    partial dK/dV after every backward ring step: one link per (holder, keeper) pair."""

    folders: np.ndarray  # [link] sending rank
    keepers: np.ndarray  # [link] receiving rank (same group)
    heads: np.ndarray  # [link] shared heads folded


def fold_links(layout: AttentionLayout) -> FoldLinks:
    pairs: dict[tuple[int, int], int] = {}
    for members in layout.groups:
        keeper_of = kv_keepers(layout, members)
        for rank in members:
            low, high = layout.kv_head_range(rank)
            for head in range(low, high):
                if keeper_of[head] != rank:
                    key = (rank, keeper_of[head])
                    pairs[key] = pairs.get(key, 0) + 1
    keys = sorted(pairs)
    return FoldLinks(
        folders=np.array([k[0] for k in keys], dtype=np.int64),
        keepers=np.array([k[1] for k in keys], dtype=np.int64),
        heads=np.array([pairs[k] for k in keys], dtype=np.int64),
    )


def _links(senders_of: list[list[int]], heads_in: list[int], heads_out: list[int]) -> RingSenders:
    world = len(senders_of)
    counts = np.array([len(senders) for senders in senders_of], dtype=np.int64)
    width = int(counts.max())
    padded = np.array([row + row[:1] * (width - len(row)) for row in senders_of])
    return RingSenders(
        senders=np.array([s for senders in senders_of for s in senders], dtype=np.int64),
        receivers=np.repeat(np.arange(world, dtype=np.int64), counts),
        first_link=np.cumsum(counts) - counts,
        kv_heads_in=np.array(heads_in, dtype=np.int64),
        heads_out=np.array(heads_out, dtype=np.int64),
        sender_columns=tuple(np.ascontiguousarray(column) for column in padded.T),
    )
