"""Screening: a candidate's step time from cached busy rates and the local LP, unsimulated.

A rank's busy time (attention, all-to-all, GEMMs, elementwise kernels, casts, loss) grows
with its group's segment and depends on its own group alone: its GPU, its heads, its node's
link. So one simulation of a layout gives the busy seconds per segment token of every group
in it, for any candidate that forms the same group. A *probe* simulates the even layout of
"every GPU type at HP degree d" and fills those rates for all types at once; any mix of
per-type degrees is then scored by the local LP relaxation (memory rows included, the bound
of `local_milp`) plus the non-busy time the probes saw (optimizer, exposed communication).
That screens a candidate in about a millisecond, so the search simulates only the few it
keeps (`search.shortlist`, `search.polish`). The estimate cannot tell ring orders or chunk
quanta apart: those are scored by full evaluation.

Where memory does not bind at the LP's optimum, the optimum comes without an LP
(`search._relaxation`). Cheaper still is `bound_s`, the busy rows alone: a lower bound of the
estimate, so a descent move or a ranking need not estimate a candidate whose bound already
loses (`fastest_estimated` picks what sorting every estimate would). Estimates compare to
TIE_DIGITS significant digits, so the rounding of the LP or the shortcut breaks no tie.

Finer and dearer is `simulated_first_s`: the simulation of the split a full evaluation lays
out first, kept for that evaluation. It sees the ring's waits, which leave the estimate
12-82 % optimistic on plan_quality #0's HP mixes and rank them poorly; the polish re-ranks
its few best-estimated regroupings by it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hexiseq.search._evaluate import Problem, simulated
from hexiseq.search.greedy import (
    GlobalChoices,
    attention_speeds,
    candidate_hp_degrees,
    chunk_quantum,
    form_groups,
    order_ring,
    speed_by_type,
    split_heads,
)
from hexiseq.search.local_milp import (
    ClassPart,
    Group,
    GroupRates,
    busy_bound_s,
    class_parts,
    even_layout,
    first_simulated_s,
    memory_may_bind,
    memory_rules_out_groups,
    parts_bound_s,
    rates_of,
    relaxed_step_s,
)

INFEASIBLE_S = math.inf
BOUND_MARGIN = 1e-9
"""A bound rules a candidate out only when above a step time by more than this (relative):
its last bits are rounding, not evidence."""
TIE_DIGITS = 9
"""Estimates are compared to this many significant digits: two candidates closer than that
tie (the earlier one stays first), whatever rounding the LP or the shortcut left in them."""


def tie_key(seconds: float) -> float:
    """`seconds` to TIE_DIGITS significant digits, for comparing and ranking estimates."""
    return float(f"{seconds:.{TIE_DIGITS - 1}e}") if math.isfinite(seconds) else seconds


def with_checkpointing(problem: Problem, checkpointing: bool) -> Problem:
    """`problem` with activation checkpointing set (its cache shared)."""
    if problem.train.activation_checkpointing == checkpointing:
        return problem
    train = replace(problem.train, activation_checkpointing=checkpointing)
    return replace(problem, train=train)


def resolved_quantum(problem: Problem, choices: GlobalChoices) -> int:
    return choices.chunk_quantum or chunk_quantum(
        problem.train.seq_len, problem.cluster.world_size
    )


def grouping(problem: Problem, choices: GlobalChoices) -> tuple[list[Group], list[list[int]]]:
    """The ring of HP groups the choices form, and each group's heads per member."""
    key = (
        "grouping",
        problem.train,
        tuple(sorted(choices.hp_degrees.items())),
        choices.ring_order,
        choices.node_groups,
    )
    return problem.memo(key, lambda: _grouping(problem, choices))


def _grouping(problem: Problem, choices: GlobalChoices) -> tuple[list[Group], list[list[int]]]:
    groups = order_ring(
        problem.cluster,
        form_groups(problem.cluster, choices.hp_degrees, choices.node_groups),
        choices.ring_order,
        _speed_by_type(problem),
    )
    heads_of = _heads_by_group(problem)
    return groups, [_group_heads(problem, group, heads_of) for group in groups]


