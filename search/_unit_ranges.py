"""The integer units each class may take at a step time (`local_milp._Model`'s fastest
integer units)."""

from __future__ import annotations

import copy
import heapq
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hexiseq.search.local_milp import _Model


class UnitRanges:
    """Per class, the units allowed at a step time T: at least the class size and what its
    members' ring traffic needs by T, at most what they compute by T less a group's possible
    leftover unit (the time rows price it) and the ceiling."""

    def __init__(self, model: _Model, times, ceilings: np.ndarray) -> None:
        self.starts = np.concatenate([[0], np.cumsum([len(t[0]) for t in times])[:-1]])
        self.per_unit = np.concatenate([t[0] for t in times])
        self.fixed = np.concatenate([t[1] for t in times])
        self.ring = np.concatenate(model.ring)
        self.ceilings = ceilings
        self.smallest = np.array([float(cls.size - 1) for cls in model.classes])  # + leftover
        self.counts = np.array([len(cls.positions) for cls in model.classes], dtype=float)
        self.total_units = float(model.total_units)
        self.total_tokens = float(model.problem.train.seq_len)
        self.block = 2.0 * model.quantum
        self._changes: dict[tuple[float, int], np.ndarray] = {}  # shared by `under` copies

    def under(self, ceilings: np.ndarray) -> UnitRanges:
        """These ranges under other ceilings (the times' arrays shared, not rebuilt)."""
        other = copy.copy(self)
        other.ceilings = ceilings
        return other

    def trimmed(self, units: np.ndarray, low: np.ndarray) -> np.ndarray:
        """`units` less one unit at a time, each from the class that finishes last (the
        first of equals; classes at `low` left alone), until they fit the sequence's length.
        A heap of the classes' finish times replaces a scan of them per unit cut: the same
        cuts, in the same order."""
        total = float(units @ self.counts)
        if total <= self.total_units:
            return units
        members = self._members()
        finish = self.finish_all_s(units).tolist()
        heap = [(-finish[c], c) for c in range(len(units)) if units[c] - 1 >= low[c]]
        heapq.heapify(heap)
        while total > self.total_units:
            c = heapq.heappop(heap)[1]
            units[c] -= 1
            total -= self.counts[c]
            if units[c] - 1 >= low[c]:
                heapq.heappush(heap, (-self._member_finish_s(members[c], units[c]), c))
        return units

    def _members(self) -> list[list[tuple[float, float, float]]]:
        """Per class, its members' (per unit, fixed, ring) seconds as Python floats."""
        rows = list(zip(self.per_unit.tolist(), self.fixed.tolist(), self.ring.tolist()))
        bounds = self._bounds().tolist()
        return [rows[start:end] for start, end in zip(bounds, bounds[1:])]

    def _member_finish_s(self, members: list[tuple[float, float, float]], units: float) -> float:
        """One class's slowest member's seconds at `units` from its members' (per unit,
        fixed, ring) seconds: `finish_all_s`'s operations in Python floats (the same value)."""
        left = self.total_tokens - self.block * units
        return max(max(p * (units + 1) + f, r * left + f) for p, f, r in members)

    def finish_all_s(self, units: np.ndarray) -> np.ndarray:
        """Every class's `finish_s` at its `units`."""
        per_member = units[np.repeat(np.arange(len(units)), np.diff(self._bounds()))]
        busy = self.per_unit * (per_member + 1) + self.fixed
        traffic = self.ring * (self.total_tokens - self.block * per_member) + self.fixed
        return np.maximum.reduceat(np.maximum(busy, traffic), self.starts)

    def _bounds(self) -> np.ndarray:
        return np.append(self.starts, len(self.per_unit))

    def changes_after(self, step_s: float, steps: int) -> np.ndarray:
        """Step times above `step_s` at which some member's busy cap rises or ring need
        falls by one unit, the next `steps` of each, sorted (each a hair above the change,
        so evaluating there sees it): the ranges change nowhere else. They do not depend
        on the ceilings: found once for these times."""
        key = (step_s, steps)
        if key not in self._changes:
            self._changes[key] = self._new_changes_after(step_s, steps)
        return self._changes[key]

    def _new_changes_after(self, step_s: float, steps: int) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            spare = step_s - self.fixed
            busy = np.floor(np.maximum(spare, 0.0) / self.per_unit + 1e-9)
            rises = self.fixed[:, None] + self.per_unit[:, None] * (
                busy[:, None] + np.arange(1, steps + 1) - 1e-9
            )
            rises[self.per_unit <= 0] = np.inf
            need = np.ceil((self.total_tokens - spare / self.ring) / self.block - 1e-9)
            falls = self.fixed[:, None] + self.ring[:, None] * (
                self.total_tokens - (need[:, None] - np.arange(1, steps + 1) + 1e-9) * self.block
            )
            falls[self.ring <= 0] = np.inf
        times = np.concatenate([rises.ravel(), falls.ravel(), self.fixed])
        times = np.unique(times[np.isfinite(times) & (times > step_s)])
        return times * (1 + 1e-12)

    def covers(self, step_s: np.ndarray) -> np.ndarray:
        """[times] whether units inside the ranges at each step time cover the sequence (the
        leftover units one per group)."""
        low, high = self.at(step_s)
        return (
            np.all(low <= high, axis=1)
            & (high @ self.counts >= self.total_units - self.counts.sum())
            & (low @ self.counts <= self.total_units)
        )

    def at(self, step_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lowest, highest) units per class at each step time: two [times, classes]."""
        spare = step_s[:, None] - self.fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            busy_cap = np.where(self.per_unit > 0, spare / self.per_unit - 1.0, np.inf)
            ring_need = np.where(
                self.ring > 0, (self.total_tokens - spare / self.ring) / self.block, 0.0
            )
        busy_cap = np.where(spare < 0, -1.0, busy_cap)
        high = np.minimum(
            np.minimum.reduceat(np.floor(busy_cap + 1e-9), self.starts, axis=1), self.ceilings
        )
        low = np.maximum(
            np.maximum.reduceat(np.ceil(ring_need - 1e-9), self.starts, axis=1), self.smallest
        )
        return low, high
