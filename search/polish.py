"""The polish: a deterministic local search from the study's best trials.

From each start (the best trial first, then the next best, up to POLISH_STARTS) it looks at
every choice set that differs in one decision (one GPU type's HP degree, checkpointing, the
ring's layout: ring-order strategy or two neighbouring nodes swapped, at every chunk quantum)
and moves to the fastest while that beats the current plan. Ring layouts, which the screen
cannot tell apart, are evaluated first, once per distinct ring (up to rotation and swaps of
nodes that look alike, `_ring_shape`) and quantum; then the regroupings the screen
(`search.screen`) estimates faster than the current plan runs, the best POLISH_SCREENED of
them. Full evaluations are capped by `polish_evaluations` (they cost about in proportion to
the devices) and by the caller's deadline. The polish scores plans outside the study (it
records no trials), so a trial count stays exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    RING_ORDERS,
    GlobalChoices,
    explicit_ring_order,
)
from hexiseq.search.screen import (
    fastest_estimated,
    grouping,
    resolved_quantum,
    with_checkpointing,
)
from hexiseq.search.shortlist import screen_degrees

POLISH_MAX_EVALUATIONS = 24
POLISH_DEVICE_EVALUATIONS = 384
"""The polish evaluates at most POLISH_MAX_EVALUATIONS neighbours in full, and
POLISH_DEVICE_EVALUATIONS / devices on larger clusters (none from 512 devices up)."""
POLISH_STARTS = 3
POLISH_SCREENED = 4

Scored = tuple[GlobalChoices, Plan | InfeasiblePlan]


def polish_evaluations(world_size: int) -> int:
    """How many neighbours the polish may evaluate in full on `world_size` devices."""
    return min(POLISH_MAX_EVALUATIONS, POLISH_DEVICE_EVALUATIONS // world_size)


def polish(
    problem: Problem,
    starts: list[tuple[GlobalChoices, float]],
    plan_of: Callable[[GlobalChoices], Plan | InfeasiblePlan],
    is_scored: Callable[[GlobalChoices], bool],
    quanta: list[int],
    evaluations: int,
    deadline: float | None,
) -> list[Scored]:
    """Local search from `starts` ((choices, tokens/s), best first); returns what it
    scored. `plan_of` builds (and remembers) a candidate's plan, `is_scored` says whether
    it already has one; `deadline` is a perf_counter time or None."""
    scored: list[Scored] = []
    for current, score in starts[:POLISH_STARTS]:
        while evaluations > 0 and (deadline is None or time.perf_counter() < deadline):
            current_plan = plan_of(current)
            fresh = neighbours(problem, current, quanta, current_plan)
            batch = _worth_evaluating(
                problem, current, current_plan, [c for c in fresh if not is_scored(c)]
            )
            batch = batch[:evaluations]
            if not batch:
                break
            evaluations -= len(batch)
            plans = [plan_of(choices) for choices in batch]
            scored += list(zip(batch, plans))
            speeds = [throughput(plan) for plan in plans]
            top = max(range(len(batch)), key=speeds.__getitem__)
            if speeds[top] <= score:
                break
            current, score = batch[top], speeds[top]
    return scored


def throughput(plan: Plan | InfeasiblePlan) -> float:
    return plan.predicted.tokens_per_s if isinstance(plan, Plan) else 0.0


def neighbours(
    problem: Problem, choices: GlobalChoices, quanta: list[int], plan: Plan | InfeasiblePlan
) -> list[GlobalChoices]:
    """Every choice set that differs from `choices` in one decision: checkpointing, the
    ring's layout (ring-order strategy or two neighbouring nodes of `plan`'s ring swapped,
    each at every quantum: an order may win only at another quantum), then each GPU type's
    HP degree."""
    found = [replace(choices, activation_checkpointing=c) for c in problem.checkpointing_options]
    orders = [choices.ring_order, *RING_ORDERS, *_node_swaps(plan)]
    found += [replace(choices, ring_order=order) for order in orders]
    found += [replace(choices, ring_order=o, chunk_quantum=q) for q in quanta for o in orders]
    for gpu in problem.cluster.gpu_types:
        for degree in screen_degrees(problem, gpu):
            found.append(replace(choices, hp_degrees={**choices.hp_degrees, gpu: degree}))
    unique = {c.key(): c for c in found if c.key() != choices.key()}
    return list(unique.values())


def _worth_evaluating(
    problem: Problem,
    current: GlobalChoices,
    current_plan: Plan | InfeasiblePlan,
    fresh: list[GlobalChoices],
) -> list[GlobalChoices]:
    """The ring-order and quantum neighbours that change the ring's layout (the screen
    cannot tell those apart, and they leave the loads the search settled on), then the
    regrouped neighbours estimated faster than the current plan runs, best POLISH_SCREENED
    first."""
    current_s = step_s(current_plan)
    same_grouping = [c for c in fresh if _grouping_key(c) == _grouping_key(current)]
    regrouped = [c for c in fresh if _grouping_key(c) != _grouping_key(current)]
    faster = fastest_estimated(problem, regrouped, POLISH_SCREENED, below_s=current_s)
    here = _ring_key(problem, current)
    seen, reordered = {here}, []
    for choices in same_grouping:
        ring = _ring_key(problem, choices)
        if ring not in seen:
            seen.add(ring)
            reordered.append(choices)
    # the current ring at another quantum first, then other rings
    reordered.sort(key=lambda c: _ring_key(problem, c)[0] != here[0])
    return reordered + faster


def step_s(plan: Plan | InfeasiblePlan) -> float:
    """A plan's predicted step seconds (infinite for one that cannot run)."""
    return plan.predicted.step_time_s if isinstance(plan, Plan) else math.inf


