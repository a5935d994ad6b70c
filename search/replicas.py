"""Uneven data parallelism over CP-HP meshes: plans of several replicas (issue 15).

A replica plan splits the cluster by nodes into data-parallel replicas that share the step's
batch (`train.micro_batches` sequences, the same batch one mesh would take one sequence after
another). Each replica is a CP-HP mesh planned on its own nodes and takes its own number of
the batch's sequences, so that the replicas finish together (HexiScale's uneven batch, for
long sequences). After their backward, each
rank's FP32 gradient shard is summed with the matching parts of the other replicas' shards
(the runtime all-reduces each piece of a unit among the one rank of every replica that holds
it), then every rank steps AdamW on its own shard.

Predicted step = the slowest replica's own step (its sequences, its optimizer; the others
idle until it is done) + the cross-replica gradient reduction: a ring all-reduce of each
rank's shard among its R peers over the inter-node link, 2 (R - 1) / R of the shard's bytes
and 2 (R - 1) message latencies per unit; the largest shard sets the time.

The search (`replica_plan`): within each GPU type, its nodes are cut into replicas of m nodes
(every m from the fewest that hold a sequence while a node's throughput still grows), each
running its best uniform grid; types that cannot hold a sequence on their own nodes sit
out; while there are more replicas than sequences, every type's replicas are made twice as
large; the batch's sequences go one by one to the replica that would finish its next one
first, and every replica is simulated again with its count (one given none sits out).
Beside them, replicas of the cluster's whole GPU mix: each type's nodes in k equal runs, each
replica planned by the search of one mesh (the smallest such replica that holds a sequence,
up to MAX_MIXED_REPLICA_DEVICES). Replicas smaller than a node are not searched.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hexiseq.cluster import Cluster
from hexiseq.costmodel import CostModel
from hexiseq.model import ModelSpec
from hexiseq.plan import InfeasiblePlan, Plan, Prediction, Replica
from hexiseq.search._evaluate import Problem, build_plan, evaluate, simulated


@dataclass(frozen=True)
class ReplicaPart:
    """One replica of a replica plan: its plan on its own nodes (`train.micro_batches` is the
    sequences it takes per step)."""

    plan: Plan

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.plan.cluster.nodes)

    @property
    def sequences(self) -> int:
        return self.plan.train.micro_batches


def compose(
    cluster: Cluster, parts: Sequence[ReplicaPart], cost: CostModel, name: str, knobs: dict
) -> Plan:
    """The plan of `parts` as data-parallel replicas on `cluster`'s nodes they use (file order
    kept); see the module docstring for its predicted step."""
    used = {node for part in parts for node in part.nodes}
    world = cluster
    if len(used) < len(cluster.nodes):
        world = cluster.subset([node.name for node in cluster.nodes if node.name in used])
    ranks_of = {}
    for device in world.devices:
        ranks_of.setdefault(device.node, []).append(device.rank)
    sync_s = gradient_sync_s(world, parts[0].plan.model, [p.plan for p in parts], cost)
    slowest_s = max(part.plan.predicted.step_time_s for part in parts)
    step_s = slowest_s + sync_s
    replicas, assignments, ranks = [], [None] * world.world_size, [None] * world.world_size
    labels: dict[str, str] = {}
    for index, part in enumerate(parts):
        global_ranks = tuple(rank for node in part.nodes for rank in ranks_of[node])
        plan = part.plan
        replicas.append(Replica(global_ranks, plan.attention_layout, part.sequences))
        waits_s = slowest_s - plan.predicted.step_time_s
        for local, rank in enumerate(global_ranks):
            own = plan.assignments[local]
            assignments[rank] = replace(own, rank=rank, replica=index)
            predicted = plan.predicted.ranks[local]
            ranks[rank] = replace(
                predicted,
                idle_s=predicted.idle_s + waits_s,
                sharding_exposed_comm_s=predicted.sharding_exposed_comm_s + sync_s,
            )
        labels |= plan.predicted.cost_model
    sequences = sum(part.sequences for part in parts)
    train = replace(parts[0].plan.train, micro_batches=sequences)
    prediction = Prediction(step_s, train.tokens_per_step / step_s, tuple(ranks), labels)
    knobs = {**knobs, "gradient_sync_s": sync_s}
    return Plan(
        name,
        world,
        parts[0].plan.model,
        train,
        replicas[0].layout,
        tuple(assignments),
        knobs,
        prediction,
        tuple(replicas),
    )


def predict_replicas(plan: Plan, cost: CostModel) -> Prediction:
    """`plan`'s replicas simulated again under `cost`, each on its own nodes with its layout,
    state shares and sequences, composed as the search composes them."""
    parts = []
    for index in range(len(plan.replicas)):
        own = plan.replica_plan(index)
        fractions = [a.state_fraction for a in own.assignments]
        problem = Problem(own.cluster, plan.model, own.train, cost)
        step = simulated(problem, own.layout(), fractions)
        parts.append(ReplicaPart(build_plan(problem, own.layout(), fractions, own.name, {}, step)))
    return compose(plan.cluster, parts, cost, plan.name, plan.knobs).predicted


def gradient_sync_s(
    cluster: Cluster, model: ModelSpec, plans: Sequence[Plan], cost: CostModel
) -> float:
    """The cross-replica reduction of FP32 gradient shards (module docstring): 0 for one."""
    count = len(plans)
    if count < 2:
        return 0.0
    largest = max(a.state_fraction for plan in plans for a in plan.assignments)
    moved = 2.0 * (count - 1) / count * 4.0 * model.params * largest
    latency_s = cluster.inter_node_latency_us * 1e-6
    units = model.layers + 1  # one unit per decoder block and the root (runtime.sharding)
    transfer_s = cost.transfer_time_s(moved, cluster.inter_node_GBps, 0.0)
    return float(transfer_s) + 2 * (count - 1) * units * latency_s


def replica_plan(problem: Problem) -> Plan | InfeasiblePlan | None:
    """The best plan of several replicas sharing the step's `train.micro_batches` sequences
    (module docstring); None where the cluster cannot be split (one node, or one sequence
    per step)."""
    total = problem.train.micro_batches
    if len(problem.cluster.nodes) < 2 or total < 2:
        return None
    one = replace(problem, train=replace(problem.train, micro_batches=1))
    chunked = {gpu: _best_chunks(one, gpu) for gpu in problem.cluster.gpu_types}
    candidates = [*_fewer_replicas(one, chunked, total), *_mixed_replicas(one, total)]
    found = [
        plan for chunks in candidates if (plan := _replicas_of(one, chunks, total)) is not None
    ]
    if not found:
        return InfeasiblePlan(
            "data-parallel replicas", "fewer than two groups of nodes hold a sequence alone"
        )
    return max(found, key=lambda plan: plan.predicted.tokens_per_s)


def _mixed_replicas(problem: Problem, total: int):
    """The cluster cut into k replicas of the same GPU mix (each type's nodes in k equal
    runs), for every k > 1 that divides every type's node count and is at most the batch:
    each replica planned by the search of one mesh (uneven heads and shards across its
    types), once per node shape."""
    by_type: dict[str, list] = {}
    for node in problem.cluster.nodes:
        by_type.setdefault(node.gpu, []).append(node)
    if len(by_type) < 2:
        return
    common = math.gcd(*(len(nodes) for nodes in by_type.values()))
    world, found = problem.cluster.world_size, 0
    for k in range(min(common, total), 1, -1):  # the smallest replicas first
        if common % k or world // k > MAX_MIXED_REPLICA_DEVICES:
            continue
        replicas = []
        for j in range(k):
            nodes = [n for group in by_type.values() for n in _run(group, j, k)]
            replicas.append(_mesh_plan(problem, _subset(problem, nodes)))
        if all(isinstance(plan, Plan) for plan in replicas):
            yield replicas
            found += 1
            if found == MIXED_CANDIDATES:
                return


MAX_MIXED_REPLICA_DEVICES = 128
"""The largest mixed replica planned (each is a search of one mesh, about 0.5 s at 128)."""
MIXED_CANDIDATES = 1
"""Mixed replica sizes tried: the smallest that holds a sequence."""


def _run(nodes: list, index: int, count: int) -> list:
    size = len(nodes) // count
    return nodes[index * size : (index + 1) * size]


def _mesh_plan(problem: Problem, cluster: Cluster) -> Plan | None:
    """The best plan of one mesh on `cluster` (the default search), once per node shape."""
    from hexiseq.errors import InfeasibleError, InputError
    from hexiseq.search.api import search  # the search plans replicas with this module
    from hexiseq.search.options import SearchOptions

    def plan() -> Plan | None:
        checkpointing = problem.checkpointing_options
        options = SearchOptions(
            cost_model=problem.cost,
            precision="fp32" if problem.train.compute_dtype_bytes == 4 else "bf16",
            activation_checkpointing=None if len(checkpointing) > 1 else checkpointing[0],
            data_parallel=False,
        )
        try:
            return search(cluster, problem.model, problem.train.seq_len, options).best
        except (InfeasibleError, InputError):  # nothing fits, or a sequence too short for it
            return None

    found = problem.memo(
        ("replica mesh", problem.train, _shape(cluster)), lambda: (plan(), cluster)
    )
    best, made_on = found
    return None if best is None else _on_cluster(best, cluster, made_on)


def _fewer_replicas(problem: Problem, chunked: dict[str, list[Plan]], total: int):
    """The per-type chunks, then with every type's replicas twice as large, again and again,
    while there are more replicas than sequences (a replica without one would sit idle)."""
    yield [plan for chunks in chunked.values() for plan in chunks]
    for _ in range(REGROUPINGS):
        if sum(len(chunks) for chunks in chunked.values()) <= total:
            return
        chunked = {gpu: _regrouped(problem, chunks) for gpu, chunks in chunked.items()}
        yield [plan for chunks in chunked.values() for plan in chunks]


REGROUPINGS = 4
"""How many times replicas are made twice as large for a batch of few sequences."""


def _regrouped(problem: Problem, chunks: list[Plan]) -> list[Plan]:
    """One type's nodes in replicas of twice the nodes of `chunks`' first."""
    if len(chunks) < 2:
        return chunks
    nodes = [node for plan in chunks for node in plan.cluster.nodes]
    return _chunks(problem, nodes, 2 * len(chunks[0].cluster.nodes)) or chunks


def _replicas_of(problem: Problem, chunks: list[Plan], total: int) -> Plan | None:
    """`chunks` (per-sequence plans) as replicas sharing `total` sequences: balanced, then
    each simulated with its count; a chunk given none sits out. None with fewer than two."""
    if len(chunks) < 2:
        return None
    checkpointing = any(plan.train.activation_checkpointing for plan in chunks)
    chunks = [_with_checkpointing(problem, plan, checkpointing) for plan in chunks]
    counts = balanced_sequences([plan.predicted.step_time_s for plan in chunks], total)
    plans = [
        _with_sequences(problem, plan, count) for plan, count in zip(chunks, counts) if count > 0
    ]
    if len(plans) < 2 or None in plans:  # a replica that cannot take its share drops it
        return None
    parts = [ReplicaPart(plan) for plan in plans]
    return compose(problem.cluster, parts, problem.cost, _name(parts), _knobs(problem, parts))


def balanced_sequences(step_s: Sequence[float], total: int) -> list[int]:
    """`total` sequences over replicas that take `step_s` per sequence, so that the slowest
    finishes first: each next sequence to the replica that would finish it earliest (optimal
    for equal sequences: the least makespan)."""
    counts = [0] * len(step_s)
    finishes = [(s, i) for i, s in enumerate(step_s)]  # (end of its next sequence, replica)
    heapq.heapify(finishes)
    for _ in range(total):
        _, index = heapq.heappop(finishes)
        counts[index] += 1
        heapq.heappush(finishes, ((counts[index] + 1) * step_s[index], index))
    return counts


def _best_chunks(problem: Problem, gpu: str) -> list[Plan]:
    """One GPU type's nodes cut into replicas of m nodes (a last, smaller one merged into the
    one before if it cannot hold a sequence): the m with the most throughput per node, trying
    m upward from the fewest nodes that hold a sequence until a node's throughput falls."""
    nodes = [node for node in problem.cluster.nodes if node.gpu == gpu]
    best, best_rate = [], 0.0
    for size in range(1, len(nodes) + 1):
        chunks = _chunks(problem, nodes, size)
        if chunks is None:
            if best:
                break
            continue
        rate = sum(p.predicted.tokens_per_s for p in chunks)
        if rate <= best_rate:
            break
        best, best_rate = chunks, rate
    return best


