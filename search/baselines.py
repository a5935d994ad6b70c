"""The homogeneous-style baselines hexiseq must beat, scored by the same simulator.

Each follows the rules of the systems it stands for: equal sequence shards, equal head
splits (the HP degree must divide the head count, as DeepSpeed-Ulysses and USP require) and
model states sharded evenly.
- ring-only: context parallelism over every rank, zigzag (ring-flash-attention, Megatron CP).
- ulysses-only: head parallelism over every rank (DeepSpeed-Ulysses).
- uniform-usp: the best feasible uniform HP x CP grid (USP, Fang & Zhao 2024), all grids tried.
"""

from __future__ import annotations

from dataclasses import replace

from hexiseq.costmodel.memory import even_state_fractions
from hexiseq.layout import build_uniform_layout
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem, evaluate


def uniform_grid_plan(problem: Problem, hp_degree: int, name: str) -> Plan | InfeasiblePlan:
    """Equal shards and heads with HP groups of `hp_degree` consecutive ranks, zigzag ring."""
    world, model = problem.cluster.world_size, problem.model
    if world % hp_degree:
        return InfeasiblePlan(name, f"HP degree {hp_degree} does not divide {world} devices")
    if model.heads % hp_degree:
        return InfeasiblePlan(
            name,
            f"{model.heads} heads are not divisible by HP degree {hp_degree} (equal head splits)",
        )
    cp_degree = world // hp_degree
    if problem.train.seq_len % (2 * cp_degree * hp_degree):
        return InfeasiblePlan(
            name,
            f"seq_len {problem.train.seq_len} does not split into {2 * cp_degree} equal "
            f"zigzag chunks of {hp_degree} equal shards",
        )
    layout = build_uniform_layout(
        problem.train.seq_len, model.heads, model.kv_heads, [hp_degree] * cp_degree
    )
    return _best_checkpointing(problem, layout, name, hp_degree, cp_degree)


def _best_checkpointing(problem: Problem, layout, name: str, hp_degree: int, cp_degree: int):
    """Homogeneous systems may drop activation checkpointing too when memory allows: the
    faster feasible of the allowed settings (the least-short OOM if neither fits)."""
    outcomes = []
    for checkpointing in problem.checkpointing_options:
        train = replace(problem.train, activation_checkpointing=checkpointing)
        knobs = {
            "hp_degree": hp_degree,
            "cp_degree": cp_degree,
            "activation_checkpointing": checkpointing,
        }
        fractions = even_state_fractions(problem.cluster.world_size)
        outcomes.append(evaluate(replace(problem, train=train), layout, fractions, name, knobs))
    feasible = [o for o in outcomes if isinstance(o, Plan)]
    if feasible:
        return max(feasible, key=lambda plan: plan.predicted.tokens_per_s)
    return min(outcomes, key=lambda o: o.total_missing_bytes)


def ring_only(problem: Problem) -> Plan | InfeasiblePlan:
    return uniform_grid_plan(problem, 1, "ring-only")


def ulysses_only(problem: Problem) -> Plan | InfeasiblePlan:
    return uniform_grid_plan(problem, problem.cluster.world_size, "ulysses-only")


def uniform_usp(problem: Problem) -> Plan | InfeasiblePlan:
    """The best uniform grid over every HP degree; the least-short OOM one if none fits."""
    world = problem.cluster.world_size
    candidates = [
        uniform_grid_plan(problem, d, f"uniform-usp (hp={d}, cp={world // d})")
        for d in range(1, world + 1)
        if world % d == 0
    ]
    feasible = [c for c in candidates if isinstance(c, Plan)]
    if feasible:
        return max(feasible, key=lambda p: p.predicted.tokens_per_s)
    short = [c for c in candidates if c.missing_bytes]
    if short:
        best = min(short, key=lambda c: c.total_missing_bytes)
        return InfeasiblePlan(
            "uniform-usp",
            f"every uniform grid is infeasible; the closest, {best.name}, is {best.reason}",
            best.missing_bytes,
        )
    return InfeasiblePlan("uniform-usp", "no uniform HP x CP grid divides heads and devices")


def all_baselines(problem: Problem) -> dict[str, Plan | InfeasiblePlan]:
    return {
        "uniform-usp": uniform_usp(problem),
        "ring-only": ring_only(problem),
        "ulysses-only": ulysses_only(problem),
    }
