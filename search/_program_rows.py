"""The local stage's constraint rows, built one at a time or a block at once, as the
column-wise `Program` HiGHS takes (`search._highs`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.search._highs import Program


@dataclass(frozen=True)
class Block:
    """Rows built once and added to many programs: entries (row, column, value) with rows
    counted from the block's first, and each row's bounds."""

    rows: np.ndarray
    columns: np.ndarray
    values: np.ndarray
    lower: list[float]
    upper: list[float]


class Rows:
    """Sparse constraint rows lower <= A x <= upper, built one at a time or a block at once;
    the entries keep the order they were added in."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # entries added one at a time since the last block
        self.columns: list[int] = []
        self.values: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, coefficients: dict[int, float], lower: float, upper: float) -> None:
        row = len(self.lower)
        for column, value in coefficients.items():
            self.rows.append(row)
            self.columns.append(column)
            self.values.append(value)
        self.lower.append(lower)
        self.upper.append(upper)

    def add_block(
        self,
        row_of: np.ndarray,
        column_of: np.ndarray,
        values: np.ndarray,
        lower: np.ndarray,
        upper: np.ndarray,
    ) -> None:
        """Append `len(lower)` rows given as entries (row counted from the first of them,
        column, value), in order."""
        self._flush()
        offset = len(self.lower)
        self._chunks.append(
            (
                (row_of + offset).astype(np.int32),
                column_of.astype(np.int32),
                values.astype(float),
            )
        )
        self.lower += lower.tolist()
        self.upper += upper.tolist()

    def extend(self, block: Block) -> None:
        """Append `block`'s rows after these."""
        self._flush()
        self._chunks.append((block.rows + len(self.lower), block.columns, block.values))
        self.lower += block.lower
        self.upper += block.upper

    def block(self) -> Block:
        """These rows as a block for `extend`."""
        rows, columns, values = self._entries()
        return Block(rows, columns, values, list(self.lower), list(self.upper))

    def _flush(self) -> None:
        if self.rows:
            self._chunks.append(
                (
                    np.asarray(self.rows, dtype=np.int32),
                    np.asarray(self.columns, dtype=np.int32),
                    np.asarray(self.values, dtype=float),
                )
            )
            self.rows, self.columns, self.values = [], [], []

    def _entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every entry's (row, column, value), in the order added."""
        self._flush()
        if not self._chunks:
            empty = np.zeros(0, dtype=np.int32)
            return empty, empty, np.zeros(0)
        if len(self._chunks) > 1:
            self._chunks = [tuple(np.concatenate(part) for part in zip(*self._chunks))]
        return self._chunks[0]

    @staticmethod
    def without_last(rows: Rows) -> Rows:
        """A copy of `rows` without its last row."""
        entries = rows._entries()
        keep = entries[0] != len(rows.lower) - 1
        copy = Rows()
        copy._chunks = [tuple(part[keep] for part in entries)]
        copy.lower, copy.upper = rows.lower[:-1], rows.upper[:-1]
        return copy

    def program(self, cost: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> Program:
        """These rows, minimizing `cost` within the column bounds `lower`..`upper` (one
        column each); the matrix column-wise, as HiGHS takes it."""
        rows, columns, values = self._entries()
        order = np.argsort(columns, kind="stable")
        starts = np.searchsorted(columns[order], np.arange(len(cost) + 1)).astype(np.int32)
        return Program(
            cost=cost,
            starts=starts,
            rows=rows[order],
            values=values[order],
            row_lower=np.asarray(self.lower, dtype=float),
            row_upper=np.asarray(self.upper, dtype=float),
            lower=lower,
            upper=upper,
        )


def stacked_blocks(blocks: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row_of, column_of, values, upper) blocks one after the other, rows renumbered."""
    offsets = np.cumsum([0] + [len(upper) for *_, upper in blocks[:-1]])
    row_of = np.concatenate([b[0] + offset for b, offset in zip(blocks, offsets)])
    return (
        row_of,
        np.concatenate([b[1] for b in blocks]),
        np.concatenate([b[2] for b in blocks]),
        np.concatenate([b[3] for b in blocks]),
    )
