"""The v0 planner: heads, tokens and segments in proportion to predicted speed, under memory.

For each grouping of ranks into HP groups (inside nodes, in node order around the ring):
1. heads inside a group in proportion to each member's attention speed;
2. segment lengths across groups in proportion to each group's attention capacity and token
   shares inside a group in proportion to each member's matmul speed;
3. refine from the simulator: a rank's time is close to linear in its load, so load / busy
   time is its effective speed (links and waits included) — a few rounds of this;
4. model states sharded in proportion to the memory each rank has left; if the speed-balanced
   split does not fit, bisect between it and the even split (geometric blend of the weights)
   for the most asymmetric split that fits under 95 % of every device.
The simulator scores every candidate. The real hierarchy (greedy global + MILP + Optuna)
replaces this in the search issue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hexiseq.costmodel import simulate_step
from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem, evaluate, fit_state_fractions, out_of_memory

BALANCE_ROUNDS = 4
BISECTION_STEPS = 8
UNIT_PAIRS = 1e9  # any size: the datasheet model is linear, a fitted one is evaluated at scale
UNIT_FLOPS = 1e12

Groups = list[tuple[int, ...]]


@dataclass(frozen=True)
class Weights:
    """Relative loads: heads per member (integers), segment per group, tokens per member."""

    heads: tuple[tuple[int, ...], ...]
    segments: tuple[float, ...]
    tokens: tuple[tuple[float, ...], ...]


def node_groupings(problem: Problem) -> dict[int, Groups]:
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


def plan_for_grouping(problem: Problem, groups: Groups, name: str) -> Plan | InfeasiblePlan:
    """The fastest feasible plan found for one grouping, or why there is none."""
    quantum = chunk_quantum(problem.train.seq_len, problem.cluster.world_size)
    if sum(2 * quantum * len(g) for g in groups) > problem.train.seq_len:
        return InfeasiblePlan(name, f"{len(groups)} groups need more tokens than the sequence has")
    knobs = _knobs(groups, quantum, problem)
    candidates = [
        _layout(problem, groups, w, quantum) for w in _speed_rounds(problem, groups, quantum)
    ]
    scored = [_score(problem, layout, name, knobs) for layout in candidates]
    feasible = [plan for plan in scored if isinstance(plan, Plan)]
    if not feasible:
        fitted = _fit_memory(problem, groups, quantum, name, knobs)
        if fitted is None:
            return min(scored, key=lambda c: c.total_missing_bytes)
        feasible = [fitted]
    return max(feasible, key=lambda plan: plan.predicted.tokens_per_s)


def _score(
    problem: Problem, layout: AttentionLayout, name: str, knobs: dict
) -> Plan | InfeasiblePlan:
    fractions, missing = fit_state_fractions(problem, layout)
    if missing:
        return out_of_memory(name, missing)
    return evaluate(problem, layout, fractions, name, knobs)


def _speed_rounds(problem: Problem, groups: Groups, quantum: int) -> list[Weights]:
    """Speed-proportional weights, then rounds of simulator feedback (memory not considered)."""
    weights = [speed_weights(problem, groups)]
    for _ in range(BALANCE_ROUNDS - 1):
        layout = _layout(problem, groups, weights[-1], quantum)
        prediction = simulate_step(
            problem.cluster, problem.model, problem.train, layout, problem.cost
        )
        weights.append(_rebalanced(prediction, layout, groups, weights[-1]))
    return weights


def _fit_memory(
    problem: Problem, groups: Groups, quantum: int, name: str, knobs: dict
) -> Plan | None:
    """Bisect the blend between the even split (0) and the speed split (1) for the most
    asymmetric one that fits in memory; None when even the even split does not fit."""
    even, fast = even_weights(problem, groups), speed_weights(problem, groups)
    best = None
    low, high = 0.0, 1.0
    for step in range(BISECTION_STEPS + 1):
        blend = 0.0 if step == 0 else (low + high) / 2
        layout = _layout(problem, groups, _blend(even, fast, blend), quantum)
        plan = _score(problem, layout, name, {**knobs, "speed_blend": round(blend, 4)})
        if isinstance(plan, Plan):
            best, low = plan, blend
        elif step == 0:
            return None
        else:
            high = blend
    return best


def speed_weights(problem: Problem, groups: Groups) -> Weights:
    """Heads by attention speed, segments by group attention capacity, tokens by matmul speed."""
    attention_speed = _attention_speeds(problem)
    linear_speed = _linear_speeds(problem)
    heads = tuple(
        tuple(apportion(problem.model.heads, [attention_speed[r] for r in g], minimum=1))
        for g in groups
    )
    capacity = tuple(
        1.0 / max(h / attention_speed[r] for r, h in zip(g, hs)) for g, hs in zip(groups, heads)
    )
    tokens = tuple(tuple(linear_speed[r] for r in g) for g in groups)
    return Weights(heads, capacity, tokens)


def even_weights(problem: Problem, groups: Groups) -> Weights:
    """Equal tokens per rank (segments by group size) and heads as even as they divide."""
    heads = tuple(tuple(apportion(problem.model.heads, [1.0] * len(g), minimum=1)) for g in groups)
    return Weights(
        heads, tuple(float(len(g)) for g in groups), tuple((1.0,) * len(g) for g in groups)
    )


def _blend(even: Weights, fast: Weights, blend: float) -> Weights:
    """Geometric interpolation of the loads: even at 0, speed-proportional at 1."""

    def mix(a: float, b: float) -> float:
        return a ** (1 - blend) * b**blend

    segments = tuple(
        mix(a, b) for a, b in zip(_normalized(even.segments), _normalized(fast.segments))
    )
    tokens = tuple(
        tuple(mix(a, b) for a, b in zip(_normalized(e), _normalized(f)))
        for e, f in zip(even.tokens, fast.tokens)
    )
    return Weights(fast.heads if blend >= 0.5 else even.heads, segments, tokens)


def _normalized(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def _attention_speeds(problem: Problem) -> list[float]:
    """Pairs per second per head of forward + backward (+ recompute) attention, per rank."""
    recompute = 1.0 if problem.train.activation_checkpointing else 0.0
    head_dim = problem.model.head_dim
    speeds = []
    for device in problem.cluster.devices:
        forward = problem.cost.attention_time_s(
            device.gpu, UNIT_PAIRS, 1, head_dim, backward=False
        )
        backward = problem.cost.attention_time_s(
            device.gpu, UNIT_PAIRS, 1, head_dim, backward=True
        )
        seconds = ((1 + recompute) * forward + backward) * device.emulation_slowdown
        speeds.append(UNIT_PAIRS / seconds)
    return speeds


def _linear_speeds(problem: Problem) -> list[float]:
    return [
        UNIT_FLOPS / (problem.cost.gemm_time_s(d.gpu, UNIT_FLOPS) * d.emulation_slowdown)
        for d in problem.cluster.devices
    ]


def _layout(problem: Problem, groups: Groups, weights: Weights, quantum: int) -> AttentionLayout:
    seq_len, model = problem.train.seq_len, problem.model
    lengths = segment_lengths(seq_len, weights.segments, quantum, [len(g) for g in groups])
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


def segment_lengths(
    seq_len: int, weights: Sequence[float], quantum: int, sizes: Sequence[int]
) -> list[int]:
    """Zigzag segment lengths by weight, in units of 2 x quantum, with at least one quantum per
    member in each of the group's two chunks."""
    unit = 2 * quantum
    units = apportion(seq_len // unit, weights)
    while any(u < size for u, size in zip(units, sizes)):
        taker = min(range(len(units)), key=lambda g: units[g] - sizes[g])
        donor = max(range(len(units)), key=lambda g: units[g] - sizes[g])
        units[donor] -= 1
        units[taker] += 1
    return [u * unit for u in units]


def _rebalanced(prediction, layout: AttentionLayout, groups: Groups, weights: Weights) -> Weights:
    """New loads = load / busy time: each group's and each member's effective speed."""
    segments, tokens = [], []
    for position, group in enumerate(groups):
        times = [prediction.rank_times[r] for r in group]
        busy = max(t.linear_s + t.attention_s + t.all_to_all_s for t in times)
        segments.append(layout.segment_length(position) / busy)
        tokens.append(tuple(layout.num_tokens(r) / t.linear_s for r, t in zip(group, times)))
    return Weights(weights.heads, tuple(segments), tuple(tokens))


def _knobs(groups: Groups, quantum: int, problem: Problem) -> dict:
    return {
        "planner": "v0 proportional",
        "hp_degrees": [len(g) for g in groups],
        "ring_order": "node order",
        "chunk_quantum": quantum,
        "activation_checkpointing": problem.train.activation_checkpointing,
        "state_sharding": "by free memory",
    }
