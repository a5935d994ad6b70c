"""Exact local stage: a MILP (scipy `milp`, HiGHS) for one grouping and ring order.

Heads are fixed per group beforehand (`greedy.split_heads`, exact for the time objective).
Groups inside a node hold identical devices, and groups with the same devices, size and head
split are interchangeable to the linear model below, so the MILP has one integer per *class*
of such groups rather than one per rank: that keeps it at a few dozen variables for 1024
GPUs. Group g of class c gets u_c segment units of 2q tokens (q tokens per zigzag chunk),
split evenly between its identical members; member m of class c holds a share f_cm of the
sharded model states. Minimize the step time T subject to

    T >= seg_cm·u_c + tok_cm·u_c/size_c             for every class c and member m
    Σ_c n_c·u_c <= S/2q <= Σ_c n_c·(u_c + 1)         (leftover units go one per group)
    Σ_c n_c·Σ_m f_cm = 1,   u_c + 1 <= B
    memory_cm(tokens, segment, B, f_cm) <= 95 % of capacity (every phase of the memory model)

Memory rows count each group's possible extra unit and each member's rounding (+1 unit), so
the integer layout built afterwards still fits. The time coefficients are the simulator's own
per-rank times divided by the loads that drive them (a secant through zero at the current
operating point), so the MILP and the simulator agree on what each device does; `solve_local`
re-linearizes at the MILP's answer and solves again. The memory model is affine in the loads
(`costmodel.memory.rank_memory`), so its coefficients are exact. A second MILP keeps the step
time within `TIME_TOLERANCE` of the optimum and maximizes the fullest device's headroom. The
simulator then scores the result exactly, ring waits included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hexiseq.costmodel import memory_limit_bytes, simulate_step
from hexiseq.costmodel.memory import RankShape, rank_memory
from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout
from hexiseq.search._evaluate import Problem

Group = tuple[int, ...]
RELINEARIZATIONS = 2
MILP_TIME_LIMIT_S = 2.0
MILP_RELATIVE_GAP = 1e-6
TIME_TOLERANCE = 1e-4  # the headroom stage may give up this much step time


@dataclass(frozen=True)
class LocalSolution:
    """The MILP's answer as a layout and state shares, or the memory that is missing."""

    layout: AttentionLayout | None
    state_fractions: tuple[float, ...] = ()
    missing_bytes: dict[int, int] | None = None


@dataclass(frozen=True)
class _Class:
    """Interchangeable groups: their ring positions and their (shared) member heads."""

    positions: tuple[int, ...]
    size: int
    heads: tuple[int, ...]


def solve_local(
    problem: Problem, groups: list[Group], heads: list[list[int]], quantum: int
) -> LocalSolution:
    """Best segment lengths, token shares and state shares for fixed groups and heads."""
    classes = _classes(problem, groups, heads)
    total_units = problem.train.seq_len // (2 * quantum)
    units = _even_units(groups, total_units)
    solution = LocalSolution(None)
    for _ in range(RELINEARIZATIONS):
        layout = _layout(problem, groups, heads, quantum, units)
        model = _Model(problem, groups, classes, layout, quantum)
        found = model.solve(_time_coefficients(problem, layout, groups, classes, quantum))
        if found is None:
            return LocalSolution(None, missing_bytes=model.missing_bytes())
        class_units, fractions = found
        units = _group_units(classes, class_units, total_units, len(groups))
        solved = _layout(problem, groups, heads, quantum, units)
        solution = LocalSolution(solved, _rank_fractions(groups, classes, fractions))
    return solution


def _classes(problem: Problem, groups: list[Group], heads: list[list[int]]) -> list[_Class]:
    cluster = problem.cluster
    devices = cluster.devices
    members: dict[tuple, list[int]] = {}
    for position, group in enumerate(groups):
        # A class shares its first group's memory rows, so its groups must share capacities
        # too (a CPU test node may set its own `memory_GiB`), not just GPU type and speed.
        kind = tuple(
            (devices[r].gpu, devices[r].emulation_slowdown, cluster.gpu(r).memory_bytes)
            for r in group
        )
        members.setdefault((kind, tuple(heads[position])), []).append(position)
    return [
        _Class(tuple(positions), len(groups[positions[0]]), key[1])
        for key, positions in members.items()
    ]


def _even_units(groups: list[Group], total: int) -> list[int]:
    """Units in proportion to group size: the starting point of the first linearization."""
    units = apportion(total, [float(len(g)) for g in groups], minimum=1)
    if any(u < len(g) for u, g in zip(units, groups)):
        raise ValueError("the sequence is too short for one quantum per rank")
    return units


def _group_units(
    classes: list[_Class], class_units: list[int], total: int, count: int
) -> list[int]:
    """Each group its class's units; the leftover units one per group, largest classes first."""
    units = [0] * count
    for cls, value in zip(classes, class_units):
        for position in cls.positions:
            units[position] = value
    order = sorted(range(count), key=lambda p: (-units[p], p))
    for position in order[: total - sum(units)]:
        units[position] += 1
    return units


