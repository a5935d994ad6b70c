"""The v0 planner: heads, tokens and segments in proportion to predicted speed, under memory.

For each grouping of ranks into HP groups (inside nodes, in node order around the ring):
1. heads inside a group in proportion to each member's attention speed;
2. segment lengths across groups in proportion to each group's attention capacity and token
   shares inside a group in proportion to each member's matmul speed;
3. model states sharded in proportion to the memory each rank has left;
4. repeat from the simulator's per-rank busy times (a rank's time is close to linear in its
   load, so load / time is its speed), and take load off ranks that run out of memory.
The simulator scores every candidate; the best feasible one wins. The real hierarchy
(greedy global + MILP + Optuna) replaces this in the search issue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hexiseq.costmodel import estimate_memory
from hexiseq.search._evaluate import Problem, evaluate, fit_state_fractions, out_of_memory

from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout
from hexiseq.plan import InfeasiblePlan, Plan

BALANCE_ITERATIONS = 8
UNIT_PAIRS = 1e9  # any size: the datasheet model is linear, a fitted one is evaluated at scale
UNIT_FLOPS = 1e12


@dataclass
class _Weights:
    heads: list[list[int]]
    segments: list[float]
    tokens: list[list[float]]


def node_groupings(problem: Problem) -> dict[int, list[tuple[int, ...]]]:
    """For each HP degree d: groups of d consecutive ranks inside each node (a node's last
    group is smaller when d does not divide its size), nodes in file order around the ring."""
    nodes: dict[str, list[int]] = {}
    for device in problem.cluster.devices:
        nodes.setdefault(device.node, []).append(device.rank)
    largest = min(max(len(ranks) for ranks in nodes.values()), problem.model.heads)
    return {
        degree: [
            tuple(ranks[i : i + degree])
            for ranks in nodes.values()
            for i in range(0, len(ranks), degree)
        ]
        for degree in range(1, largest + 1)
    }


def chunk_quantum(seq_len: int, world_size: int) -> int:
    """Tokens per zigzag quantum: a power of two dividing seq_len / 2, at most 256, small
    enough that every rank can get several quanta in each of its two chunks."""
    quantum = 1
    while (
        quantum < 256
        and seq_len % (4 * quantum) == 0
        and seq_len // (4 * quantum) >= 8 * world_size
    ):
        quantum *= 2
    return quantum


def plan_for_grouping(
    problem: Problem, groups: list[tuple[int, ...]], name: str
) -> Plan | InfeasiblePlan:
    """Balance one grouping by speed and memory; the best feasible candidate or why none is."""
    quantum = chunk_quantum(problem.train.seq_len, problem.cluster.world_size)
    weights = _initial_weights(problem, groups)
    best: Plan | None = None
    closest: InfeasiblePlan | None = None
    for _ in range(BALANCE_ITERATIONS):
        layout = _layout(problem, groups, weights, quantum)
        if layout is None:
            return InfeasiblePlan(name, "groups too many or too large for this sequence length")
        fractions, missing = fit_state_fractions(problem, layout)
        knobs = _knobs(groups, quantum, problem)
        if missing:
            candidate = out_of_memory(name, missing)
            if closest is None or candidate.total_missing_bytes < closest.total_missing_bytes:
                closest = candidate
            _relieve_memory(problem, layout, fractions, missing, weights, groups)
            continue
        plan = evaluate(problem, layout, fractions, name, knobs)
        if isinstance(plan, InfeasiblePlan):
            closest = plan
            continue
        if best is None or plan.predicted.tokens_per_s > best.predicted.tokens_per_s:
            best = plan
        _rebalance(plan, groups, weights)
    return best if best is not None else (closest or InfeasiblePlan(name, "no candidate"))


def _initial_weights(problem: Problem, groups: list[tuple[int, ...]]) -> _Weights:
    attention_speed = _attention_speeds(problem)
    linear_speed = _linear_speeds(problem)
    heads = [
        apportion(problem.model.heads, [attention_speed[r] for r in g], minimum=1) for g in groups
    ]
    capacity = [
        1.0 / max(h / attention_speed[r] for r, h in zip(g, hs)) for g, hs in zip(groups, heads)
    ]
    tokens = [[linear_speed[r] for r in g] for g in groups]
    return _Weights(heads, capacity, tokens)


def _attention_speeds(problem: Problem) -> list[float]:
    """Pairs per second per head of forward + backward (+ recompute) attention, per rank."""
    recompute = 1.0 if problem.train.activation_checkpointing else 0.0
    speeds = []
    for device in problem.cluster.devices:
        cost = problem.cost
        head_dim = problem.model.head_dim
        forward = cost.attention_time_s(device.gpu, UNIT_PAIRS, 1, head_dim, backward=False)
        backward = cost.attention_time_s(device.gpu, UNIT_PAIRS, 1, head_dim, backward=True)
        seconds = ((1 + recompute) * forward + backward) * device.emulation_slowdown
        speeds.append(UNIT_PAIRS / seconds)
    return speeds


def _linear_speeds(problem: Problem) -> list[float]:
    return [
        UNIT_FLOPS / (problem.cost.gemm_time_s(d.gpu, UNIT_FLOPS) * d.emulation_slowdown)
        for d in problem.cluster.devices
    ]


def _layout(
    problem: Problem, groups: list[tuple[int, ...]], weights: _Weights, quantum: int
) -> AttentionLayout | None:
    seq_len, model = problem.train.seq_len, problem.model
    needed = [2 * quantum * len(g) for g in groups]
    if sum(needed) > seq_len:
        return None
    lengths = _segment_lengths(seq_len, weights.segments, quantum, [len(g) for g in groups])
    return build_zigzag_layout(
        seq_len,
        model.heads,
        model.kv_heads,
        groups,
        lengths,
        weights.tokens,
        weights.heads,
        chunk_quantum=quantum,
    )


def _segment_lengths(
    seq_len: int, weights: Sequence[float], quantum: int, sizes: Sequence[int]
) -> list[int]:
    """Zigzag segment lengths by weight, each big enough for one quantum per member per chunk."""
    minimum_units = list(sizes)
    unit = 2 * quantum
    units = apportion(seq_len // unit, weights, minimum=0)
    short = [max(0, m - u) for m, u in zip(minimum_units, units)]
    while any(short):
        donor = max(range(len(units)), key=lambda g: units[g] - minimum_units[g])
        taker = short.index(max(short))
        units[donor] -= 1
        units[taker] += 1
        short = [max(0, m - u) for m, u in zip(minimum_units, units)]
    return [u * unit for u in units]


def _relieve_memory(problem, layout, fractions, missing, weights, groups) -> None:
    """Take tokens (and segment) off ranks that lack memory, in proportion to how much."""
    memory = estimate_memory(problem.cluster, problem.model, problem.train, layout, fractions)
    for position, group in enumerate(groups):
        for index, rank in enumerate(group):
            if rank not in missing:
                continue
            load = memory[rank].checkpoints + memory[rank].working_set_bytes
            factor = max(0.5, 1.0 - 1.2 * missing[rank] / max(load, 1))
            weights.tokens[position][index] *= factor
            weights.segments[position] *= factor ** (1.0 / len(group))


def _rebalance(plan: Plan, groups: list[tuple[int, ...]], weights: _Weights) -> None:
    """New weights = load / busy time: each rank's and each group's measured speed."""
    ranks = plan.predicted.ranks
    layout = plan.layout()
    for position, group in enumerate(groups):
        busy = max(ranks[r].busy_s - ranks[r].ring_exposed_comm_s for r in group)
        weights.segments[position] = layout.segment_length(position) / busy
        for index, rank in enumerate(group):
            linear = ranks[rank].linear_s
            weights.tokens[position][index] = layout.num_tokens(rank) / linear


def _knobs(groups, quantum, problem) -> dict:
    return {
        "planner": "v0 proportional",
        "hp_degrees": [len(g) for g in groups],
        "ring_order": "node order",
        "chunk_quantum": quantum,
        "activation_checkpointing": problem.train.activation_checkpointing,
        "state_sharding": "by free memory",
    }
