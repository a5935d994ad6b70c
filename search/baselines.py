"""The baselines hexiseq must beat, scored by the same simulator.

The homogeneous-style systems follow the rules of what they stand for: equal sequence
shards, equal head splits (the HP degree must divide the head count, as DeepSpeed-Ulysses
and USP require) and model states sharded evenly.
- ring-only: context parallelism over every rank, zigzag (ring-flash-attention, Megatron CP).
- ulysses-only: head parallelism over every rank (DeepSpeed-Ulysses).
- uniform-usp: the best feasible uniform HP x CP grid (USP, Fang & Zhao 2024), all grids tried.
- homogeneous-subset: what a careful engineer does with a mixed cluster and a homogeneous
  system: drop the other cards and run the best uniform grid on one GPU type's nodes alone
  (every type tried, the fastest that fits kept; the plan's cluster is that subset).
- data-parallel replicas (`data_parallel`, not a `Plan`: one CP-HP plan cannot describe it):
  every GPU type whose nodes hold a sequence alone runs its own best uniform grid as a
  data-parallel replica on its own sequences, as many per step as balance the replicas,
  gradients all-reduced across replicas each step. Types that cannot hold a sequence sit out.

Grids are scored without activation checkpointing first: where that fits, the recompute
could only add time, so the checkpointed variant is not simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hexiseq.costmodel.memory import even_state_fractions
from hexiseq.costmodel.simulator import shared_tables
from hexiseq.layout import build_uniform_layout
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import SIMULATION_TABLES, Problem, evaluate

BASELINE_NAMES = ("uniform-usp", "ring-only", "ulysses-only", "homogeneous-subset")


def uniform_grid_plan(problem: Problem, hp_degree: int, name: str) -> Plan | InfeasiblePlan:
    """Equal shards and heads with HP groups of `hp_degree` consecutive ranks, zigzag ring."""
    key = ("grid", problem.train, problem.checkpointing_options, hp_degree)
    return replace(problem.memo(key, lambda: _grid_plan(problem, hp_degree, name)), name=name)


def _grid_plan(problem: Problem, hp_degree: int, name: str) -> Plan | InfeasiblePlan:
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
    key = (problem.train.seq_len, model.heads, model.kv_heads, hp_degree, cp_degree)
    layouts = problem.memo(UNIFORM_LAYOUTS, dict)
    if key not in layouts:
        layouts[key] = build_uniform_layout(*key[:3], [hp_degree] * cp_degree)
    return _best_checkpointing(problem, layouts[key], name, hp_degree, cp_degree)


UNIFORM_LAYOUTS = "uniform layouts"
"""A `Problem.cache` entry: the uniform grids laid out, which every GPU type's sub-cluster of
one shape shares (`_type_subsets`), so their simulations share the tables of the layout."""


def _best_checkpointing(problem: Problem, layout, name: str, hp_degree: int, cp_degree: int):
    """Homogeneous systems may drop activation checkpointing too when memory allows: without
    it if that fits (the recompute only adds time), else with it (the least-short OOM if
    neither fits)."""
    outcomes = []
    for checkpointing in sorted(problem.checkpointing_options):  # False first
        train = replace(problem.train, activation_checkpointing=checkpointing)
        knobs = {
            "hp_degree": hp_degree,
            "cp_degree": cp_degree,
            "activation_checkpointing": checkpointing,
        }
        fractions = even_state_fractions(problem.cluster.world_size)
        outcome = evaluate(replace(problem, train=train), layout, fractions, name, knobs)
        if isinstance(outcome, Plan):
            return outcome
        outcomes.append(outcome)
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


def type_subsets(problem: Problem) -> dict[str, Plan | InfeasiblePlan]:
    """Per GPU type, the best uniform grid on that type's nodes alone (`uniform_usp` of the
    sub-cluster), computed once per search."""
    return problem.memo(("type subsets", problem.train), lambda: _type_subsets(problem))


def _type_subsets(problem: Problem) -> dict[str, Plan | InfeasiblePlan]:
    cluster, plans = problem.cluster, {}
    # Every type's sub-cluster of one shape lays out the same grids: the layouts and the
    # simulator's tables of each (the ring's traffic, its causal pairs) are shared.
    tables, layouts = shared_tables(by_layout=True), {}
    for gpu in cluster.gpu_types:
        nodes = [node.name for node in cluster.nodes if node.gpu == gpu]
        subset = cluster.subset(nodes, f"{cluster.name}[{gpu} only]")
        sub_problem = Problem(
            subset, problem.model, problem.train, problem.cost, problem.checkpointing_options
        )
        sub_problem.cache.update({SIMULATION_TABLES: tables, UNIFORM_LAYOUTS: layouts})
        plans[gpu] = uniform_usp(sub_problem)
    return plans


def homogeneous_subset(problem: Problem) -> Plan | InfeasiblePlan:
    """The best uniform grid on one GPU type's nodes alone, the fastest type that fits."""
    cluster = problem.cluster
    if len(cluster.gpu_types) == 1:
        return InfeasiblePlan(
            "homogeneous-subset", "the cluster is homogeneous already (see uniform-usp)"
        )
    found, short = [], []
    for gpu, plan in type_subsets(problem).items():
        nodes = [node.name for node in cluster.nodes if node.gpu == gpu]
        subset = plan.cluster if isinstance(plan, Plan) else cluster.subset(nodes)
        label = f"homogeneous-subset ({gpu} x {subset.world_size}, {plan.name})"
        if isinstance(plan, Plan):
            dropped = cluster.world_size - subset.world_size
            knobs = {**plan.knobs, "devices_used": subset.world_size, "devices_dropped": dropped}
            found.append(replace(plan, name=label, knobs=knobs))
        elif plan.missing_bytes:
            ranks = [d.rank for d in cluster.devices if d.node in set(nodes)]
            missing = {ranks[r]: lack for r, lack in plan.missing_bytes.items()}
            short.append((gpu, InfeasiblePlan(label, plan.reason, missing)))
    if found:
        return max(found, key=lambda p: p.predicted.tokens_per_s)
    reason = "no single GPU type holds the sequence on its own nodes"
    if short:  # the least-short type's missing bytes, on the full cluster's ranks
        gpu, closest = min(short, key=lambda item: item[1].total_missing_bytes)
        gib = closest.total_missing_bytes / 2**30
        reason += f"; the closest, {gpu} alone, is {gib:.2f} GiB short"
        return InfeasiblePlan("homogeneous-subset", reason, closest.missing_bytes)
    return InfeasiblePlan("homogeneous-subset", reason)