def _chunks(problem: Problem, nodes: list, size: int) -> list[Plan] | None:
    groups = [nodes[i : i + size] for i in range(0, len(nodes), size)]
    plans = [_chunk_plan(problem, _subset(problem, group), None, 1) for group in groups]
    if len(plans) > 1 and not isinstance(plans[-1], Plan):
        merged = groups[-2] + groups[-1]
        plans[-2:] = [_chunk_plan(problem, _subset(problem, merged), None, 1)]
    return plans if all(isinstance(p, Plan) for p in plans) else None


def _subset(problem: Problem, nodes: list) -> Cluster:
    names = [node.name for node in nodes]
    return problem.cluster.subset(names, f"{problem.cluster.name}[{','.join(names)}]")


def _chunk_plan(
    problem: Problem, cluster: Cluster, checkpointing: bool | None, sequences: int
) -> Plan | InfeasiblePlan:
    """The best uniform grid on `cluster` (one GPU type's nodes) for `sequences` sequences
    per step, with `checkpointing` (None: the search's options), once per node shape."""
    from hexiseq.search.baselines import uniform_usp  # baselines use this module

    options = problem.checkpointing_options if checkpointing is None else (checkpointing,)
    key = ("replica chunk", problem.train, _shape(cluster), options, sequences)
    train = replace(problem.train, micro_batches=sequences)
    plan = problem.memo(
        key,
        lambda: uniform_usp(
            Problem(cluster, problem.model, train, problem.cost, options)
        ),  # fmt: skip
    )
    if isinstance(plan, Plan):  # another chunk of the same shape: its own nodes
        plan = _on_cluster(plan, cluster)
    return plan