def _rank_fractions(groups, classes: list[_Class], fractions: list[list[float]]) -> tuple:
    shares = {}
    for cls, members in zip(classes, fractions):
        for position in cls.positions:
            for rank, share in zip(groups[position], members):
                shares[rank] = max(share, 0.0)
    total = sum(shares.values())
    return tuple(shares[r] / total for r in sorted(shares))


def _layout(problem, groups, heads, quantum, units: list[int]) -> AttentionLayout:
    model = problem.model
    return build_zigzag_layout(
        problem.train.seq_len,
        model.heads,
        model.kv_heads,
        groups,
        [2 * quantum * u for u in units],
        [[1.0] * len(g) for g in groups],
        heads,
        chunk_quantum=quantum,
    )


def _time_coefficients(problem, layout, groups, classes, quantum: int) -> list[np.ndarray]:
    """Per class, per member: busy seconds per segment unit of its group (the member's even
    token share moves with the segment). The slowest group of a class speaks for it."""
    prediction = simulate_step(problem.cluster, problem.model, problem.train, layout, problem.cost)
    coefficients = []
    for cls in classes:
        per_member = np.zeros(cls.size)
        for position in cls.positions:
            units = layout.segment_length(position) / (2 * quantum)
            for index, rank in enumerate(groups[position]):
                part = prediction.rank_times[rank]
                busy = (
                    part.attention_s
                    + part.all_to_all_s
                    + part.linear_s
                    + part.elementwise_s
                    + part.cast_s
                    + part.loss_s
                )  # fmt: skip  (the parts that grow with the tokens)
                per_member[index] = max(per_member[index], busy / units)
        coefficients.append(per_member)
    return coefficients


class _Model:
    """Builds and solves the class-level MILP; also its memory-slack variant."""

    def __init__(self, problem, groups, classes, layout, quantum) -> None:
        self.problem, self.groups, self.classes = problem, groups, classes
        self.layout, self.quantum = layout, quantum
        self.total_units = problem.train.seq_len // (2 * quantum)
        self.multi_group = len(groups) > 1
        self.memory = [self._member_memory(cls) for cls in classes]
        sizes = [len(c.heads) for c in classes]
        self.u = np.arange(len(classes))
        starts = len(classes) + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
        self.f = [start + np.arange(size) for start, size in zip(starts, sizes)]
        self.largest = len(classes) + sum(sizes)
        self.step = self.largest + 1
        self.utilization = self.step + 1
        self.size = self.utilization + 1

    def solve(self, times: list[np.ndarray]):
        """(units per class, state share per class member), or None if nothing fits."""
        rows = _Rows()
        self._time_rows(rows, times)
        self._sum_rows(rows)
        self._memory_rows(rows, slack=None)
        fastest = self._run(rows, self.step)
        if fastest is None:
            return None
        rows.add({self.step: 1.0}, -np.inf, fastest[self.step] * (1 + TIME_TOLERANCE))
        roomiest = self._run(rows, self.utilization)
        x = roomiest if roomiest is not None else fastest
        units = [int(round(x[c])) for c in self.u]
        return units, [list(x[columns]) for columns in self.f]

    def missing_bytes(self) -> dict[int, int]:
        """Bytes each rank lacks in the least-short split: slack on every memory row."""
        rows = _Rows()
        self._sum_rows(rows)
        slack = self._memory_rows(rows, slack=self.size)
        objective = np.zeros(self.size + len(slack))
        weights = [len(self.classes[c].positions) for c, _ in slack]
        objective[self.size :] = weights
        result = milp(
            objective,
            constraints=rows.constraint(self.size + len(slack)),
            bounds=self._bounds(extra=len(slack)),
            integrality=self._integrality(extra=len(slack)),
            options={"time_limit": MILP_TIME_LIMIT_S},
        )
        values = result.x[self.size :] if result.x is not None else np.zeros(len(slack))
        return self._missing_by_rank(slack, values)

    def _missing_by_rank(self, slack, values) -> dict[int, int]:
        missing = {}
        for (c, member), value in zip(slack, values):
            for position in self.classes[c].positions:
                rank = self.groups[position][member]
                lack = int(np.ceil(value * self.problem.cluster.gpu(rank).memory_bytes))
                if lack > 0:
                    missing[rank] = lack
        return missing

    def _time_rows(self, rows, times: list[np.ndarray]) -> None:
        for c, per_member in enumerate(times):
            for seconds_per_unit in per_member:
                rows.add({int(self.u[c]): seconds_per_unit, self.step: -1.0}, -np.inf, 0.0)

    def _sum_rows(self, rows) -> None:
        counts = [len(cls.positions) for cls in self.classes]
        units = {int(self.u[c]): float(n) for c, n in enumerate(counts)}
        rows.add(units, self.total_units - sum(counts), self.total_units)
        shares = {int(col): float(n) for n, cols in zip(counts, self.f) for col in cols}
        rows.add(shares, 1.0, 1.0)
        if self.multi_group:
            for c in self.u:
                rows.add({int(c): 1.0, self.largest: -1.0}, -np.inf, -1.0)

    def _memory_rows(self, rows, slack: int | None) -> list[tuple[int, int]]:
        """Memory limit rows (with a slack column each when `slack` gives the first one) and
        utilization rows, in fractions of the device's capacity (well scaled beside seconds)."""
        slacks = []
        for c, _cls in enumerate(self.classes):
            for member, (phases, capacity) in enumerate(self.memory[c]):
                if slack is not None:
                    slacks.append((c, member))
                for (per_unit, per_largest, per_share), constant in phases:
                    columns = {
                        int(self.u[c]): per_unit / capacity,
                        self.largest: per_largest / capacity,
                        int(self.f[c][member]): per_share / capacity,
                    }
                    limit = (memory_limit_bytes(int(capacity)) - constant) / capacity
                    if slack is not None:
                        rows.add({**columns, slack + len(slacks) - 1: -1.0}, -np.inf, limit)
                    else:
                        rows.add(columns, -np.inf, limit)
                        rows.add(
                            {**columns, self.utilization: -1.0}, -np.inf, -constant / capacity
                        )
        return slacks

    def _member_memory(self, cls: _Class):
        """For each member: each phase of its peak memory as an affine function of (u_c, B,
        f_cm), with the rounding margins folded into the constant, and its capacity."""
        position = cls.positions[0]
        members = []
        for rank in self.groups[position]:
            phases = _phases_of(
                self.problem, self.layout, rank, self.quantum, cls.size, self.multi_group
            )
            members.append((phases, float(self.problem.cluster.gpu(rank).memory_bytes)))
        return members

    def _run(self, rows, column: int):
        objective = np.zeros(self.size)
        objective[column] = 1.0
        result = milp(
            objective,
            constraints=rows.constraint(self.size),
            bounds=self._bounds(),
            integrality=self._integrality(),
            options={"time_limit": MILP_TIME_LIMIT_S, "mip_rel_gap": MILP_RELATIVE_GAP},
        )
        return result.x

    def _bounds(self, extra: int = 0) -> Bounds:
        lower = np.zeros(self.size + extra)
        upper = np.full(self.size + extra, np.inf)
        for c, cls in enumerate(self.classes):
            lower[self.u[c]] = cls.size
            upper[self.f[c]] = 1.0
        return Bounds(lower, upper)

    def _integrality(self, extra: int = 0) -> np.ndarray:
        integrality = np.zeros(self.size + extra)
        integrality[self.u] = 1
        return integrality