def _speeds(problem: Problem) -> dict:
    return problem.memo(("speeds", problem.train), lambda: attention_speeds(problem))


def _speed_by_type(problem: Problem) -> dict[str, float]:
    return problem.memo(
        ("speed by type", problem.train), lambda: speed_by_type(problem.cluster, _speeds(problem))
    )


def _heads_by_group(problem: Problem) -> dict[Group, list[int]]:
    return problem.memo(("heads by group", problem.train), dict)  # one table per step


def _group_heads(problem: Problem, group: Group, heads_of: dict) -> list[int]:
    """The heads of each member of `group` (by the members' speeds), once per step
    (`heads_of`: `_heads_by_group`)."""
    if group not in heads_of:
        speeds = _speeds(problem)
        member_speeds = tuple(speeds[r] for r in group)
        heads_of[group] = problem.memo(
            ("heads", member_speeds), lambda: split_heads(problem.model.heads, member_speeds)
        )
    return heads_of[group]


def estimate_s(problem: Problem, choices: GlobalChoices) -> float:
    """Estimated step seconds of `choices` (INFEASIBLE_S when nothing fits or it cannot be
    laid out), without simulating it."""
    key = ("estimate", choices.key())
    return problem.memo(key, lambda: _estimate_s(problem, choices))


def bound_s(problem: Problem, choices: GlobalChoices) -> float:
    """A lower bound of `estimate_s(problem, choices)` from busy work alone (the estimate
    itself where it is known): a candidate whose bound is no faster than a step time cannot
    beat it, and need not be estimated."""
    if ("estimate", choices.key()) in problem.cache:
        return estimate_s(problem, choices)
    return problem.memo(("bound", choices.key()), lambda: _bound_s(problem, choices))


def _bound_s(problem: Problem, choices: GlobalChoices) -> float:
    parts = _parts_by_type(problem, choices)
    if parts is not None:
        return parts_bound_s(
            parts, problem.train.seq_len // (2 * resolved_quantum(problem, choices))
        )
    priced = _priced(problem, choices)
    return INFEASIBLE_S if priced is None else busy_bound_s(*priced)


def _parts_by_type(problem: Problem, choices: GlobalChoices) -> list[ClassPart] | None:
    """Every GPU type's classes at its HP degree (`local_milp.class_parts`), each type's
    found once per search: a descent's move changes one type's degree, and this bound
    needs no grouping of the whole ring (on 128 GPUs of 8 types it was most of a
    descent's time). None where some group's rates are not known yet, or the sequence
    cannot be laid out, or nodes are cut apart (`GlobalChoices.node_groups`): `_priced` then
    prices the candidate (probing where it may)."""
    if choices.node_groups:
        return None
    problem = with_checkpointing(problem, choices.activation_checkpointing)
    quantum = resolved_quantum(problem, choices)
    if not _laid_out(problem, quantum):
        return None
    kept = problem.memo(("type parts", problem.train), dict)  # one table per step
    parts = []
    for gpu, degree in choices.hp_degrees.items():
        key = (gpu, degree, quantum, choices.ring_order)
        found = kept.get(key) or _type_parts(problem, gpu, degree, quantum, choices.ring_order)
        if found is None:
            return None
        kept[key] = found
        parts += found
    return parts


def _type_parts(
    problem: Problem, gpu: str, degree: int, quantum: int, ring_order: str
) -> list[ClassPart] | None:
    """The classes of one GPU type's groups at HP degree `degree`, with their places in a
    ring of `ring_order` (the nodes' order does not depend on the degrees); None where some
    group's rates are not known yet (once known, they never change: `_fill_from`)."""
    known, places = _known_rates(problem), _node_places(problem, ring_order)
    by_node = form_groups(problem.cluster, dict.fromkeys(problem.cluster.gpu_types, degree))
    groups, where = [], []
    for node in problem.cluster.nodes:
        if node.gpu != gpu:
            continue
        for index, group in enumerate(by_node[node.name]):
            if group not in known:
                return None
            groups.append(group)
            where.append((places[node.name], index))
    heads_of = _heads_by_group(problem)
    heads = [_group_heads(problem, group, heads_of) for group in groups]
    return class_parts(problem, groups, heads, where, [known[g] for g in groups], quantum)


