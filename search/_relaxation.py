"""The local LP relaxation's optimum without an LP, where memory does not bind.

`local_milp`'s relaxation minimizes the step time T over continuous segment units u_c, state
shares f and the largest block B. Its rows split in two:

- time and length rows, which involve only T and u: each class's units lie in a range that
  widens as T grows (at most what its members compute by T less the leftover unit a group
  may hold, at least its size and what its ring traffic needs by T), and the classes' units
  must cover the sequence;
- memory rows, which tie u, B and f.

Dropping the memory rows leaves a relaxation of the relaxation whose optimum T0 is the least
T at which the ranges can cover the sequence: one monotone condition. Most often the busy
rows alone set it, and their root comes by Newton steps (`_busy_root`); where the ring's
rows bind, their root comes from each pair of lines that must cross and Newton steps on the
classes' least units (`_Ranges._ring_root`); a vectorized bisection is the fallback. If
some point at T0 also satisfies every memory row (the units chosen inside the ranges, B as
small as they allow, each state-share column as large as its rows allow, and the shares
summing to at least one), T0 is the LP's optimum exactly: the LP cannot be below T0, and
that point is feasible for it. Otherwise (memory binds) the caller solves the LP. The
screen scores hundreds of candidates this way at a fraction of an LP's cost.
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel import memory_limit_bytes
from hexiseq.search._memory_rows import phase_arrays

RELATIVE_TOLERANCE = 1e-12  # bisection width, relative to T
ROUNDS = 8  # bisection rounds of POINTS step times each: 8 x log2(66) bits, far past 1e-12
POINTS = 64
_DOUBLINGS = 64
_NEWTON_STEPS = 64  # a piecewise-linear root: exact after as many steps as pieces it crosses


def unconstrained_optimum(model, times) -> tuple[float, np.ndarray] | None:
    """(the LP's optimal step seconds, continuous units per class at it that every memory
    row allows) where memory does not bind there, else None (memory may bind, or no step
    time lets the units cover the sequence: let the LP say which)."""
    ranges = _Ranges(model, times)
    step_s = ranges.least_step_s()
    if step_s is None:
        return None
    units = ranges.units_at(step_s)
    if units is None or not _memory_fits(model, units):
        return None
    return step_s, units


class _Ranges:
    """Each class's continuous units at a step time T: between its size and its ring's need,
    and what its members finish by T (the time rows of `local_milp._Model._time_rows`)."""

    def __init__(self, model, times) -> None:
        self.times = times
        self.starts = np.concatenate([[0], np.cumsum([len(t[0]) for t in times])[:-1]])
        self.per_unit = np.concatenate([t[0] for t in times])
        self.fixed = np.concatenate([t[1] for t in times])
        self.ring = np.concatenate(model.ring)
        self.counts = np.array([len(cls.positions) for cls in model.classes], dtype=float)
        self.smallest = np.array([float(cls.size - 1) for cls in model.classes])  # + leftover
        self.total_tokens = float(model.problem.train.seq_len)
        self.block = 2.0 * model.quantum
        self.high_sum = float(model.total_units)
        self.low_sum = self.high_sum - float(self.counts.sum())

    def at(self, step_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lowest, highest) units per class at each step time: two [times, classes]."""
        spare = step_s[:, None] - self.fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            cap = np.where(self.per_unit > 0, spare / self.per_unit - 1.0, np.inf)
            need = np.where(
                self.ring > 0, (self.total_tokens - spare / self.ring) / self.block, -np.inf
            )
        cap = np.where(spare < 0, -np.inf, cap)
        high = np.minimum.reduceat(cap, self.starts, axis=1)
        low = np.maximum(np.maximum.reduceat(need, self.starts, axis=1), self.smallest)
        return low, high

    def feasible(self, step_s: np.ndarray) -> np.ndarray:
        low, high = self.at(step_s)
        return (
            np.all(low <= high, axis=1)
            & (np.minimum(high, 1e300) @ self.counts >= self.low_sum)
            & (low @ self.counts <= self.high_sum)
        )

    def least_step_s(self) -> float | None:
        """The least T at which the ranges cover the sequence (None: no T does). Most often
        the busy rows alone set it: their root (`_busy_root`) is tried first; where the
        ring's rows bind, their root (`_ring_root`) next; the bisection is the fallback."""
        busy_s = _busy_root(self.counts, self.smallest, self.times, self.low_sum)
        for root_s in (busy_s, self._ring_root(busy_s)):
            if root_s is not None:
                guess_s = root_s * (1 + RELATIVE_TOLERANCE)
                if self.feasible(np.array([guess_s]))[0]:
                    return guess_s
        return self._bisected_s()

    def _ring_root(self, floor_s: float) -> float | None:
        """The least T from `floor_s` (the busy rows' root) at which the ring's rows hold
        too (None where none is found: the bisection decides). Each member n with ring
        traffic needs at least (tokens - (T - fixed_n) / ring_n) / block units in its
        class, a line falling in T. Every member m of that class must compute them: m's
        rising cap crosses that line at a T worked out pair by pair (`_pair_root`). And
        the classes' least units must fit the sequence: a sum over classes of maxima of
        falling lines, convex in T, which Newton steps from below reach without passing
        (any line of each maximum lies under it)."""
        ring = self.ring > 0
        if not ring.any():
            return None
        owner = np.repeat(np.arange(len(self.counts)), np.diff([*self.starts, len(self.ring)]))
        per_ring_s = np.where(ring, self.ring, 1.0) * self.block  # seconds per unit
        falls = np.where(ring, 1.0 / per_ring_s, 0.0)  # units per second
        step_s = max(floor_s, self._pair_root(owner, ring))
        for _ in range(_NEWTON_STEPS):
            ring_units = self.total_tokens / self.block - (step_s - self.fixed) * falls
            need = np.where(ring, ring_units, -np.inf)
            most = np.maximum.reduceat(need, self.starts)
            excess = float(np.maximum(most, self.smallest) @ self.counts) - self.high_sum
            if excess <= self.high_sum * RELATIVE_TOLERANCE:
                return step_s  # the caller's check, a hair above, confirms it
            # each class's flattest line at its maximum (none where its size binds)
            active = (need == most[owner]) & (most[owner] > self.smallest[owner])
            flattest = np.full(len(self.counts), np.inf)
            np.minimum.at(flattest, owner[active], falls[active])
            slope = float(np.where(np.isfinite(flattest), flattest, 0.0) @ self.counts)
            if slope <= 0:
                return None
            step_s += excess / slope
        return None

    def _pair_root(self, owner: np.ndarray, ring: np.ndarray) -> float:
        """The least T at which every member's cap in a class reaches every ring need of
        that class: (T - fixed_m) / per_unit_m - 1 >= (tokens - (T - fixed_n) / ring_n) /
        block for each pair (m, n) of one class."""
        busy = self.per_unit > 0
        m = np.flatnonzero(busy)
        n = np.flatnonzero(ring)
        same = owner[m][:, None] == owner[n][None, :]
        if not same.any():
            return 0.0
        rise = 1.0 / self.per_unit[m][:, None]
        fall = 1.0 / (self.ring[n][None, :] * self.block)
        reach = self.total_tokens / self.block + 1.0 + self.fixed[m][:, None] * rise
        reach = reach + self.fixed[n][None, :] * fall
        return float(np.max(np.where(same, reach / (rise + fall), -np.inf)))

    def _bisected_s(self) -> float | None:
        """The least T by bisection: doublings from the largest fixed seconds to the first
        T that fits, then rounds of POINTS step times each."""
        floor_s = float(np.max(self.fixed)) if len(self.fixed) else 0.0
        start_s = max(floor_s, 1e-12)
        doublings = floor_s + start_s * (2.0 ** np.arange(_DOUBLINGS) - 1.0)
        fits = np.flatnonzero(self.feasible(doublings))
        if not len(fits):
            return None
        if fits[0] == 0:
            return float(doublings[0])
        low_s, high_s = doublings[fits[0] - 1], doublings[fits[0]]
        for _ in range(ROUNDS):
            if high_s - low_s <= RELATIVE_TOLERANCE * high_s:
                break
            points = np.linspace(low_s, high_s, POINTS + 2)[1:-1]
            fits = self.feasible(points)
            first = int(np.argmax(fits)) if fits.any() else len(points)
            low_s = points[first - 1] if first else low_s
            high_s = points[first] if first < len(points) else high_s
        return float(high_s)

    def units_at(self, step_s: float) -> np.ndarray | None:
        """Units inside the ranges at `step_s` that cover the sequence with the least total:
        each class at its lowest, raised in proportion toward its highest as far as the
        length needs."""
        low, high = (row[0] for row in self.at(np.array([step_s])))
        if np.any(low > high) or not np.all(np.isfinite(low)):
            return None
        low_total = float(low @ self.counts)
        if low_total >= self.low_sum:
            return low
        room = np.minimum(high, 1e300) - low
        extra = float(room @ self.counts)
        if extra <= 0:
            return None
        return low + room * min(1.0, (self.low_sum - low_total) / extra)


