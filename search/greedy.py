"""Greedy global stage: HP groups inside high-bandwidth domains, and the ring order.

The choices it fixes (`GlobalChoices`: HP degree per GPU type, ring-order strategy, chunk
quantum, activation checkpointing) are what the Optuna layer samples; `default_choices` is
the greedy pick that is tried first. The polish (`search.polish`) may also cut single nodes
into groups of their own sizes (`GlobalChoices.node_groups`), where one degree per type
leaves a node a short last group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import accumulate

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.model import ModelSpec
from hexiseq.search._evaluate import Problem

Group = tuple[int, ...]
RING_ORDERS = ("bandwidth", "file", "fastest-first", "interleaved")
EXPLICIT_ORDER_PREFIX = "nodes:"
"""A ring order may also name the nodes outright, "nodes:n0,n2,n1" (the polish tries those)."""
# Ulysses all-to-alls move (d-1)/d of every layer's q, k, v and output through the node's
# links, ring attention moves K/V blocks behind compute; an HP group spanning the node pays
# off when the node's link is clearly faster than the network (NVLink vs NIC), not on PCIe.
HP_LINK_ADVANTAGE = 4.0
UNIT_PAIRS = 1e9  # any size: a datasheet model is linear, a fitted one is read at scale


@dataclass(frozen=True)
class GlobalChoices:
    """The discrete decisions of the global stage."""

    hp_degrees: dict[str, int] = field(hash=False)
    ring_order: str = "bandwidth"
    chunk_quantum: int | None = None  # None: `auto_chunk_quantum`
    activation_checkpointing: bool = True
    # Nodes cut into HP groups of these sizes (node name, sizes in rank order), whatever
    # their type's degree: sorted by node name, each differing from its type's cut.
    node_groups: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def key(self) -> tuple:
        """A hashable identity (for caching trials that repeat a choice)."""
        degrees = tuple(sorted(self.hp_degrees.items()))
        key = degrees, self.ring_order, self.chunk_quantum, self.activation_checkpointing
        return (*key, self.node_groups) if self.node_groups else key


def degree_cut(count: int, degree: int) -> tuple[int, ...]:
    """The group sizes of a node of `count` devices at HP degree `degree`."""
    return tuple(min(degree, count - start) for start in range(0, count, degree))


def with_node_groups(
    cluster: Cluster, choices: GlobalChoices, node: str, sizes: tuple[int, ...]
) -> GlobalChoices:
    """`choices` with `node` cut into groups of `sizes` (its type's cut again: no override)."""
    found = next(n for n in cluster.nodes if n.name == node)
    cuts = dict(choices.node_groups)
    cuts.pop(node, None)
    if sizes != degree_cut(found.count, choices.hp_degrees[found.gpu]):
        cuts[node] = sizes
    return replace(choices, node_groups=tuple(sorted(cuts.items())))


def node_groups_text(node_groups: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    """`node_groups` as a trial parameter: "n0=2+1+1+1;n3=3+3" ("" for none)."""
    return ";".join(f"{node}={'+'.join(map(str, sizes))}" for node, sizes in node_groups)


def parse_node_groups(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The inverse of `node_groups_text`."""
    if not text:
        return ()
    found = []
    for item in text.split(";"):
        node, _, sizes = item.partition("=")
        found.append((node, tuple(int(size) for size in sizes.split("+"))))
    return tuple(sorted(found))


def nodes_by_name(cluster: Cluster) -> dict[str, list[int]]:
    """Ranks of every node, nodes in file order: the high-bandwidth domains."""
    nodes: dict[str, list[int]] = {}
    for device in cluster.devices:
        nodes.setdefault(device.node, []).append(device.rank)
    return nodes


@lru_cache(maxsize=64)
def _ranks_by_node(cluster: Cluster) -> dict[str, tuple[int, ...]]:
    return {name: tuple(ranks) for name, ranks in nodes_by_name(cluster).items()}


def speed_by_type(cluster: Cluster, speeds: Sequence[float]) -> dict[str, float]:
    """The fastest rank's attention speed of each GPU type."""
    by_type: dict[str, float] = {}
    for device, speed in zip(cluster.devices, speeds):
        by_type[device.gpu] = max(by_type.get(device.gpu, 0.0), speed)
    return by_type


def candidate_hp_degrees(cluster: Cluster, model: ModelSpec, gpu: str) -> list[int]:
    """HP degrees worth trying for one GPU type: 1 up to its largest node (at most the head
    count); a degree that does not divide a node leaves a smaller last group there."""
    sizes = [node.count for node in cluster.nodes if node.gpu == gpu]
    largest = min(max(sizes), model.heads)
    return list(range(1, largest + 1))


def default_choices(
    cluster: Cluster, model: ModelSpec, checkpointing: bool = True
) -> GlobalChoices:
    """Greedy pick: a type's HP group spans its node when the node link is well faster than
    the network (or the cluster is one node), else pure ring (HP degree 1)."""
    degrees = {}
    for gpu in cluster.gpu_types:
        nodes = [node for node in cluster.nodes if node.gpu == gpu]
        fast_link = len(cluster.nodes) == 1 or all(
            node.intra_node_GBps >= HP_LINK_ADVANTAGE * cluster.inter_node_GBps for node in nodes
        )
        degrees[gpu] = max(candidate_hp_degrees(cluster, model, gpu)) if fast_link else 1
    return GlobalChoices(degrees, "bandwidth", None, checkpointing)


def greedy_candidates(
    cluster: Cluster,
    model: ModelSpec,
    checkpointing: bool = True,
    speed_by_type: dict[str, float] | None = None,
) -> list[GlobalChoices]:
    """The greedy stage's short list, best guess first: the link rule of `default_choices`,
    then every type at the same HP degree (1, 2, 4, ... up to the largest node), each capped
    at what a type's nodes and the head count allow; with `speed_by_type`, also the slowest
    type in one HP group per node and every other type at HP 1 (a slow node then computes few,
    large blocks while the fast ones keep the ring busy: the exhaustive search's most common
    winner in benchmarks/plan_quality.py)."""
    first = default_choices(cluster, model, checkpointing)
    largest = max(max(candidate_hp_degrees(cluster, model, gpu)) for gpu in cluster.gpu_types)
    degrees, d = [], 1
    while d < largest:
        degrees.append(d)
        d *= 2
    degrees.append(largest)
    candidates = [first]
    for degree in degrees:
        capped = {
            gpu: min(degree, max(candidate_hp_degrees(cluster, model, gpu)))
            for gpu in cluster.gpu_types
        }
        choice = GlobalChoices(capped, "bandwidth", None, checkpointing)
        if all(choice.key() != c.key() for c in candidates):
            candidates.append(choice)
    if speed_by_type and len(cluster.gpu_types) > 1:
        slowest = min(cluster.gpu_types, key=lambda gpu: speed_by_type[gpu])
        degrees_of = {gpu: 1 for gpu in cluster.gpu_types}
        degrees_of[slowest] = max(candidate_hp_degrees(cluster, model, slowest))
        choice = GlobalChoices(degrees_of, "bandwidth", None, checkpointing)
        if all(choice.key() != c.key() for c in candidates):
            candidates.append(choice)
    return candidates


def form_groups(
    cluster: Cluster,
    hp_degrees: dict[str, int],
    node_groups: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> dict[str, list[Group]]:
    """HP groups of each node: consecutive ranks, `hp_degrees[gpu]` at a time, or in the
    sizes `node_groups` gives the node."""
    groups = {}
    ranks_of = _ranks_by_node(cluster)
    cuts = dict(node_groups)
    for node in cluster.nodes:
        ranks = ranks_of[node.name]
        sizes = cuts.get(node.name)
        if sizes is None:
            degree = hp_degrees[node.gpu]
            groups[node.name] = [
                tuple(ranks[i : i + degree]) for i in range(0, len(ranks), degree)
            ]
        else:
            ends = list(accumulate(sizes))
            groups[node.name] = [tuple(ranks[end - size : end]) for end, size in zip(ends, sizes)]
    return groups


def order_ring(
    cluster: Cluster,
    groups_by_node: dict[str, list[Group]],
    strategy: str,
    speed: dict[str, float],
) -> list[Group]:
    """Groups in ring order. A node's groups stay together (their hops use the node's link);
    `strategy` orders the nodes; `speed` is each GPU type's relative attention speed."""
    names = list(groups_by_node)
    gpu_of = {node.name: node.gpu for node in cluster.nodes}
    if strategy.startswith(EXPLICIT_ORDER_PREFIX):
        names = _explicit_order(strategy, names)
    elif strategy not in RING_ORDERS:
        allowed = ", ".join((*RING_ORDERS, f"{EXPLICIT_ORDER_PREFIX}N1,N2,..."))
        raise ValueError(f"unknown ring order '{strategy}'; allowed: {allowed}")
    elif strategy == "bandwidth":
        names = _bandwidth_order(cluster, names, lambda n: speed[gpu_of[n]])
    elif strategy == "fastest-first":
        names = sorted(names, key=lambda n: -speed[gpu_of[n]])
    elif strategy == "interleaved":
        names = _interleave(sorted(names, key=lambda n: -speed[gpu_of[n]]))
    return [group for name in names for group in groups_by_node[name]]


def explicit_ring_order(node_names: Sequence[str]) -> str:
    """The ring order that visits the nodes in exactly this order."""
    return EXPLICIT_ORDER_PREFIX + ",".join(node_names)


def _explicit_order(strategy: str, names: list[str]) -> list[str]:
    ordered = strategy.removeprefix(EXPLICIT_ORDER_PREFIX).split(",")
    if sorted(ordered) != sorted(names):
        raise ValueError(f"ring order '{strategy}' must name each node once: {', '.join(names)}")
    return ordered


def _interleave(ordered: Sequence[str]) -> list[str]:
    """Fastest, slowest, second fastest, second slowest, ..."""
    result, low, high = [], 0, len(ordered) - 1
    while low <= high:
        result.append(ordered[low])
        if low != high:
            result.append(ordered[high])
        low, high = low + 1, high - 1
    return result


def _bandwidth_order(cluster: Cluster, names: list[str], speed) -> list[str]:
    """A node cycle whose slowest hop is as fast as possible (bottleneck travelling salesman:
    nearest neighbour, then 2-opt), turned so that the slowest hop leads into the faster node:
    the hop into a group carries every block but that group's own, and the fastest group owns
    the largest segment."""
    if len(names) <= 2:
        return sorted(names, key=lambda n: -speed(n))
    order = list(_bandwidth_cycle(cluster, tuple(names)))
    return [names[i] for i in _orient(order, _link_matrix(cluster, tuple(names)), names, speed)]


@lru_cache(maxsize=64)
def _link_matrix(cluster: Cluster, names: tuple[str, ...]) -> np.ndarray:
    """One-direction GB/s between every pair of nodes."""
    return np.array([[cluster.link_GBps(a, b) for b in names] for a in names])


@lru_cache(maxsize=64)
def _bandwidth_cycle(cluster: Cluster, names: tuple[str, ...]) -> tuple[int, ...]:
    links = _link_matrix(cluster, names)
    off_diagonal = links[~np.eye(len(names), dtype=bool)]
    if np.all(off_diagonal == off_diagonal[0]):
        return tuple(range(len(names)))  # every cycle is as good: keep the file order
    return tuple(int(i) for i in _two_opt(links, _nearest_neighbour(links)))


def _cycle_score(links: np.ndarray, order: np.ndarray) -> tuple[float, float]:
    hops = links[order, np.roll(order, -1)]
    return float(hops.min()), float(hops.sum())


def _nearest_neighbour(links: np.ndarray) -> np.ndarray:
    order, left = [0], list(range(1, len(links)))
    while left:
        here = order[-1]
        nearest = max(left, key=lambda n: (links[here, n], -n))
        order.append(nearest)
        left.remove(nearest)
    return np.array(order)


def _two_opt(links: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Reverse segments while that raises (slowest hop, total bandwidth) of the cycle."""
    best, best_score, improved = order, _cycle_score(links, order), True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, len(best)):
                candidate = np.concatenate([best[:i], best[i : j + 1][::-1], best[j + 1 :]])
                score = _cycle_score(links, candidate)
                if score > best_score:
                    best, best_score, improved = candidate, score, True
    return best


def _orient(order: list[int], links: np.ndarray, names: list[str], speed) -> list[int]:
    """Rotate/reverse the cycle so it starts at the node after its slowest hop, choosing the
    direction whose slowest hop leads into the faster node."""

    def slowest_hop(cycle: list[int]) -> tuple[float, int]:
        return min((links[cycle[i - 1], cycle[i]], i) for i in range(len(cycle)))

    cycle = max([order, order[::-1]], key=lambda c: speed(names[c[slowest_hop(c)[1]]]))
    start = slowest_hop(cycle)[1]
    return cycle[start:] + cycle[:start]


def split_heads(total_heads: int, speeds: Sequence[float]) -> list[int]:
    """Integer heads per member minimizing the slowest member's time max(h_i / speed_i), each
    at least one: give heads one at a time to the member that would finish its next one
    soonest (exact for this min-max objective). Ties go to the earlier member."""
    if total_heads < len(speeds):
        raise ValueError(f"{total_heads} heads cannot cover {len(speeds)} group members")
    heads = [1] * len(speeds)
    for _ in range(total_heads - len(speeds)):
        member = min(range(len(speeds)), key=lambda i: ((heads[i] + 1) / speeds[i], i))
        heads[member] += 1
    return heads


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


def attention_speeds(problem: Problem) -> list[float]:
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
        seconds = ((1 + recompute) * forward + backward) * device.compute_slowdown
        speeds.append(UNIT_PAIRS / seconds)
    return speeds
