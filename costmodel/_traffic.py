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

from hexiseq.layout import AttentionLayout

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


def ring_traffic(layout: AttentionLayout) -> tuple[RingSenders, RingSenders, FoldLinks]:
    """`ring_senders`, `dkv_ring_senders` and `fold_links` of `layout`, from one pass over
    the heads the ranks hold (the simulator asks for all three of every new ring)."""
    heads = _HeadsHeld(layout)
    return _ring_senders(heads), _dkv_ring_senders(heads), _fold_links(heads)


def ring_senders(layout: AttentionLayout) -> RingSenders:
    """For every rank, the ranks of the previous ring group that send it K/V heads; and for
    every rank, how many K/V heads per block token it sends on its outgoing hop."""
    return _ring_senders(_HeadsHeld(layout))


def _ring_senders(heads: _HeadsHeld) -> RingSenders:
    senders = heads.keeper[heads.previous_group[heads.rank], heads.head]
    heads_out = np.bincount(senders, minlength=heads.world)
    return _links(heads.world, heads.rank, senders, heads.kv_counts, heads_out)


def dkv_ring_senders(layout: AttentionLayout) -> RingSenders:
    """The backward hops of the FP32 dK/dV accumulators: each K/V head goes from its keeper
    in the previous group to its keeper in this group. A rank that keeps no head receives
    nothing (a link to itself with no heads)."""
    return _dkv_ring_senders(_HeadsHeld(layout))


def _dkv_ring_senders(heads: _HeadsHeld) -> RingSenders:
    receivers = heads.keeper.ravel()  # [group x head] this group's keeper of the head
    previous = np.roll(heads.keeper, 1, axis=0).ravel()  # the previous group's keeper
    heads_in = np.bincount(receivers, minlength=heads.world)
    heads_out = np.bincount(previous, minlength=heads.world)
    idle = np.flatnonzero(heads_in == 0)  # a link to itself
    return _links(
        heads.world,
        np.concatenate([receivers, idle]),
        np.concatenate([previous, idle]),
        heads_in,
        heads_out,
    )


class _HeadsHeld:
    """Every (rank, K/V head) a rank holds inside attention, as parallel arrays, and each
    group's keeper of each K/V head (`hexiseq.layout.kv_keepers`: its lowest holder), as
    [ring position, K/V head]. Numpy over all ranks at once: the simulator asks for these
    tables for every new grouping, on up to 1024 ranks."""

    def __init__(self, layout: AttentionLayout) -> None:
        self.world = layout.world_size
        starts, ends = np.array(layout.head_ranges, dtype=np.int64).reshape(-1, 2).T
        ratio = layout.gqa_ratio
        low, high = starts // ratio, -(-ends // ratio)  # `layout.kv_head_range`
        self.kv_counts = high - low
        group_of = np.empty(self.world, dtype=np.int64)
        for position, members in enumerate(layout.groups):
            group_of[list(members)] = position
        self.rank = np.repeat(np.arange(self.world, dtype=np.int64), self.kv_counts)
        first = np.cumsum(self.kv_counts) - self.kv_counts
        self.head = low[self.rank] + np.arange(len(self.rank)) - first[self.rank]
        self.group = group_of[self.rank]
        group_count = len(layout.groups)
        self.keeper = np.full((group_count, layout.num_kv_heads), self.world, dtype=np.int64)
        np.minimum.at(self.keeper, (self.group, self.head), self.rank)
        self.previous_group = (group_of - 1) % group_count


@dataclass(frozen=True)
class FoldLinks:
    """Inside each group, a non-keeper holder of a boundary K/V head hands the keeper its FP32
    partial dK/dV after every backward ring step: one link per (holder, keeper) pair."""

    folders: np.ndarray  # [link] sending rank
    keepers: np.ndarray  # [link] receiving rank (same group)
    heads: np.ndarray  # [link] shared heads folded


def fold_links(layout: AttentionLayout) -> FoldLinks:
    return _fold_links(_HeadsHeld(layout))


def _fold_links(heads: _HeadsHeld) -> FoldLinks:
    keepers = heads.keeper[heads.group, heads.head]
    shared = keepers != heads.rank
    world = np.int64(heads.world)
    pairs, counts = np.unique(heads.rank[shared] * world + keepers[shared], return_counts=True)
    return FoldLinks(folders=pairs // world, keepers=pairs % world, heads=counts.astype(np.int64))


def _links(
    world: int,
    receivers: np.ndarray,
    senders: np.ndarray,
    heads_in: np.ndarray,
    heads_out: np.ndarray,
) -> RingSenders:
    """The links of (receiver, sender) pairs (repeats counted once), sorted by receiver and
    then sender; every rank must receive on at least one."""
    pairs = np.unique(receivers * np.int64(world) + senders)
    receivers, senders = pairs // world, pairs % world
    counts = np.bincount(receivers, minlength=world).astype(np.int64)
    first_link = np.cumsum(counts) - counts
    columns = tuple(
        np.ascontiguousarray(senders[np.where(slot < counts, first_link + slot, first_link)])
        for slot in range(int(counts.max()))
    )  # padded with each rank's first sender
    return RingSenders(
        senders=senders,
        receivers=receivers,
        first_link=first_link,
        kv_heads_in=np.asarray(heads_in, dtype=np.int64),
        heads_out=np.asarray(heads_out, dtype=np.int64),
        sender_columns=columns,
    )