def _memory_fits(model, units: np.ndarray) -> bool:
    """Whether the memory rows hold at `units` with the largest block as small as they allow
    and every state-share column at most what its rows leave (summing to at least one)."""
    largest = float(np.max(units)) + 1.0 if model.multi_group else 0.0
    share_room: dict[int, float] = {}
    for c, kinds in enumerate(model.kinds):
        for member, (phases, capacity) in enumerate(model.memory[c]):
            if kinds.index(kinds[member]) != member:
                continue  # an identical member has these rows already
            limit = float(memory_limit_bytes(int(capacity)))
            room = 1.0  # a share's upper bound
            for (per_unit, per_largest, per_share), constant in phases:
                spare = limit - constant - per_unit * units[c] - per_largest * largest
                if per_share < 0 or per_largest < 0:
                    return False  # not a shape this shortcut reasons about: ask the LP
                if per_share == 0:
                    if spare < 0:
                        return False
                    continue
                room = min(room, spare / per_share)
            if room < 0:
                return False
            share_room[int(model.f[c][member])] = room
    multiplicity: dict[int, float] = {}
    for cls, columns in zip(model.classes, model.f):
        for column in columns:
            multiplicity[int(column)] = multiplicity.get(int(column), 0.0) + len(cls.positions)
    return sum(share_room[col] * n for col, n in multiplicity.items()) >= 1.0


