"""Exact local stage: a MILP (scipy `milp`, HiGHS) for one grouping and ring order.

Integer variables: each group's segment length and each rank's token share, in chunk quanta
(group g's segment is 2·q·u_g tokens, rank r owns 2·q·t_r of them, q per zigzag chunk);
continuous: each rank's share f_r of the sharded model states, the step time T, and the
largest ring block B. Heads are fixed per group beforehand (`greedy.split_heads`, exact for
the time objective). Minimize T subject to

    T >= att_r·u_g + lin_r·t_r + a2a_r·u_g          for every rank r in group g
    Σ u_g = S / 2q,   Σ_{r in g} t_r = u_g,   Σ f_r = 1,   u_g <= B
    memory_r(t_r, u_g, B, f_r) <= 95 % of capacity   (every phase of the memory model)

The time coefficients are the simulator's own per-rank times divided by the loads that drive
them (a secant through zero at the current operating point), so the MILP and the simulator
agree on what each device does; `solve_local` re-linearizes at the MILP's answer and solves
again. The memory model is affine in the loads (`costmodel.memory.rank_memory`), so its
coefficients are exact. The simulator then scores the result exactly, ring waits included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from hexiseq.costmodel import memory_limit_bytes, simulate_step
from hexiseq.costmodel.memory import RankShape, rank_memory
from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout
from hexiseq.search._evaluate import Problem

Group = tuple[int, ...]
RELINEARIZATIONS = 2
MILP_TIME_LIMIT_S = 2.0
MILP_RELATIVE_GAP = 1e-4
TIME_TOLERANCE = 1e-4  # the headroom stage may give up this much step time


@dataclass(frozen=True)
class LocalSolution:
    """The MILP's answer: loads in quanta and state shares, or what memory is missing."""

    layout: AttentionLayout | None
    state_fractions: tuple[float, ...] = ()
    missing_bytes: dict[int, int] | None = None


def solve_local(
    problem: Problem, groups: list[Group], heads: list[list[int]], quantum: int
) -> LocalSolution:
    """Best segment lengths, token shares and state shares for fixed groups and heads."""
    units = problem.train.seq_len // (2 * quantum)
    loads = _even_loads(groups, units)
    solution = None
    for _ in range(RELINEARIZATIONS):
        layout = _layout(problem, groups, heads, quantum, loads)
        times = _time_coefficients(problem, layout, groups, loads)
        solution = _solve(problem, groups, layout, quantum, times)
        if solution.layout is None:
            return solution
        loads = _loads_of(solution.layout, groups, quantum)
    return solution


def _even_loads(groups: list[Group], units: int) -> tuple[list[int], list[list[int]]]:
    segment_units = apportion(units, [len(g) for g in groups], minimum=1)
    token_units = [apportion(u, [1.0] * len(g), minimum=1) for u, g in zip(segment_units, groups)]
    return segment_units, token_units


def _layout(problem, groups, heads, quantum, loads) -> AttentionLayout:
    segment_units, token_units = loads
    model = problem.model
    return build_zigzag_layout(
        problem.train.seq_len,
        model.heads,
        model.kv_heads,
        groups,
        [2 * quantum * u for u in segment_units],
        token_units,
        heads,
        chunk_quantum=quantum,
    )