def _phases_of(problem, layout, rank: int, quantum: int, size: int, multi_group: bool):
    """Every phase of the memory model (`costmodel.memory.PHASES`, each with its reserve and
    fragmentation) as ((per segment unit, per largest-block unit, per state share), constant)
    in bytes, where a member holds (u + 1) / size + 1 token units at most and its segment is
    u + 1 units."""
    low, high = layout.kv_head_range(rank)
    gpu = problem.cluster.devices[rank].gpu
    calibration = problem.cost.memory_calibration(gpu)
    block = 2 * quantum

    def phases(tokens: float, segment: float, largest: float, share: float) -> np.ndarray:
        shape = RankShape(
            tokens * block,
            segment * block,
            layout.num_heads_of(rank),
            high - low,
            largest * block if multi_group else 0,
            gpu == "cpu",
        )
        m = rank_memory(problem.model, problem.train, shape, share, calibration)
        return np.array(list(m.phase_peaks().values()), dtype=float)

    base = phases(0, 0, 0, 0.0)
    per_token = phases(1, 0, 0, 0.0) - base
    per_segment = phases(0, 1, 0, 0.0) - base
    per_largest = phases(0, 0, 1, 0.0) - base
    per_share = phases(0, 0, 0, 1.0) - base
    per_unit = per_token / size + per_segment
    constant = base + per_token * (1.0 / size + 1.0) + per_segment * 1.0
    return [((per_unit[p], per_largest[p], per_share[p]), constant[p]) for p in range(len(base))]


class _Rows:
    """Sparse constraint rows lower <= A x <= upper, built one at a time."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.columns: list[int] = []
        self.values: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, coefficients: dict[int, float], lower: float, upper: float) -> None:
        row = len(self.lower)
        for column, value in coefficients.items():
            self.rows.append(row)
            self.columns.append(column)
            self.values.append(value)
        self.lower.append(lower)
        self.upper.append(upper)

    def constraint(self, columns: int) -> LinearConstraint:
        shape = (len(self.lower), columns)
        matrix = coo_matrix((self.values, (self.rows, self.columns)), shape=shape).tocsr()
        return LinearConstraint(matrix, self.lower, self.upper)