def _node_places(problem: Problem, ring_order: str) -> dict[str, int]:
    """Each node's place in a ring of `ring_order` (`greedy.order_ring`: a node's groups
    stay together, in the node's order)."""

    def places() -> dict[str, int]:
        nodes = {node.name: [node.name] for node in problem.cluster.nodes}
        ordered = order_ring(problem.cluster, nodes, ring_order, _speed_by_type(problem))
        return {name: place for place, name in enumerate(ordered)}

    return problem.memo(("node places", problem.train, ring_order), places)


def memory_binds(problem: Problem, choices: GlobalChoices) -> bool:
    """Whether memory may bind at the optimum `estimate_s(problem, choices)` found (True
    where nothing fits)."""
    priced = _priced(problem, choices)
    return priced is None or memory_may_bind(*priced)


def fastest_estimated(
    problem: Problem, candidates: list[GlobalChoices], count: int, below_s: float = math.inf
) -> list[GlobalChoices]:
    """The `count` candidates of least finite estimate under `below_s`, fastest first (ties,
    `tie_key`, in the given order), as sorting every estimate would pick them, but estimating
    only those whose bound leaves them a chance."""
    order = sorted(range(len(candidates)), key=lambda i: bound_s(problem, candidates[i]))
    kept: list[tuple[float, int]] = []
    for i in order:
        worst_kept_s = sorted(kept)[count - 1][0] if len(kept) >= count else below_s
        if bound_s(problem, candidates[i]) > worst_kept_s * (1 + BOUND_MARGIN):
            break
        seconds = estimate_s(problem, candidates[i])
        if math.isfinite(seconds) and tie_key(seconds) < tie_key(below_s):
            kept.append((tie_key(seconds), i))
    return [candidates[i] for _, i in sorted(kept)[:count]]


def group_rates(
    problem: Problem, groups: list[Group], heads, quantum: int
) -> list[GroupRates] | None:
    """Busy seconds per segment token of each member of each group, probing where needed
    (None when the sequence is too short to lay the groups out)."""
    known = _known_rates(problem)
    rates = []
    for group in groups:
        if group not in known:
            _probe(problem, len(group), quantum)
        if group not in known:  # a group no probe forms (an odd-sized last group)
            _fill_from(problem, groups, heads, quantum)
        if group not in known:
            return None
        rates.append(known[group])
    return rates


def _known_rates(problem: Problem) -> dict[tuple[int, ...], GroupRates]:
    """Group -> its rates, for this search's step (`problem.train`)."""
    return rates_table(problem, problem.train)


def rates_table(problem: Problem, train) -> dict[tuple[int, ...], GroupRates]:
    """Group -> its busy rates found so far for step `train`: one table per step, so a
    lookup hashes the group alone. A table only grows, and an entry, once set, never
    changes (`_fill_from`)."""
    tables = rate_tables(problem)
    table = tables.get(train)
    if table is None:
        table = tables[train] = {}
    return table


def rate_tables(problem: Problem) -> dict:
    """Step (`TrainSpec`) -> its `rates_table`, for every step this search has seen."""
    return problem.memo("rate tables", dict)


def _estimate_s(problem: Problem, choices: GlobalChoices) -> float:
    priced = _priced(problem, choices)
    step_s = None if priced is None else relaxed_step_s(*priced)
    return INFEASIBLE_S if step_s is None else step_s


