"""The polish: a deterministic local search from the study's best trials.

From each start (the best trial first, then the next best, up to POLISH_STARTS, each within
POLISH_START_GAP of the fastest plan reached so far) it looks at
every choice set that differs in one decision (one GPU type's HP degree, one node's own cut
into groups on small clusters, `NODE_CUTS_UP_TO`, checkpointing, the ring's layout:
ring-order strategy or two neighbouring nodes swapped, at every chunk quantum)
and moves to the fastest while that beats the current plan. Ring layouts, which the screen
cannot tell apart, are evaluated first, once per distinct ring (up to rotation and swaps of
nodes that look alike, `_ring_shape`) and quantum: every ring at the current quantum and the
current ring at the others, then the regroupings the screen (`search.screen`) estimates
faster than the current plan runs, the best POLISH_SCREENED of them (on clusters up to
POLISH_RERANKED_UP_TO devices the POLISH_PRERANKED best estimated, re-ranked by the
simulation of their first split, `screen.simulated_first_s`, which sees the ring's waits
that the estimate misses, and the best POLISH_RERANKED of those); once those are scored,
the other quanta of the POLISH_RING_FINALISTS rings fastest at the current quantum (an order
may win only at another quantum). Full evaluations are capped by `polish_evaluations` (they
cost about in proportion to the devices) and by the caller's deadline. The polish scores
plans outside the study (it records no trials), so a trial count stays exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    RING_ORDERS,
    GlobalChoices,
    candidate_hp_degrees,
    degree_cut,
    explicit_ring_order,
    with_node_groups,
)
from hexiseq.search.screen import (
    fastest_estimated,
    grouping,
    is_first_simulated,
    resolved_quantum,
    simulated_first_s,
    tie_key,
    with_checkpointing,
)
from hexiseq.search.shortlist import screen_degrees

POLISH_MAX_EVALUATIONS = 16
POLISH_DEVICE_EVALUATIONS = 384
"""The polish evaluates at most POLISH_MAX_EVALUATIONS neighbours in full, and
POLISH_DEVICE_EVALUATIONS / devices on larger clusters (none from 512 devices up). With the
ring finalists and the re-ranking (below), 16 keeps all 20 plan_quality clusters within 1 %
of the exhaustive optimum (19 without the re-ranking), and on 8 other draws of 20 (seeds
2025-2032) as many within 1 % as without it, with no larger worst gap. The re-ranking's
simulations count against it (FIRST_SIMULATION_COST); 14 left seeds 2025 and 2029 one
cluster more short of 1 % each."""
POLISH_STARTS = 3
POLISH_START_GAP = 0.08
"""A start after the first is polished only where it runs within this fraction of the
fastest plan the polish has reached so far (its own moves included). Over plan_quality's
200 random clusters of seeds 2024-2033, a later start that ended faster than the plan before
it began at most 5.0 % behind it, with one exception (2030 #0: 17.5 % behind, 0.15 % faster
at the end); those further behind spent 299 of the 3,638 full evaluations. Leaving them out
made 4 of seed 2024's clusters do fewer (#5 15 -> 8, #10 14 -> 8, #12 20 -> 10, #14 10 -> 4),
the 200 searches 7.1 % fewer evaluations and 5.5 % fewer simulations in all, and changed one
plan (2030 #0, 0.15 % slower); as many clusters stayed within 1 % of the optimum (184), and
the 16 planner-scaling cells of 16-128 GPUs and plan_quality_medium's 12 random clusters
kept their plans. On the 140 clusters of seeds 2034-2040, not looked at in choosing it: the
same plans, 10.7 % fewer evaluations (43 clusters fewer, none more)."""
POLISH_SCREENED = 4
POLISH_RERANKED_UP_TO = 16
POLISH_PRERANKED = 5
POLISH_RERANKED = 2
"""On clusters up to POLISH_RERANKED_UP_TO devices the regroupings estimated fastest
(POLISH_PRERANKED) are simulated at their first split, and the POLISH_RERANKED fastest there
are evaluated in full; on larger ones the POLISH_SCREENED best estimated. The estimate
ranks neighbours poorly: on plan_quality #0 its Spearman correlation with the simulated step
over the 36 HP mixes is 0.23 (the estimates span 4 %, the steps 63 %: the ring's waits).
Over 219 polish batches (10 planner-scaling cells and the 100 plan-quality clusters of 5
draws) the best two of five by first simulation missed the best of the eight best estimated
in 1 batch; the estimate's best four, evaluated in full before, missed it in 5. Four instead
of five missed it in 6, and plan_quality #0 by 2.3 %. On 24-64 GPUs (plan_quality_medium's
20 clusters) and the 128-GPU planner cells the re-ranking found the very same plans, while
its simulations, run in this process as the helper builds rings, cost 8-25 % of a 32-GPU
search: there the estimate alone ranks them."""
POLISH_FIRST_SLACK = 1.2
"""A regrouping whose first simulation is over this x the current plan's step is not
evaluated in full. Of the 720 regroupings of those batches, scored both ways, the full
solve's step was at least 0.91x the first simulation's in 95 % (0.52x at the least), and
every one that beat the current plan had simulated at most 1.17x its step at the first
split."""
FIRST_SIMULATION_COST = 0.5
"""A re-ranking simulation of a regrouping that is not then evaluated, in full evaluations
of the polish's cap: it lays out and simulates one split, where an evaluation (of 16 GPUs)
also solves the MILP and builds the plan, in about twice the time. At 0.75 or 1, seeds 2025
and 2029 had one cluster more short of 1 % each."""
POLISH_RING_FINALISTS = 2
"""Rings evaluated at every quantum: the fastest at the current one (the current ring among
them where it is). On 18 planner-scaling cells of 16-128 GPUs and the 20 plan_quality
clusters, every ring at every quantum would find plans at most 0.17 % faster (at 3 finalists,
none), with 13-22 evaluations where there were 29."""

Scored = tuple[GlobalChoices, Plan | InfeasiblePlan]


def polish_evaluations(world_size: int) -> int:
    """How many neighbours the polish may evaluate in full on `world_size` devices."""
    return min(POLISH_MAX_EVALUATIONS, POLISH_DEVICE_EVALUATIONS // world_size)


def polish(
    problem: Problem,
    starts: list[tuple[GlobalChoices, float]],
    plan_of: Callable[[GlobalChoices], Plan | InfeasiblePlan],
    plans_of: Callable[..., tuple[list[GlobalChoices], list[Plan | InfeasiblePlan]]],
    is_scored: Callable[[GlobalChoices], bool],
    quanta: list[int],
    evaluations: int,
    deadline: float | None,
) -> list[Scored]:
    """Local search from `starts` ((choices, tokens/s), best first; those more than
    POLISH_START_GAP behind the fastest plan reached are not polished); returns what it
    scored. `plan_of` builds (and remembers) a candidate's plan, `plans_of(batch, more)`
    those of `batch + more()` (the same plans, built together, `batch`'s started before
    `more` finds the rest: `Objective.plans`), `is_scored` says whether it already has one;
    `deadline` is a perf_counter time or None."""
    scored: list[Scored] = []
    left = float(evaluations)  # a re-ranking simulation costs FIRST_SIMULATION_COST of one
    fastest = starts[0][1] if starts else 0.0  # tokens/s: the starts come fastest first
    for current, score in starts[:POLISH_STARTS]:
        if score < fastest * (1.0 - POLISH_START_GAP):
            continue
        while left >= 1 and (deadline is None or time.perf_counter() < deadline):
            current_plan = plan_of(current)
            fresh = neighbours(problem, current, quanta, current_plan)
            simulations = [0]
            rings, faster, later = _worth_evaluating(
                problem, current, current_plan, fresh, is_scored, simulations
            )
            batch = rings[: int(left)]
            room = min(_regrouped_per_move(problem), int(left) - len(batch))
            # the screen is asked only where there is room, while the rings are built
            batch, plans = plans_of(batch, partial(faster, room) if room > 0 else None)
            left -= len(batch) + FIRST_SIMULATION_COST * simulations[0]
            second, second_plans = plans_of(later(plan_of)[: max(0, int(left))])
            left -= len(second)
            plans += second_plans
            batch += second
            if not batch:
                break
            scored += list(zip(batch, plans))
            speeds = [throughput(plan) for plan in plans]
            top = max(range(len(batch)), key=speeds.__getitem__)
            if speeds[top] <= score:
                break
            current, score = batch[top], speeds[top]
            fastest = max(fastest, score)
    return scored


def _regrouped_per_move(problem: Problem) -> int:
    """How many regrouped neighbours a move evaluates in full at most."""
    small = problem.cluster.world_size <= POLISH_RERANKED_UP_TO
    return POLISH_RERANKED if small else POLISH_SCREENED


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
            found.append(_with_degree(problem, choices, gpu, degree))
    found += _node_cuts(problem, choices)
    unique = {c.key(): c for c in found if c.key() != choices.key()}
    return list(unique.values())


def _with_degree(problem: Problem, choices: GlobalChoices, gpu: str, degree: int):
    """`choices` with `gpu`'s HP degree set, its nodes cut by it again (no own cuts)."""
    of_type = {node.name for node in problem.cluster.nodes if node.gpu == gpu}
    cuts = tuple((node, sizes) for node, sizes in choices.node_groups if node not in of_type)
    return replace(choices, hp_degrees={**choices.hp_degrees, gpu: degree}, node_groups=cuts)


NODE_CUTS_UP_TO = 16
"""On clusters up to this many devices the polish also cuts single nodes into groups of
their own sizes (`GlobalChoices.node_groups`): every partition of a node whose type's degree
leaves it groups of unequal sizes (or that has its own cut already), screened and re-ranked
like the other regroupings. One degree per type cannot express such winners: on
plan_quality's 20 clusters (seed 2024), #4's exhaustive optimum cuts a node of five A100s
2+1+1+1, where degree 4 leaves 4+1."""


def _node_cuts(problem: Problem, choices: GlobalChoices) -> list[GlobalChoices]:
    """Each node of unequal groups (or of its own cut) cut every other way, sizes
    descending, none over the type's largest HP degree."""
    cluster = problem.cluster
    if cluster.world_size > NODE_CUTS_UP_TO:
        return []
    cuts = dict(choices.node_groups)
    found = []
    for node in cluster.nodes:
        current = cuts.get(node.name) or degree_cut(node.count, choices.hp_degrees[node.gpu])
        if node.name not in cuts and len(set(current)) == 1:
            continue  # equal groups: the type's degree moves reach the other even cuts
        largest = max(candidate_hp_degrees(cluster, problem.model, node.gpu))
        for sizes in partitions(node.count, min(node.count, largest)):
            if sizes != current:
                found.append(with_node_groups(cluster, choices, node.name, sizes))
    return found


def partitions(total: int, largest: int) -> list[tuple[int, ...]]:
    """Every way to write `total` as a sum of parts of at most `largest`, parts descending."""
    if total == 0:
        return [()]
    return [
        (part, *rest)
        for part in range(min(total, largest), 0, -1)
        for rest in partitions(total - part, part)
    ]


def _worth_evaluating(
    problem: Problem,
    current: GlobalChoices,
    current_plan: Plan | InfeasiblePlan,
    found: list[GlobalChoices],
    is_scored: Callable[[GlobalChoices], bool],
    simulations: list[int] | None = None,
) -> tuple[list[GlobalChoices], Callable[[int], list], Callable[[Callable], list]]:
    """The neighbours `found` worth evaluating, in two stages. First the ring layouts, which
    the screen cannot tell apart (they leave the loads the search settled on): the current
    ring at the other quanta, and every other ring at the current quantum; then (a function
    of how many: the screen's estimates are not asked for where the rings use up the
    evaluations) the regrouped neighbours estimated faster than the current plan runs, the
    best up to `_regrouped_per_move` (re-ranked by simulation on small clusters).
    Second (given `plan_of`, once the first are scored): the other quanta of the
    POLISH_RING_FINALISTS rings fastest at the current quantum. Neighbours already scored
    are left out of both. `simulations[0]` counts the re-ranking's simulations of
    regroupings that are not then evaluated (the others' start their evaluation)."""
    here, quantum = _ring_key(problem, current)
    rings: dict[tuple, GlobalChoices] = {}  # one neighbour per distinct ring and quantum,
    for choices in found:  # a scored one where there is one (its plan is known)
        if _grouping_key(choices) == _grouping_key(current):
            key = _ring_key(problem, choices)
            if key not in rings or (is_scored(choices) and not is_scored(rings[key])):
                rings[key] = choices
    rings.pop((here, quantum), None)
    regrouped = [
        c for c in found if _grouping_key(c) != _grouping_key(current) and not is_scored(c)
    ]
    current_s = step_s(current_plan)

    def faster(count: int) -> list[GlobalChoices]:
        if problem.cluster.world_size > POLISH_RERANKED_UP_TO:
            found = fastest_estimated(problem, regrouped, POLISH_SCREENED, below_s=current_s)
            return found[:count]
        found = fastest_estimated(problem, regrouped, POLISH_PRERANKED, below_s=current_s)
        fresh = {c.key() for c in found if not is_first_simulated(problem, c)}
        chosen = _first_simulated_best(problem, found, current_s)[:count]
        if simulations is not None:
            simulations[0] += len(fresh - {c.key() for c in chosen})
        return chosen

    first = [c for (ring, _), c in rings.items() if ring == here and not is_scored(c)]
    first += [c for (r, q), c in rings.items() if r != here and q == quantum and not is_scored(c)]

    def second(plan_of: Callable) -> list[GlobalChoices]:
        at_quantum = [(throughput(current_plan), here)]
        for (ring, q), choices in rings.items():
            if q == quantum and is_scored(choices):
                at_quantum.append((throughput(plan_of(choices)), ring))
        at_quantum.sort(key=lambda scored_ring: -scored_ring[0])  # stable: ties keep order
        finalists = {ring for _, ring in at_quantum[:POLISH_RING_FINALISTS]}
        return [c for (r, q), c in rings.items() if r in finalists and not is_scored(c)]

    return first, faster, second


def _first_simulated_best(
    problem: Problem, found: list[GlobalChoices], current_s: float
) -> list[GlobalChoices]:
    """`found` by the simulated step of its first split (`screen.simulated_first_s`; ties
    keep the estimate's order), the best POLISH_RERANKED, without those over
    POLISH_FIRST_SLACK x `current_s`. One whose first split cannot be laid out (the full
    solve may still find one, by branch and bound) stays, last."""
    first_s = {c.key(): simulated_first_s(problem, c) for c in found}
    ranked = sorted(found, key=lambda c: tie_key(first_s[c.key()]))
    slack_s = current_s * POLISH_FIRST_SLACK
    kept = [c for c in ranked if first_s[c.key()] <= slack_s or math.isinf(first_s[c.key()])]
    return kept[:POLISH_RERANKED]


def step_s(plan: Plan | InfeasiblePlan) -> float:
    """A plan's predicted step seconds (infinite for one that cannot run)."""
    return plan.predicted.step_time_s if isinstance(plan, Plan) else math.inf


def _grouping_key(choices: GlobalChoices) -> tuple:
    degrees = tuple(sorted(choices.hp_degrees.items()))
    return degrees, choices.node_groups, choices.activation_checkpointing


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