def all_baselines(problem: Problem) -> dict[str, Plan | InfeasiblePlan]:
    """Every baseline by name; homogeneous-subset only on a cluster of several GPU types."""
    baselines = {
        "uniform-usp": uniform_usp(problem),
        "ring-only": ring_only(problem),
        "ulysses-only": ulysses_only(problem),
    }
    if len(problem.cluster.gpu_types) > 1:
        baselines["homogeneous-subset"] = homogeneous_subset(problem)
    return baselines


@dataclass(frozen=True)
class Replica:
    """One GPU type's data-parallel replica: its plan and its sequences per step."""

    gpu: str
    plan: Plan
    sequences: int


@dataclass(frozen=True)
class DataParallelBaseline:
    """Every GPU type that holds a sequence alone as its own data-parallel replica."""

    replicas: tuple[Replica, ...]
    gradient_sync_s: float
    step_time_s: float
    tokens_per_s: float
    idle_types: tuple[str, ...] = ()

    name = "data-parallel replicas"

    @property
    def sequences(self) -> int:
        """The step's batch: every replica's sequences."""
        return sum(r.sequences for r in self.replicas)

    def describe(self) -> str:
        parts = [
            f"{r.gpu} x {r.plan.cluster.world_size}: {r.sequences} seq/step" for r in self.replicas
        ]
        idle = f"; idle: {', '.join(self.idle_types)}" if self.idle_types else ""
        return f"{self.name} ({'; '.join(parts)}{idle})"