def memory_rules_out(model) -> bool:
    """Whether the memory rows alone leave the LP no point, by a relaxation of them: each
    class's units are capped by its members' rows with no state share, the largest block B
    at least one above both the class's own units and the least largest class that covers
    the sequence under those caps (the caps and that least block tighten each other a few
    rounds), and no class above the block every member can hold; then the model states
    (shares summing to one over all ranks) cost units (`_share_loss`). If the units left
    fall short of the sequence, or a class cannot hold its size, no split fits: a True is
    certain, and the LP answers the rest. (At 1M tokens without activation checkpointing
    it rules out every grouping of 16 GPUs of 8 types before any LP: 8 programs of about
    1.5 ms each; of 1,680 programs of random groupings, 702 of the 706 infeasible ones.)"""
    rows = _KindRows.of(model)
    if rows is None:
        return False  # a negative coefficient: not a shape this test reasons about
    counts = np.array([len(cls.positions) for cls in model.classes], dtype=float)
    least = np.array([float(cls.size - 1) for cls in model.classes])  # with a leftover unit
    need = model.total_units - float(counts.sum())
    least_block = 0.0
    for _ in range(_BLOCK_ROUNDS):
        caps = rows.caps(least_block)
        if np.any(caps < least - 1e-9 * (least + 1)) or counts @ caps < need * (1 - 1e-9):
            return True
        if not model.multi_group:
            break
        least_block = max(least_block, _least_largest(caps, counts, need) + 1.0)
    if not np.all(np.isfinite(caps)):
        return False
    loss = rows.share_loss(caps, least_block, counts)
    return bool(float(counts @ caps) - loss < need * (1 - 1e-9))


