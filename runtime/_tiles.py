"""The causal mask of one ring block as a few mask-free kernel calls ("tiles") (pure).

Inside the ring, queries and keys are kept sorted by global token position. Then query row i
sees exactly a prefix of the block's keys, of length c_i = #(key positions <= its position),
and c_i never decreases with i: the mask is a staircase. A staircase is cut into runs of rows
where c_i is constant (a full rectangle: rows x keys[0:c)) or grows by one per row (a
rectangle plus a causal square on the diagonal). Every tile is therefore either fully visible
or a square with the standard lower-triangular mask, so the block kernel never needs an
explicit mask, and no tile row is fully masked.

Because token ranges partition the sequence, c_i can only change where a key range starts or
ends inside a query range; the runs are found from the ranges, never position by position.
For zigzag layouts this gives one tile per block (the own block: one causal square).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

Range = tuple[int, int]


@dataclass(frozen=True)
class Tile:
    """Rows [row_start, row_end) of the sorted queries attend to keys [key_start, key_end) of
    the sorted block; `causal`: a square tile where row t sees keys key_start..key_start+t."""

    row_start: int
    row_end: int
    key_start: int
    key_end: int
    causal: bool

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_end)

    @property
    def keys(self) -> slice:
        return slice(self.key_start, self.key_end)


@dataclass(frozen=True)
class _Run:
    """Rows [start, end); row start+t sees `first_count + slope*t` keys (slope 0 or 1;
    None for a one-row run, which fits either)."""

    start: int
    end: int
    first_count: int
    slope: int | None

    @property
    def last_count(self) -> int:
        return self.first_count + (self.slope or 0) * (self.end - self.start - 1)


def block_tiles(
    query_ranges: Sequence[Range], key_ranges: Sequence[Range], *, causal: bool
) -> tuple[Tile, ...]:
    """Tiles covering exactly the visible (query, key) pairs of a block, each pair once.

    `query_ranges`/`key_ranges`: the positions of the sorted queries and keys as sorted,
    disjoint half-open ranges. causal=False: one full tile. Empty tuple: nothing visible.
    """
    query_count = _total(query_ranges)
    key_count = _total(key_ranges)
    if not causal:
        return (Tile(0, query_count, 0, key_count, False),) if query_count and key_count else ()
    runs = _coalesce(_visibility_runs(query_ranges, key_ranges))
    return tuple(tile for run in runs for tile in _run_tiles(run))


def sorted_ranges(ranges: Sequence[Range]) -> tuple[Range, ...]:
    """The ranges sorted by start, touching ranges merged (fewer runs, same positions)."""
    merged: list[Range] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return tuple(merged)


def _visibility_runs(query_ranges: Sequence[Range], key_ranges: Sequence[Range]) -> list[_Run]:
    """Runs of query rows, split where a key range starts or ends inside a query range;
    rows that see no key are left out."""
    counter = _KeyCounter(key_ranges)
    runs: list[_Run] = []
    row = 0
    for start, end in query_ranges:
        cuts = sorted({start, end, *counter.boundaries_inside(start, end)})
        for piece_start, piece_end in zip(cuts, cuts[1:]):
            first = counter.keys_at_or_before(piece_start)
            length = piece_end - piece_start
            diagonal = counter.is_key(piece_start)  # the piece lies inside one key range
            slope = None if length == 1 else int(diagonal)
            if first > 0:
                runs.append(_Run(row, row + length, first, slope))
            row += length
    return runs


def _coalesce(runs: list[_Run]) -> list[_Run]:
    """Join neighbouring runs whose rows continue the same constant or diagonal staircase."""
    joined: list[_Run] = []
    for run in runs:
        previous = joined[-1] if joined else None
        slope = _joined_slope(previous, run) if previous else None
        if previous is not None and slope is not None:
            joined[-1] = _Run(previous.start, run.end, previous.first_count, slope)
        else:
            joined.append(run)
    return joined


def _joined_slope(first: _Run, second: _Run) -> int | None:
    """The slope of `first` + `second` as one run, or None when they do not join."""
    if first.end != second.start:
        return None
    for slope in (0, 1):
        fits = first.slope in (slope, None) and second.slope in (slope, None)
        if fits and second.first_count == first.last_count + slope:
            return slope
    return None


def _run_tiles(run: _Run) -> list[Tile]:
    if not run.slope:  # constant: every row sees the same key prefix
        return [Tile(run.start, run.end, 0, run.first_count, False)]
    # Row start+t sees keys [0, first_count + t): a full prefix [0, first_count - 1) and a
    # causal square [first_count - 1, first_count - 1 + rows).
    diagonal_start = run.first_count - 1
    square = Tile(run.start, run.end, diagonal_start, diagonal_start + run.end - run.start, True)
    if diagonal_start == 0:
        return [square]
    return [Tile(run.start, run.end, 0, diagonal_start, False), square]


class _KeyCounter:
    """Counts of sorted key positions, from their ranges."""

    def __init__(self, key_ranges: Sequence[Range]) -> None:
        self.starts = [start for start, _ in key_ranges]
        self.ends = [end for _, end in key_ranges]
        self.before: list[int] = []  # keys in the ranges before each range
        total = 0
        for start, end in key_ranges:
            self.before.append(total)
            total += end - start

    def keys_at_or_before(self, position: int) -> int:
        index = bisect.bisect_right(self.starts, position) - 1
        if index < 0:
            return 0
        return self.before[index] + min(position + 1, self.ends[index]) - self.starts[index]

    def is_key(self, position: int) -> bool:
        index = bisect.bisect_right(self.starts, position) - 1
        return index >= 0 and position < self.ends[index]

    def boundaries_inside(self, start: int, end: int) -> list[int]:
        """Key-range starts and ends strictly inside (start, end)."""
        low = bisect.bisect_right(self.starts, start) - 1
        high = bisect.bisect_left(self.starts, end)
        edges = [e for i in range(max(low, 0), high) for e in (self.starts[i], self.ends[i])]
        return [e for e in edges if start < e < end]


def _total(ranges: Sequence[Range]) -> int:
    return sum(end - start for start, end in ranges)