def _shape(cluster: Cluster) -> tuple:
    """What a chunk's plan depends on in its cluster: its nodes but for their names (and
    the nodes themselves where links between them are declared one by one)."""
    shape = tuple(
        (
            n.gpu,
            n.count,
            n.intra_node_GBps,
            n.emulation_slowdown,
            n.memory_GiB,
            n.measured_slowdown,
        )
        for n in cluster.nodes
    )
    return (shape, cluster.nodes, cluster.overrides) if cluster.overrides else shape


def _on_cluster(plan: Plan, cluster: Cluster, made_on: Cluster | None = None) -> Plan:
    """`plan` (made on `made_on`, nodes of the same shape as `cluster`'s; or on some of
    them, a homogeneous subset) on `cluster`'s nodes."""
    if plan.cluster == cluster:
        return plan
    if made_on is not None and plan.cluster != made_on:
        position = {node.name: i for i, node in enumerate(made_on.nodes)}
        names = [cluster.nodes[position[node.name]].name for node in plan.cluster.nodes]
        cluster = cluster.subset(names, f"{cluster.name}[{','.join(names)}]")
    devices = cluster.devices
    assignments = tuple(
        replace(a, gpu=devices[a.rank].gpu, node=devices[a.rank].node) for a in plan.assignments
    )
    return replace(plan, cluster=cluster, assignments=assignments)