def _loads_of(layout: AttentionLayout, groups: list[Group], quantum: int):
    segment_units = [layout.segment_length(g) // (2 * quantum) for g in range(len(groups))]
    token_units = [[layout.num_tokens(r) // (2 * quantum) for r in group] for group in groups]
    return segment_units, token_units


@dataclass(frozen=True)
class _Times:
    """Seconds per quantum of load, per rank: attention and all-to-all per segment unit,
    linear work per token unit."""

    per_segment: np.ndarray
    per_token: np.ndarray


def _time_coefficients(problem, layout, groups, loads) -> _Times:
    prediction = simulate_step(problem.cluster, problem.model, problem.train, layout, problem.cost)
    segment_units, token_units = loads
    world = layout.world_size
    per_segment, per_token = np.zeros(world), np.zeros(world)
    for position, group in enumerate(groups):
        for index, rank in enumerate(group):
            part = prediction.rank_times[rank]
            per_segment[rank] = (part.attention_s + part.all_to_all_s) / segment_units[position]
            per_token[rank] = part.linear_s / token_units[position][index]
    return _Times(per_segment, per_token)


class _Index:
    """Column of each variable: u (groups), t (ranks), f (ranks), B, T, and the largest
    memory utilization (used / capacity) over all ranks."""

    def __init__(self, group_count: int, world: int) -> None:
        self.u = np.arange(group_count)
        self.t = group_count + np.arange(world)
        self.f = group_count + world + np.arange(world)
        self.largest = group_count + 2 * world
        self.step = self.largest + 1
        self.utilization = self.step + 1
        self.size = self.utilization + 1


def _solve(problem, groups, layout, quantum, times: _Times) -> LocalSolution:
    """Two MILPs: the shortest step time T*, then, among plans within a hair of T*, the one
    with the most memory headroom on its fullest device (states go where memory is free)."""
    index = _Index(len(groups), layout.world_size)
    rows = _Rows(index.size)
    _time_rows(rows, index, groups, times)
    _balance_rows(rows, index, groups, problem.train.seq_len // (2 * quantum))
    _twin_rows(rows, index, problem, groups)
    _memory_rows(rows, index, problem, layout, groups, quantum)
    fastest = _run_milp(_unit_objective(index, index.step), rows, index, groups)
    if fastest is None:
        return LocalSolution(None, missing_bytes=_missing_memory(problem, layout, groups, quantum))
    rows.add({index.step: 1.0}, -np.inf, fastest[index.step] * (1 + TIME_TOLERANCE))
    roomiest = _run_milp(_unit_objective(index, index.utilization), rows, index, groups)
    return _solution(
        problem, groups, layout, quantum, index, roomiest if roomiest is not None else fastest
    )


def _unit_objective(index: _Index, column: int) -> np.ndarray:
    objective = np.zeros(index.size)
    objective[column] = 1.0
    return objective


def _twin_rows(rows: _Rows, index: _Index, problem, groups) -> None:
    """Members of a group on identical devices get token shares within one quantum of each
    other (without this the MILP may leave the off-critical shares anywhere)."""
    devices = problem.cluster.devices
    for group in groups:
        for a, b in zip(group, group[1:]):
            same = (devices[a].gpu, devices[a].emulation_slowdown) == (
                devices[b].gpu,
                devices[b].emulation_slowdown,
            )
            if same:
                rows.add({int(index.t[a]): 1.0, int(index.t[b]): -1.0}, -1.0, 1.0)


class _Rows:
    """Sparse constraint rows lower <= A x <= upper, built one at a time."""

    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.entries: list[dict[int, float]] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, coefficients: dict[int, float], lower: float, upper: float) -> None:
        self.entries.append(coefficients)
        self.lower.append(lower)
        self.upper.append(upper)

    def constraint(self) -> LinearConstraint:
        matrix = lil_matrix((len(self.entries), self.columns))
        for row, coefficients in enumerate(self.entries):
            for column, value in coefficients.items():
                matrix[row, column] = value
        return LinearConstraint(matrix.tocsr(), self.lower, self.upper)


def _time_rows(rows: _Rows, index: _Index, groups, times: _Times) -> None:
    for position, group in enumerate(groups):
        for rank in group:
            coefficients = {
                int(index.u[position]): times.per_segment[rank],
                int(index.t[rank]): times.per_token[rank],
                index.step: -1.0,
            }
            rows.add(coefficients, -np.inf, 0.0)


def _balance_rows(rows: _Rows, index: _Index, groups, total_units: int) -> None:
    rows.add({int(c): 1.0 for c in index.u}, total_units, total_units)
    rows.add({int(c): 1.0 for c in index.f}, 1.0, 1.0)
    for position, group in enumerate(groups):
        coefficients = {int(index.t[r]): 1.0 for r in group}
        coefficients[int(index.u[position])] = -1.0
        rows.add(coefficients, 0.0, 0.0)
        if len(groups) > 1:
            rows.add({int(index.u[position]): 1.0, index.largest: -1.0}, -np.inf, 0.0)


def _memory_rows(rows: _Rows, index: _Index, problem, layout, groups, quantum: int) -> None:
    for position, group in enumerate(groups):
        for rank in group:
            for coefficients, constant in _memory_phases(
                problem, layout, rank, quantum, len(groups)
            ):
                # Rows in fractions of the device's capacity: well scaled next to seconds.
                capacity = float(problem.cluster.gpu(rank).memory_bytes)
                columns = {
                    int(index.t[rank]): coefficients[0] / capacity,
                    int(index.u[position]): coefficients[1] / capacity,
                    index.largest: coefficients[2] / capacity,
                    int(index.f[rank]): coefficients[3] / capacity,
                }
                limit = (memory_limit_bytes(int(capacity)) - constant) / capacity
                rows.add(columns, -np.inf, limit)
                rows.add({**columns, index.utilization: -1.0}, -np.inf, -constant / capacity)


def _memory_phases(problem, layout, rank: int, quantum: int, group_count: int):
    """Each phase of the peak (persistent + MLP phase, attention phase, logits) as an affine
    function of (t_r, u_g, B, f_r): coefficients and constant, by exact finite differences."""
    low, high = layout.kv_head_range(rank)
    is_cpu = problem.cluster.devices[rank].gpu == "cpu"
    block = 2 * quantum

    def phases(t: int, u: int, largest: int, fraction: float) -> np.ndarray:
        shape = RankShape(
            t * block,
            u * block,
            layout.num_heads_of(rank),
            high - low,
            largest * block if group_count > 1 else 0,
            is_cpu,
        )
        m = rank_memory(problem.model, problem.train, shape, fraction)
        persistent = m.model_states + m.sharding_buffers + m.checkpoints + m.reserve
        mlp = m.layer_activations + m.mlp_backward_transients
        attention = m.layer_activations - m.mlp_activations + m.attention_backward_transients
        return persistent + np.array([mlp, attention + m.ring_buffers, m.logits], dtype=float)

    base = phases(0, 0, 0, 0.0)
    slopes = [
        phases(1, 0, 0, 0.0) - base,
        phases(0, 1, 0, 0.0) - base,
        phases(0, 0, 1, 0.0) - base,
    ]
    state_slope = float(problem.model.params * problem.train.bytes_per_param_state)
    return [((slopes[0][p], slopes[1][p], slopes[2][p], state_slope), base[p]) for p in range(3)]


def _run_milp(objective, rows: _Rows, index: _Index, groups):
    lower = np.zeros(index.size)
    upper = np.full(index.size, np.inf)
    integrality = np.zeros(index.size)
    for position, group in enumerate(groups):
        lower[index.u[position]] = len(group)
        for rank in group:
            lower[index.t[rank]] = 1
    integrality[index.u] = 1
    integrality[index.t] = 1
    upper[index.f] = 1.0
    result = milp(
        objective,
        constraints=rows.constraint(),
        bounds=Bounds(lower, upper),
        integrality=integrality,
        options={"time_limit": MILP_TIME_LIMIT_S, "mip_rel_gap": MILP_RELATIVE_GAP},
    )
    return result.x if result.x is not None else None


def _solution(problem, groups, layout, quantum, index: _Index, x: np.ndarray) -> LocalSolution:
    segment_units = [int(round(x[c])) for c in index.u]
    token_units = [[int(round(x[index.t[r]])) for r in group] for group in groups]
    heads = [[layout.num_heads_of(r) for r in group] for group in groups]
    solved = _layout(problem, groups, heads, quantum, (segment_units, token_units))
    fractions = np.clip(x[index.f], 0.0, None)
    return LocalSolution(solved, tuple(float(v) for v in fractions / fractions.sum()))


def _missing_memory(problem, layout, groups, quantum: int) -> dict[int, int]:
    """Bytes each rank lacks in the least-short split: the same MILP with a slack variable on
    every memory row, minimizing the total slack."""
    world, group_count = layout.world_size, len(groups)
    index = _Index(group_count, world)
    slack_start = index.size
    rows = _Rows(index.size + world)
    _balance_rows(rows, index, groups, problem.train.seq_len // (2 * quantum))
    before = len(rows.entries)
    _memory_rows(rows, index, problem, layout, groups, quantum)
    for row in range(before, len(rows.entries)):
        rank = _rank_of_memory_row(row - before, groups)
        if index.utilization not in rows.entries[row]:  # a limit row, not a utilization row
            rows.entries[row][slack_start + rank] = -1.0
    objective = np.zeros(index.size + world)
    objective[slack_start:] = 1.0
    lower, upper = np.zeros(index.size + world), np.full(index.size + world, np.inf)
    upper[index.f] = 1.0
    for position, group in enumerate(groups):
        lower[index.u[position]] = len(group)
        lower[index.t[list(group)]] = 1
    result = milp(objective, constraints=rows.constraint(), bounds=Bounds(lower, upper))
    slack = result.x[slack_start:] if result.x is not None else np.zeros(world)
    capacity = [problem.cluster.gpu(rank).memory_bytes for rank in range(world)]
    missing = {rank: int(np.ceil(v * capacity[rank])) for rank, v in enumerate(slack)}
    return {rank: b for rank, b in missing.items() if b > 0}


def _rank_of_memory_row(row: int, groups) -> int:
    ordered = [rank for group in groups for rank in group]
    return ordered[row // 6]  # three phases, each a limit row and a utilization row