def _grouping_key(choices: GlobalChoices) -> tuple:
    return tuple(sorted(choices.hp_degrees.items())), choices.activation_checkpointing


def _ring_key(problem: Problem, choices: GlobalChoices) -> tuple:
    """What a ring-order or quantum change changes: the ring's shape (`_ring_shape`) and the
    quantum."""
    problem = with_checkpointing(problem, choices.activation_checkpointing)
    groups, heads = grouping(problem, choices)
    shape = problem.memo(
        ("ring shape", problem.train, tuple(groups)), lambda: _ring_shape(problem, groups, heads)
    )
    return shape, resolved_quantum(problem, choices)


def _ring_shape(problem: Problem, groups: list[tuple[int, ...]], heads: list) -> tuple:
    """The cycle of nodes the ring visits, each as all that the local stage and the simulator
    see of it: its GPU model, devices, own link, memory and slowdowns, its groups' sizes and
    heads in ring order, and the link on to the next node. Up to rotation (a rotated ring
    sends every block over the same links), and nodes that look alike are interchangeable:
    two rings that differ by swapping such nodes are the same ring, so the polish evaluates
    one of them (on 48 and 64 GPUs of two types, 40 node orders each made 13 and 18 shapes,
    and the orders of one shape always scored the same, to the last bit)."""
    cluster = problem.cluster
    bandwidth_GBps, latency_s = problem.links()
    index = problem.node_index()
    devices = cluster.devices
    visits: list[tuple[str, list]] = []  # (node, its groups' (size, heads)), in ring order
    for group, group_heads in zip(groups, heads):
        node = devices[group[0]].node
        if not visits or visits[-1][0] != node:
            visits.append((node, []))
        visits[-1][1].append((len(group), tuple(group_heads)))
    ids = problem.memo("ring shape ids", dict)  # one small integer per distinct node look
    items = []
    for k, (name, node_groups) in enumerate(visits):
        node = cluster.nodes[index[name]]
        here, there = index[name], index[visits[(k + 1) % len(visits)][0]]
        look = (
            node.gpu, node.count, node.emulation_slowdown, node.memory_GiB,
            node.measured_slowdown, float(bandwidth_GBps[here, here]),
            float(latency_s[here, here]), tuple(node_groups),
            float(bandwidth_GBps[here, there]), float(latency_s[here, there]),
        )  # fmt: skip
        items.append(ids.setdefault(look, len(ids)))
    return min(tuple(items[i:] + items[:i]) for i in range(len(items)))


def _node_swaps(plan: Plan | InfeasiblePlan) -> list[str]:
    """Explicit ring orders that swap two neighbouring nodes of the plan's ring."""
    if not isinstance(plan, Plan):
        return []
    nodes = [plan.assignments[group[0]].node for group in plan.layout().groups]
    ring = list(dict.fromkeys(nodes))  # a node's groups are consecutive in the ring
    swaps = []
    for i in range(len(ring) - 1):
        swapped = ring[:i] + [ring[i + 1], ring[i]] + ring[i + 2 :]
        swaps.append(explicit_ring_order(swapped))
    return swaps