def _with_sequences(problem: Problem, plan: Plan, sequences: int) -> Plan | None:
    """`plan`'s layout simulated again for `sequences` per step (None where that does not
    fit: accumulating gradients takes memory)."""
    return _again(problem, plan, replace(plan.train, micro_batches=sequences))


def _with_checkpointing(problem: Problem, plan: Plan, checkpointing: bool) -> Plan:
    """Every replica runs one model, so one activation-checkpointing setting for all (turning
    it on only frees memory, so that always fits)."""
    return (
        _again(problem, plan, replace(plan.train, activation_checkpointing=checkpointing)) or plan
    )


def _again(problem: Problem, plan: Plan, train) -> Plan | None:
    """`plan`'s layout and state shares under `train`, once per node shape; None where that
    does not fit."""
    if train == plan.train:
        return plan
    fractions = [a.state_fraction for a in plan.assignments]
    shape = _shape(plan.cluster)
    key = ("replica again", shape, train, plan.attention_layout, tuple(fractions))
    again = problem.memo(
        key,
        lambda: evaluate(
            Problem(plan.cluster, problem.model, train, problem.cost),
            plan.attention_layout,
            fractions,
            plan.name,
            {**plan.knobs, "activation_checkpointing": train.activation_checkpointing},
        ),  # fmt: skip
    )
    return _on_cluster(again, plan.cluster) if isinstance(again, Plan) else None


def _name(parts: Sequence[ReplicaPart]) -> str:
    """`4 x H200 x 8; 2 x H100-SXM x 8 + A100-80G x 8`: replicas of one GPU mix counted."""
    mixes: dict[str, int] = {}
    for part in parts:
        mix = " + ".join(f"{gpu} x {n}" for gpu, n in _mix(part.plan.cluster).items())
        mixes[mix] = mixes.get(mix, 0) + 1
    return f"data-parallel replicas ({'; '.join(f'{n} x {mix}' for mix, n in mixes.items())})"


def _mix(cluster: Cluster) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in cluster.nodes:
        counts[node.gpu] = counts.get(node.gpu, 0) + node.count
    return counts


def _knobs(problem: Problem, parts: Sequence[ReplicaPart]) -> dict:
    used = sum(part.plan.cluster.world_size for part in parts)
    return {
        "replicas": len(parts),
        "replica_nodes": [list(part.nodes) for part in parts],
        "sequences": [part.sequences for part in parts],
        "replica_grids": [part.plan.name for part in parts],
        "activation_checkpointing": parts[0].plan.train.activation_checkpointing,
        "devices_used": used,
        "devices_dropped": problem.cluster.world_size - used,
    }