def _priced(problem: Problem, choices: GlobalChoices) -> tuple | None:
    """(problem with the choices' checkpointing, groups, heads, quantum, busy rates): what
    the estimate and its bound price; None when the sequence cannot be laid out or memory
    alone rules the groups out."""
    problem = with_checkpointing(problem, choices.activation_checkpointing)
    quantum = resolved_quantum(problem, choices)
    if not _laid_out(problem, quantum):
        return None
    groups, heads = grouping(problem, choices)
    known = _known_rates(problem)
    unknown = any(group not in known for group in groups)
    if unknown and memory_rules_out_groups(problem, groups, heads, quantum):
        return None  # nothing fits: no rates to probe for (a probe is a simulation)
    rates = group_rates(problem, groups, heads, quantum)
    return None if rates is None else (problem, groups, heads, quantum, rates)


def _laid_out(problem: Problem, quantum: int) -> bool:
    """Whether the sequence splits into chunks of `quantum` tokens, two per rank at least."""
    seq_len = problem.train.seq_len
    return seq_len % (2 * quantum) == 0 and problem.cluster.world_size * 2 * quantum <= seq_len


def _probe(problem: Problem, degree: int, quantum: int) -> None:
    """Simulate every GPU type at HP degree `degree` (capped per type) and keep the rates."""
    cluster, model = problem.cluster, problem.model
    degrees = {
        gpu: min(degree, max(candidate_hp_degrees(cluster, model, gpu)))
        for gpu in cluster.gpu_types
    }
    key = ("probe", problem.train, tuple(sorted(degrees.items())))
    if key in problem.cache:
        return
    problem.cache[key] = True
    groups, heads = grouping(problem, GlobalChoices(degrees, "file", quantum))
    _fill_from(problem, groups, heads, quantum)


def _fill_from(problem: Problem, groups: list[Group], heads, quantum: int) -> None:
    """Simulate the even layout of `groups` and keep the rates of each group not known yet.
    A group's rates, once found, are kept: with rates that never change, a plan can be
    built ahead of time, in the search's helper, and be the plan this process would build
    later (`shortlist.ahead_of_descents`). On the 16-128 GPU cells another layout's
    simulation gave the groups the same rates to the last bits (at most 4e-16 relative),
    but a group a probe forms only because a node or a type caps it (a node's leftover
    GPU, a lone GPU of its type) is simulated at another segment length in each probe, and
    its rates can differ more: on plan_quality's seed-2037 #1, the A100-80G left over by a
    node of five and the lone H200 read 5.6 % and 6.2 % apart in the degree-1 and degree-4
    probes, and the plan of one set of choices (HP 4/4/1, file order, quantum 256) came out
    4.5 % slower where the degree-1 probe ran first (15,714 against 16,423 tokens/s).
    Keeping such a group's rates from the probe of its own size only made the search's
    plans no better: 315 of the 340 clusters of seeds 2024-2040 within 1 % of their
    exhaustive optima, against 316."""
    layout = even_layout(problem, groups, heads, quantum)
    if layout is None:
        return
    for group, rates in zip(layout.groups, rates_of(simulated(problem, layout), layout)):
        _known_rates(problem).setdefault(group, rates)


def simulated_first_s(problem: Problem, choices: GlobalChoices) -> float:
    """`local_milp.first_simulated_s` of `choices`: a ranking finer than the estimate (it sees
    the ring's waits) at part of a full evaluation's cost, which that evaluation reuses."""
    key = ("first simulated", choices.key())
    return problem.memo(key, lambda: _simulated_first_s(problem, choices))


def is_first_simulated(problem: Problem, choices: GlobalChoices) -> bool:
    """Whether `simulated_first_s(problem, choices)` is known already."""
    return ("first simulated", choices.key()) in problem.cache


def _simulated_first_s(problem: Problem, choices: GlobalChoices) -> float:
    priced = _priced(problem, choices)
    step_s = None if priced is None else first_simulated_s(*priced)
    return INFEASIBLE_S if step_s is None else step_s
