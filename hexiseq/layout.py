"""The CP–HP attention layout (docs/design.md §3): who owns which tokens and which heads.

Pure: stdlib and maths only. Builders return valid layouts (the zigzag builder checks its
arguments, and what it builds from them keeps every rule by construction; a property test
validates its output); `AttentionLayout.validate()` raises `InputError` (a `ValueError`) with
a one-line message naming what is broken.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

from hexiseq._layout_checks import (
    check_groups,
    check_head_ranges,
    check_sizes,
    check_token_ranges,
)
from hexiseq.errors import InputError

Range = tuple[int, int]


@dataclass(frozen=True)
class AttentionLayout:
    """Token and head ownership of every rank; see docs/design.md §3 for the contract."""

    seq_len: int
    num_heads: int  # query heads
    num_kv_heads: int  # divides num_heads (GQA ratio r = num_heads // num_kv_heads)
    groups: tuple[tuple[int, ...], ...]  # HP groups in ring order; members are global ranks
    token_ranges: tuple[tuple[Range, ...], ...]  # [rank] -> half-open token ranges it owns
    head_ranges: tuple[Range, ...]  # [rank] -> half-open query-head range inside attention

    @property
    def world_size(self) -> int:
        """Number of ranks (one token-range list per rank)."""
        return len(self.token_ranges)

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head, r = num_heads // num_kv_heads."""
        return self.num_heads // self.num_kv_heads

    def group_of(self, rank: int) -> int:
        """Ring position of the HP group holding `rank`; raises InputError for an unknown rank."""
        if rank in self._group_by_rank:
            return self._group_by_rank[rank]
        raise InputError(f"layout: rank {rank} is in no group; ranks are 0..{self.world_size - 1}")

    @cached_property
    def _group_by_rank(self) -> dict[int, int]:
        found: dict[int, int] = {}  # the first group wins, as a scan would find it
        for index, members in enumerate(self.groups):
            for rank in members:
                found.setdefault(rank, index)
        return found

    def segment(self, group_index: int) -> tuple[Range, ...]:
        """Union of the group's members' token ranges, sorted, adjacent ranges merged."""
        ranges = [r for rank in self.groups[group_index] for r in self.token_ranges[rank]]
        return _merge_ranges(ranges)

    def segment_length(self, group_index: int) -> int:
        """Number of tokens in the group's segment."""
        return self.segment_lengths[group_index]

    def num_tokens(self, rank: int) -> int:
        """Number of tokens `rank` owns outside attention."""
        return self.token_counts[rank]

    @cached_property
    def segment_lengths(self) -> tuple[int, ...]:
        """[group] tokens in each group's segment, in ring order (counted once a layout)."""
        return tuple(_total_length(self.segment(g)) for g in range(len(self.groups)))

    @cached_property
    def zigzag_chunks(self) -> tuple[int, ...] | None:
        """[group] the length of each of the group's two chunks where the layout is a
        generalized zigzag (docs/design.md §3: in ring order, group g's segment is front
        chunk g and back chunk 2G-1-g, of equal lengths); None for any other layout.
        `build_zigzag_layout` sets it; other layouts are checked once."""
        front, back, chunks = 0, self.seq_len, []
        for g in range(len(self.groups)):
            pieces = self.segment(g)
            length = _total_length(pieces)
            chunk = length // 2
            halves = ((front, front + chunk), (back - chunk, back))
            if length % 2 or pieces not in (halves, ((front, back),)) or chunk == 0:
                return None
            front, back = front + chunk, back - chunk
            chunks.append(chunk)
        return tuple(chunks) if front == back else None

    @cached_property
    def token_counts(self) -> tuple[int, ...]:
        """[rank] tokens each rank owns outside attention (counted once a layout)."""
        return tuple(_total_length(ranges) for ranges in self.token_ranges)

    def num_heads_of(self, rank: int) -> int:
        """Number of query heads `rank` owns inside attention."""
        start, end = self.head_ranges[rank]
        return end - start

    def kv_head_range(self, rank: int) -> Range:
        """KV heads `rank` needs: [h0 // r, ceil(h1 / r)); boundary KV heads go to both owners."""
        start, end = self.head_ranges[rank]
        ratio = self.gqa_ratio
        return (start // ratio, -(-end // ratio))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (ints and nested lists)."""
        return {
            "seq_len": self.seq_len,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "groups": [list(members) for members in self.groups],
            "token_ranges": [[list(r) for r in ranges] for ranges in self.token_ranges],
            "head_ranges": [list(r) for r in self.head_ranges],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttentionLayout:
        """Inverse of `to_dict`; returns a validated layout, raises InputError on bad input."""
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise InputError(f"layout: missing field(s) {', '.join(missing)}")
        try:
            layout = cls(
                seq_len=data["seq_len"],
                num_heads=data["num_heads"],
                num_kv_heads=data["num_kv_heads"],
                groups=tuple(tuple(members) for members in data["groups"]),
                token_ranges=tuple(
                    tuple(_as_range(r) for r in ranges) for ranges in data["token_ranges"]
                ),
                head_ranges=tuple(_as_range(r) for r in data["head_ranges"]),
            )
        except TypeError as error:
            raise InputError(f"layout: malformed field ({error})") from error
        layout.validate()
        return layout

    def validate(self) -> None:
        """Check every rule of docs/design.md §3; raises InputError naming the first broken one."""
        check_sizes(self)
        check_groups(self.groups, self.world_size)
        check_token_ranges(self)
        check_head_ranges(self)


_FIELDS = ("seq_len", "num_heads", "num_kv_heads", "groups", "token_ranges", "head_ranges")


def _as_range(value: Sequence[int]) -> Range:
    if len(value) != 2:
        raise InputError(f"layout: range {list(value)} must be a pair [start, end)")
    return (value[0], value[1])


def _merge_ranges(ranges: Sequence[Range]) -> tuple[Range, ...]:
    merged: list[Range] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)


def _total_length(ranges: Sequence[Range]) -> int:
    return sum(end - start for start, end in ranges)


def kv_keepers(layout: AttentionLayout, members: Iterable[int]) -> dict[int, int]:
    """K/V head -> the lowest rank among `members` that holds it: the head's sender on the
    ring hop and the keeper of its dK/dV accumulator. The runtime and the simulator's traffic
    model both follow this rule."""
    keeper: dict[int, int] = {}
    for rank in sorted(members):
        low, high = layout.kv_head_range(rank)
        for head in range(low, high):
            keeper.setdefault(head, rank)
    return keeper


# --- pure helpers -----------------------------------------------------------------------------


def apportion(
    total: int, weights: Sequence[float], quantum: int = 1, minimum: int = 0
) -> list[int]:
    """Split `total` into multiples of `quantum`, each >= `minimum`, proportional to `weights`.

    Largest-remainder (Hamilton) method on units of `quantum`, computed exactly (fractions);
    ties go to the lower index. Entries whose proportional quota falls below `minimum` are
    raised to it and the rest is shared by the others in proportion. Raises InputError for
    negative, non-finite or zero-sum weights, a total not a multiple of quantum, or a minimum
    that is not a multiple of quantum or cannot be given to every entry.
    """
    _check_apportion_args(total, weights, quantum, minimum)
    units, min_units = total // quantum, minimum // quantum
    if len(set(weights)) == 1 and units // len(weights) >= min_units:
        return _equal_shares(units, len(weights), quantum)  # the common case, without fractions
    exact = [Fraction(w) for w in weights]
    fixed = _clamp_to_minimum(units, exact, min_units)
    free = [i for i in range(len(exact)) if i not in fixed]
    remaining = units - min_units * len(fixed)
    shares = dict.fromkeys(fixed, min_units)
    shares.update(_largest_remainder(remaining, {i: exact[i] for i in free}))
    return [shares[i] * quantum for i in range(len(exact))]


def _equal_shares(units: int, count: int, quantum: int) -> list[int]:
    """Equal weights: the same answer as largest remainder (ties to the lower index)."""
    share, extra = divmod(units, count)
    return [(share + (i < extra)) * quantum for i in range(count)]


def _check_apportion_args(
    total: int, weights: Sequence[float], quantum: int, minimum: int
) -> None:
    if quantum <= 0:
        raise InputError(f"apportion: quantum={quantum} is not allowed; need a positive integer")
    if total < 0 or total % quantum:
        raise InputError(f"apportion: total={total} is not a non-negative multiple of {quantum}")
    if minimum < 0 or minimum % quantum:
        raise InputError(
            f"apportion: minimum={minimum} is not a non-negative multiple of {quantum}"
        )
    if not weights:
        raise InputError("apportion: weights is empty; need at least one weight")
    for index, weight in enumerate(weights):
        if not math.isfinite(weight) or weight < 0:
            raise InputError(f"apportion: weight {index} is {weight}; need finite and >= 0")
    if sum(weights) <= 0:
        raise InputError("apportion: weights sum to zero; need at least one positive weight")
    if minimum * len(weights) > total:
        raise InputError(
            f"apportion: cannot give each of {len(weights)} entries minimum={minimum} "
            f"out of total={total}"
        )


def _clamp_to_minimum(units: int, weights: list[Fraction], min_units: int) -> set[int]:
    """Indices whose proportional quota of what is left stays below the minimum."""
    fixed: set[int] = set()
    while True:
        free = [i for i in range(len(weights)) if i not in fixed]
        remaining = units - min_units * len(fixed)
        free_weight = sum(weights[i] for i in free)
        low = {i for i in free if remaining * weights[i] < min_units * free_weight}
        if not low:
            return fixed
        fixed |= low


def _largest_remainder(units: int, weights: Mapping[int, Fraction]) -> dict[int, int]:
    total_weight = sum(weights.values())
    quotas = {i: units * w / total_weight for i, w in weights.items()}
    shares = {i: math.floor(q) for i, q in quotas.items()}
    leftover = units - sum(shares.values())
    by_remainder = sorted(quotas, key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[:leftover]:
        shares[i] += 1
    return shares


def causal_pair_count(query_ranges: Sequence[Range], key_ranges: Sequence[Range]) -> int:
    """Exact number of (q, k) pairs with q in query_ranges, k in key_ranges and k <= q.

    Closed form per pair of half-open intervals, O(len(query_ranges) * len(key_ranges)); the
    ranges inside each list are assumed disjoint (overlaps are counted twice).
    """
    return sum(
        _causal_pairs_below(q_end, k_start, k_end) - _causal_pairs_below(q_start, k_start, k_end)
        for q_start, q_end in query_ranges
        for k_start, k_end in key_ranges
        if q_start < q_end and k_start < k_end
    )


def _causal_pairs_below(query_end: int, key_start: int, key_end: int) -> int:
    """Pairs (q, k) with 0 <= q < query_end, key_start <= k < key_end and k <= q."""
    # Query q sees min(q + 1, key_end) - key_start keys once q >= key_start: a triangle while
    # q < key_end, then a full row of key_end - key_start keys per query.
    triangle = max(0, min(query_end, key_end) - key_start)
    full_rows = max(0, query_end - key_end)
    return triangle * (triangle + 1) // 2 + full_rows * (key_end - key_start)


def full_pair_count(query_ranges: Sequence[Range], key_ranges: Sequence[Range]) -> int:
    """Number of all (q, k) pairs, q in query_ranges and k in key_ranges (no causal mask)."""
    return _total_length(query_ranges) * _total_length(key_ranges)


# --- builders ---------------------------------------------------------------------------------


def zigzag_segment_lengths(
    seq_len: int, weights: Sequence[float], chunk_quantum: int = 1
) -> list[int]:
    """Segment length per group, proportional to weights, each a multiple of 2*chunk_quantum.

    Every segment gets at least 2*chunk_quantum tokens. Raises InputError when seq_len is not a
    multiple of 2*chunk_quantum or is too short for one such piece per group.
    """
    return apportion(seq_len, weights, quantum=2 * chunk_quantum, minimum=2 * chunk_quantum)


def build_zigzag_layout(
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    groups: Sequence[Sequence[int]],
    segment_lengths: Sequence[int],
    token_weights: Sequence[Sequence[float]],
    head_counts: Sequence[Sequence[int]],
    *,
    chunk_quantum: int = 1,
) -> AttentionLayout:
    """Generalized zigzag layout (docs/design.md §3), validated.

    The sequence is cut into 2G chunks: group g owns front chunk g and back chunk 2G-1-g, each
    segment_lengths[g] / 2 tokens, so its causal work is s_g * (S + 1) / 2 pairs. Inside group g,
    member i gets a contiguous piece of each chunk apportioned by token_weights[g] in multiples
    of chunk_quantum, and head_counts[g][i] consecutive query heads. Every rank owns exactly two
    ranges (front piece, back piece), kept apart even where they touch (middle of the sequence) so
    the zigzag chunk structure stays visible. Ranks in `groups` are global ranks 0..N-1 in any
    order. Raises InputError naming the group for any inconsistent input.
    """
    _check_zigzag_args(seq_len, num_heads, groups, segment_lengths, token_weights, head_counts)
    _check_segment_lengths(seq_len, segment_lengths, chunk_quantum)
    world_size = sum(len(members) for members in groups)
    check_groups(groups, world_size)
    token_ranges: list[tuple[Range, Range]] = [((0, 0), (0, 0))] * world_size
    head_ranges: list[Range] = [(0, 0)] * world_size
    front_start, back_end = 0, seq_len
    for g, members in enumerate(groups):
        chunk = segment_lengths[g] // 2
        pieces = _chunk_pieces(g, chunk, len(members), token_weights[g], chunk_quantum)
        front, back, head = front_start, back_end - chunk, 0
        for rank, piece, heads in zip(members, pieces, head_counts[g], strict=True):
            token_ranges[rank] = ((front, front + piece), (back, back + piece))
            head_ranges[rank] = (head, head + heads)
            front, back, head = front + piece, back + piece, head + heads
        front_start, back_end = front_start + chunk, back_end - chunk
    # The arguments are checked above; what they build keeps every rule by construction:
    # front pieces tile [0, S/2) and back pieces [S/2, S), each at least one quantum, a rank's
    # front before its back, and each group's head counts (>= 1, summing to num_heads) tile
    # the heads. So only the sizes are left to check (the search builds thousands of these).
    layout = _finish(
        seq_len, num_heads, num_kv_heads, groups, token_ranges, head_ranges, by_construction=True
    )
    # what `zigzag_chunks` would find, known here (the simulator asks for every layout)
    layout.__dict__["zigzag_chunks"] = tuple(length // 2 for length in segment_lengths)
    return layout


def _check_zigzag_args(
    seq_len: int,
    num_heads: int,
    groups: Sequence[Sequence[int]],
    segment_lengths: Sequence[int],
    token_weights: Sequence[Sequence[float]],
    head_counts: Sequence[Sequence[int]],
) -> None:
    if not len(groups) == len(segment_lengths) == len(token_weights) == len(head_counts):
        raise InputError(
            f"build_zigzag_layout: {len(groups)} groups but {len(segment_lengths)} segment "
            f"lengths, {len(token_weights)} token weight lists and {len(head_counts)} head "
            "count lists; need one of each per group"
        )
    for g, members in enumerate(groups):
        if not len(members) == len(token_weights[g]) == len(head_counts[g]):
            raise InputError(
                f"build_zigzag_layout: group {g} has {len(members)} members but "
                f"{len(token_weights[g])} token weights and {len(head_counts[g])} head counts"
            )
        if sum(head_counts[g]) != num_heads or min(head_counts[g], default=1) < 1:
            raise InputError(
                f"build_zigzag_layout: group {g} head counts {list(head_counts[g])} are not "
                f"allowed; need each >= 1 and sum = num_heads={num_heads}"
            )


def _check_segment_lengths(seq_len: int, segment_lengths: Sequence[int], quantum: int) -> None:
    if quantum <= 0:
        raise InputError(f"build_zigzag_layout: chunk_quantum={quantum}; need a positive integer")
    for g, length in enumerate(segment_lengths):
        if length <= 0 or length % (2 * quantum):
            raise InputError(
                f"build_zigzag_layout: group {g} segment length {length} is not allowed; need "
                f"a positive multiple of 2*chunk_quantum={2 * quantum}"
            )
    if sum(segment_lengths) != seq_len:
        raise InputError(
            f"build_zigzag_layout: segment lengths sum to {sum(segment_lengths)}; "
            f"need seq_len={seq_len}"
        )


def _chunk_pieces(
    group_index: int, chunk: int, num_members: int, weights: Sequence[float], quantum: int
) -> list[int]:
    """Each member's piece of one zigzag chunk; every member gets at least one quantum."""
    if chunk < num_members * quantum:
        raise InputError(
            f"build_zigzag_layout: group {group_index} chunks of {chunk} tokens cannot give "
            f"each of its {num_members} members chunk_quantum={quantum} tokens"
        )
    first = weights[0] if weights else 0
    if 0 < first < math.inf and all(w == first for w in weights):  # equal shares, checked
        return _equal_shares(chunk // quantum, num_members, quantum)
    return apportion(chunk, weights, quantum=quantum, minimum=quantum)


def _lay_out(start: int, lengths: Sequence[int]) -> list[Range]:
    """Consecutive half-open ranges of the given lengths from `start`."""
    ranges = []
    for length in lengths:
        ranges.append((start, start + length))
        start += length
    return ranges


def _finish(
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    groups: Sequence[Sequence[int]],
    token_ranges: Sequence[Sequence[Range]],
    head_ranges: Sequence[Range],
    *,
    by_construction: bool = False,
) -> AttentionLayout:
    """The layout, validated (`by_construction`: its ranges are valid by how a builder made
    them from checked arguments, so only its sizes are checked)."""
    layout = AttentionLayout(
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        groups=tuple(tuple(members) for members in groups),
        token_ranges=tuple(map(tuple, token_ranges)),
        head_ranges=tuple(head_ranges),
    )
    if by_construction:
        check_sizes(layout)
    else:
        layout.validate()
    return layout


def build_uniform_layout(
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    group_sizes: Sequence[int],
    *,
    zigzag: bool = True,
) -> AttentionLayout:
    """Equal segments, equal token shares and near-equal head counts, validated.

    Ranks are numbered consecutively group by group. With zigzag=True the segments follow the
    generalized zigzag (standard zigzag ring attention when segments are equal; seq_len must be
    even); otherwise the sequence is cut contiguously in ring order. Heads are apportioned as
    evenly as possible (52 heads over 8 ranks -> 7,7,7,7,6,6,6,6).
    """
    if not group_sizes or min(group_sizes) < 1:
        raise InputError(f"build_uniform_layout: group sizes {list(group_sizes)}; need each >= 1")
    groups, next_rank = [], 0
    for size in group_sizes:
        groups.append(list(range(next_rank, next_rank + size)))
        next_rank += size
    by_size = {size: apportion(num_heads, [1] * size, minimum=1) for size in set(group_sizes)}
    head_counts = [by_size[size] for size in group_sizes]
    if zigzag:
        segments = zigzag_segment_lengths(seq_len, [1] * len(groups))
        weights = [[1] * size for size in group_sizes]
        return build_zigzag_layout(
            seq_len, num_heads, num_kv_heads, groups, segments, weights, head_counts
        )
    return _build_contiguous_layout(seq_len, num_heads, num_kv_heads, groups, head_counts)


def _build_contiguous_layout(
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    groups: Sequence[Sequence[int]],
    head_counts: Sequence[Sequence[int]],
) -> AttentionLayout:
    segments = apportion(seq_len, [1] * len(groups), minimum=1)
    token_ranges: list[list[Range]] = []
    head_ranges: list[Range] = []
    for members, (start, end), counts in zip(
        groups, _lay_out(0, segments), head_counts, strict=True
    ):
        shares = apportion(end - start, [1] * len(members), minimum=1)
        token_ranges += [[piece] for piece in _lay_out(start, shares)]
        head_ranges += _lay_out(0, counts)
    return _finish(seq_len, num_heads, num_kv_heads, groups, token_ranges, head_ranges)