_BLOCK_ROUNDS = 3


class _KindRows:
    """Every member kind's memory rows, each phase row twice as a linear cap on its class's
    units u: with B at a least block (set per call) and with B at u + 1 (B is at least
    both); [kind, 2 x phase] arrays in bytes, each kind's class (kinds come class by
    class) and the ranks that share its column."""

    def __init__(self, model, kinds: list, owners: list[int], ranks: list[int]) -> None:
        per_unit, per_largest, per_share, room = (np.array(column) for column in zip(*kinds))
        per_largest = per_largest * float(model.multi_group)
        self.per_unit = np.hstack([per_unit, per_unit + per_largest])
        self.room = np.hstack([room, room - per_largest])  # B's term of the first: per call
        self.per_block = np.hstack([per_largest, np.zeros_like(per_largest)])
        self.per_share = np.hstack([per_share, per_share])
        self.owner = np.array(owners)
        self.first_kind = _run_starts(self.owner)
        self.ranks = np.array(ranks, dtype=float)
        least = np.array([float(cls.size - 1) for cls in model.classes])[self.owner]
        with np.errstate(divide="ignore", invalid="ignore"):  # the largest block held
            held = (room - per_unit * least[:, None]) / per_largest
        self.largest = float(np.min(np.where(per_largest > 0, held, np.inf)))

    @classmethod
    def of(cls, model) -> _KindRows | None:
        """The rows of `model`'s member kinds; None where a coefficient is negative."""
        kinds, owners, ranks = [], [], []
        for c, members in enumerate(model.kind_members):
            kind_of = model.kinds[c]
            for member in members:
                phases, capacity = model.memory[c][member]
                rows = _kind_rows(model.problem, phases, capacity)
                if rows is None:
                    return None
                kinds.append(rows)
                owners.append(c)
                ranks.append(len(model.classes[c].positions) * kind_of.count(kind_of[member]))
        return cls(model, kinds, owners, ranks)

    def caps(self, least_block: float) -> np.ndarray:
        """[class] the most units its members hold with no state share, and no more than
        one below the largest block every member can hold at its class's size (-inf: a
        row no units satisfy)."""
        room = self.room - self.per_block * least_block
        with np.errstate(divide="ignore", invalid="ignore"):
            kind_caps = np.where(self.per_unit > 0, room / self.per_unit, np.inf)
        kind_caps[(self.per_unit <= 0) & (room < 0)] = -np.inf
        caps = np.minimum.reduceat(kind_caps.min(axis=1), self.first_kind)
        return np.minimum(caps, self.largest - 1.0)

    def share_loss(self, caps: np.ndarray, least_block: float, counts: np.ndarray) -> float:
        """A lower bound of the units the model states cost the classes at `caps`: a
        member column takes shares for free until one of its rows would bind below the
        class's cap, past that each share costs the class units at that row's rate (a
        class's members losing together: the class takes shares at their combined rate),
        and the states (one in all) fill the free room first, then go where they cost the
        fewest units."""
        takes = self.per_share > 0
        if not np.all(np.any(takes, axis=1)):
            return 0.0  # a column that holds any share for free
        room = self.room - self.per_block * least_block
        spare = room - self.per_unit * caps[self.owner][:, None]  # bytes under the caps
        with np.errstate(divide="ignore", invalid="ignore"):
            free = np.where(takes, spare / self.per_share, np.inf)
        row = np.argmin(free, axis=1)  # the row that binds first as shares grow
        kinds = np.arange(len(row))
        free_shares = float(self.ranks @ np.maximum(free[kinds, row], 0.0))
        # shares per unit lost past the free ones (none fit where the row has no u)
        rate = self.per_unit[kinds, row] / self.per_share[kinds, row]
        class_rate = np.add.reduceat(self.ranks * rate, self.first_kind) / counts
        if free_shares >= 1.0 or not np.any(class_rate > 0):
            return 0.0
        return (1.0 - free_shares) / float(class_rate.max())


