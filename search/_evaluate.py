"""Scoring a candidate layout: simulate it, check memory, and build a `Plan` or say why not."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel import CostModel, StepPrediction, estimate_memory, simulate_step
from hexiseq.costmodel.base import memory_calibrations
from hexiseq.costmodel.memory import even_state_fractions, memory_limit_bytes
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.plan import InfeasiblePlan, Plan, Prediction, RankAssignment, RankPrediction

T = TypeVar("T")

SIMULATION_TABLES = "simulation tables"
"""A `Problem.cache` key: the dict `simulate_step` keeps its layout-structure tables in
(`shared`), which depend on the layout's groups and heads alone, not on the cluster."""


_MISSING = object()  # a memo's marker for a key not computed yet


@dataclass(frozen=True)
class Problem:
    """What every candidate of one search shares."""

    cluster: Cluster
    model: ModelSpec
    train: TrainSpec
    cost: CostModel
    # Activation checkpointing the search may use: (False, True) lets it drop the recompute
    # wherever memory allows; one value forces it.
    checkpointing_options: tuple[bool, ...] = (False, True)
    # What one search computes more than once (simulations, memory estimates, busy rates,
    # memory rows), keyed by everything it depends on: `dataclasses.replace` copies share it.
    cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """`compute()` once per `key` for this search (the key hashed once when known)."""
        found = self.cache.get(key, _MISSING)
        if found is _MISSING:
            found = self.cache[key] = compute()
        return found

    def links(self) -> tuple[np.ndarray, np.ndarray]:
        """[node, node] bandwidth (GB/s) and latency (s) under the cost model, once per search."""
        return self.memo("links", lambda: self.cost.link_parameters(self.cluster))

    def node_index(self) -> dict[str, int]:
        """Node name -> its index in `cluster.nodes` (and in `links`)."""
        return self.memo(
            "node index", lambda: {node.name: i for i, node in enumerate(self.cluster.nodes)}
        )

    def limits(self) -> list[int]:
        return self.memo(
            "limits",
            lambda: [
                memory_limit_bytes(self.cluster.gpu(r).memory_bytes)
                for r in range(self.cluster.world_size)
            ],
        )


def simulated(
    problem: Problem, layout: AttentionLayout, fractions: Sequence[float] | None = None
) -> StepPrediction:
    """`simulate_step` of `layout` under `problem`, once per search."""
    if fractions is None:
        fractions = even_state_fractions(layout.world_size)
    fractions = tuple(fractions)
    return problem.memo(
        _simulation_key(problem, layout, fractions),
        lambda: simulate_step(
            problem.cluster,
            problem.model,
            problem.train,
            layout,
            problem.cost,
            fractions,
            shared=problem.memo(SIMULATION_TABLES, dict),
        ),
    )


def _simulation_key(problem: Problem, layout: AttentionLayout, fractions: Sequence[float]):
    return "simulate", problem.train, layout, tuple(fractions)


def memory_shortfall(
    problem: Problem, layout: AttentionLayout, fractions: Sequence[float]
) -> dict[int, int]:
    """Bytes by which each over-limit rank exceeds 95 % of its memory."""
    return problem.memo(
        ("shortfall", problem.train, layout, tuple(fractions)),
        lambda: _shortfall(problem, layout, fractions),
    )


def _shortfall(
    problem: Problem, layout: AttentionLayout, fractions: Sequence[float]
) -> dict[int, int]:
    simulation = problem.cache.get(_simulation_key(problem, layout, fractions))
    if simulation is not None:  # the simulation estimated the same memory
        memory = simulation.memory
    else:
        calibrations = memory_calibrations(problem.cost, problem.cluster.gpu_types)
        memory = estimate_memory(
            problem.cluster, problem.model, problem.train, layout, fractions, calibrations
        )
    peaks: dict[int, int] = {}  # ranks of one shape share one breakdown
    missing = {}
    for rank, (m, limit) in enumerate(zip(memory, problem.limits())):
        peak = peaks.get(id(m))
        if peak is None:
            peak = peaks[id(m)] = m.peak_bytes
        if peak > limit:
            missing[rank] = peak - limit
    return missing


def evaluate(
    problem: Problem,
    layout: AttentionLayout,
    fractions: Sequence[float],
    name: str,
    knobs: dict[str, Any],
) -> Plan | InfeasiblePlan:
    """Simulate `layout`; an over-memory candidate becomes an `InfeasiblePlan` (OOM)."""
    missing = memory_shortfall(problem, layout, fractions)
    if missing:
        return out_of_memory(name, missing)
    prediction = simulated(problem, layout, fractions)
    return build_plan(problem, layout, fractions, name, knobs, prediction)


def out_of_memory(name: str, missing: dict[int, int]) -> InfeasiblePlan:
    if not missing:  # the solver found no split, yet no rank lacks memory: say so, not OOM
        return InfeasiblePlan(name, "the local solver found no split of the sequence")
    total_gib = sum(missing.values()) / 2**30
    worst = max(missing, key=missing.get)
    reason = (
        f"OOM: {len(missing)} rank(s) over 95 % of memory, {total_gib:.2f} GiB missing in all "
        f"(rank {worst} lacks {missing[worst] / 2**30:.2f} GiB)"
    )
    return InfeasiblePlan(name, reason, missing)


def build_plan(
    problem: Problem,
    layout: AttentionLayout,
    fractions: Sequence[float],
    name: str,
    knobs: dict[str, Any],
    prediction: StepPrediction,
) -> Plan:
    devices = problem.cluster.devices
    tokens = layout.token_counts
    assignments = tuple(
        RankAssignment(
            rank=r,
            gpu=devices[r].gpu,
            node=devices[r].node,
            group=layout.group_of(r),
            head_range=heads,
            tokens=tokens[r],
            state_fraction=float(fractions[r]),
        )
        for r, heads in enumerate(layout.head_ranges)
    )
    return Plan(
        name,
        problem.cluster,
        problem.model,
        problem.train,
        layout,
        assignments,
        dict(knobs),
        plan_prediction(prediction),
    )


def plan_prediction(prediction: StepPrediction) -> Prediction:
    """The simulator's `StepPrediction` as a plan's `predicted` (per-rank times and memory)."""
    memory: dict[int, tuple[int, dict]] = {}  # ranks of one shape share one breakdown
    for breakdown in prediction.memory:
        if id(breakdown) not in memory:
            memory[id(breakdown)] = (breakdown.peak_bytes, breakdown.terms())
    keys = list(prediction.seconds_by_part)
    columns = zip(*prediction.seconds_by_part.values())
    made: dict[tuple, RankPrediction] = {}  # ranks with the same numbers share one (frozen)
    ranks = []
    for row, breakdown, capacity in zip(
        columns, prediction.memory, prediction.memory_capacity_bytes
    ):
        key = (row, id(breakdown), capacity)
        rank = made.get(key)
        if rank is None:
            peak, terms = memory[id(breakdown)]
            rank = made[key] = RankPrediction(
                **dict(zip(keys, row)),
                memory_bytes=peak,
                memory_capacity_bytes=capacity,
                memory_terms=dict(terms),
            )
        ranks.append(rank)
    ranks = tuple(ranks)
    return Prediction(
        prediction.step_time_s, prediction.tokens_per_s, ranks, prediction.cost_model_labels
    )