MAX_SEQUENCES_PER_REPLICA = 8


def data_parallel(problem: Problem) -> DataParallelBaseline | None:
    """Each GPU type that fits a sequence alone as a data-parallel replica running its best
    uniform grid, priced as k times its one-sequence step; the replicas then all-reduce their
    FP32 gradients across the network. A step of several sequences (`train.micro_batches`)
    is shared out (each next sequence to the replica that finishes it first); a step of one
    gets k_t = 1..MAX_SEQUENCES_PER_REPLICA per replica, chosen to balance the replicas (a
    batch of its own). None with fewer than two such types (then it is the homogeneous
    subset)."""
    from hexiseq.search.replicas import balanced_sequences  # it imports this module

    if len(problem.cluster.gpu_types) < 2:
        return None
    one = replace(problem, train=replace(problem.train, micro_batches=1))
    fitting = {gpu: p for gpu, p in type_subsets(one).items() if isinstance(p, Plan)}
    if len(fitting) < 2:
        return None
    sync_s = _gradient_sync_s(problem, [p.cluster.world_size for p in fitting.values()])
    steps = {gpu: plan.predicted.step_time_s for gpu, plan in fitting.items()}
    if problem.train.micro_batches > 1:
        shares = balanced_sequences(list(steps.values()), problem.train.micro_batches)
        counts = {gpu: k for gpu, k in zip(steps, shares) if k > 0}
    else:
        counts = _own_batch(steps, sync_s)
    step_s = max(counts[gpu] * steps[gpu] for gpu in counts) + sync_s
    rate = problem.train.seq_len * sum(counts.values()) / step_s
    replicas = tuple(Replica(gpu, fitting[gpu], k) for gpu, k in counts.items())
    idle = tuple(gpu for gpu in problem.cluster.gpu_types if gpu not in counts)
    return DataParallelBaseline(replicas, sync_s, step_s, rate, idle)


def _own_batch(steps: dict[str, float], sync_s: float) -> dict[str, int]:
    """1..MAX_SEQUENCES_PER_REPLICA sequences per replica: the counts with the most
    sequences per second."""
    best_rate, best = 0.0, {}
    for horizon_s in sorted(
        k * s for s in steps.values() for k in range(1, MAX_SEQUENCES_PER_REPLICA + 1)
    ):
        counts = {
            gpu: min(MAX_SEQUENCES_PER_REPLICA, math.floor(horizon_s / s + 1e-9))
            for gpu, s in steps.items()
        }
        counts = {gpu: k for gpu, k in counts.items() if k >= 1}
        rate = sum(counts.values()) / (max(counts[g] * steps[g] for g in counts) + sync_s)
        if rate > best_rate:
            best_rate, best = rate, counts
    return best


def _gradient_sync_s(problem: Problem, replica_sizes: list[int]) -> float:
    """Ring all-reduce of the FP32 gradients across replicas, each rank exchanging its
    shard with its peers over the network: 2 (R - 1) / R of the largest shard."""
    count = len(replica_sizes)
    shard_bytes = 4.0 * problem.model.params / min(replica_sizes)
    moved = 2.0 * (count - 1) / count * shard_bytes
    cluster = problem.cluster
    return float(
        problem.cost.transfer_time_s(
            moved, cluster.inter_node_GBps, cluster.inter_node_latency_us * 1e-6
        )
    )


def strongest(baselines: dict[str, Plan | InfeasiblePlan]) -> Plan | None:
    """The fastest feasible baseline, or None when none can run."""
    feasible = [b for b in baselines.values() if isinstance(b, Plan)]
    return max(feasible, key=lambda b: b.predicted.tokens_per_s) if feasible else None