def _kind_rows(problem, phases, capacity: float):
    """(per unit, per largest-block unit, per share, limit - constant) of a member kind's
    phase rows, once per search (its phases are kept once per search, so their identity
    names them); None where a coefficient is negative."""

    def rows():
        coefficients, constants = phase_arrays(problem, phases)
        if np.any(coefficients < 0):
            return None
        return (*coefficients.T, memory_limit_bytes(int(capacity)) - constants)

    return problem.memo(("kind rows", id(phases), capacity), rows)


def _least_largest(caps: np.ndarray, counts: np.ndarray, need: float) -> float:
    """The least t with sum of count x min(cap, t) >= need: no split under `caps` covers
    the sequence with every class below t units, so the largest block holds t + 1."""
    order = np.argsort(caps)
    below = 0.0  # units of the classes capped under t
    remaining = float(counts.sum())  # classes at t
    for i in order:
        t = (need - below) / remaining
        if t <= caps[i]:
            return t
        below += counts[i] * caps[i]
        remaining -= counts[i]
    return float(caps[order[-1]])


def busy_bound_s(model_classes, times, total_units: int) -> float:
    """A lower bound of the LP's step time from the time rows of busy work alone (no ring,
    no memory rows): the least T at which every class can take its size and the classes'
    units, each at most what its slowest member computes by T less the leftover unit a group
    may hold, cover the sequence."""
    counts = np.array([len(cls.positions) for cls in model_classes], dtype=float)
    least = np.array([float(cls.size - 1) for cls in model_classes])  # with a leftover unit
    return _busy_root(counts, least, times, float(total_units) - float(counts.sum()))


def _busy_root(counts: np.ndarray, least: np.ndarray, times, need: float) -> float:
    """The least T with every member's T >= its fixed seconds plus its busy seconds at the
    class's size plus the leftover unit, and sum over classes of count x units (each class
    at most what its slowest member computes by T, less the leftover unit) >= `need`. The
    units covered by T are a sum of minima of lines, concave and increasing in T, so Newton
    steps from below (any line of each class's minimum: each lies above it) reach that T
    without passing it."""
    per_unit = np.concatenate([t[0] for t in times])
    fixed = np.concatenate([t[1] for t in times])
    sizes = [len(t[0]) for t in times]
    owner = np.repeat(np.arange(len(times)), sizes)
    step_s = max(float(np.max(fixed)), float(np.max(per_unit * (least[owner] + 1) + fixed)))
    working = per_unit > 0
    if not np.logical_or.reduceat(working, np.cumsum([0, *sizes[:-1]])).all():
        return step_s  # a class with no busy work can take any units
    a, b, owner = per_unit[working], fixed[working], owner[working]
    starts = _run_starts(owner)
    for _ in range(_NEWTON_STEPS):
        caps = (step_s - b) / a - 1.0
        lowest = np.minimum.reduceat(caps, starts)
        covered = float(counts @ lowest)
        if covered >= need * (1 - 1e-12):
            break
        at_minimum = np.flatnonzero(caps == lowest[owner])
        at_owner = owner[at_minimum]  # sorted: the first of each class starts a run
        first = _run_starts(at_owner)
        slope = float(counts @ (1.0 / a[at_minimum[first]]))
        step_s += (need - covered) / slope
    return step_s


def _run_starts(values: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values starts in `values` (sorted or grouped)."""
    changes = np.empty(len(values), dtype=bool)
    changes[:1] = True
    np.not_equal(values[1:], values[:-1], out=changes[1:])
    return np.flatnonzero(changes)
