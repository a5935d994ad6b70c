"""The default search's short list: the greedy picks and their neighbours, screened.

The greedy stage proposes a handful of global choices (`greedy.greedy_candidates`, with and
without activation checkpointing). Each is screened (`search.screen`: cached busy rates and
the local LP, no simulation), then, for each checkpointing setting, a coordinate descent on
the screen moves one GPU type's HP degree at a time while the estimate improves. Each pick
keeps the recompute where it does not fit without it, or where memory binds without it and
the screen estimates it faster with it (`_lightest`), and each descent starts from the picks
of its own setting. Where a pick fits and memory does not bind, the recompute is pure cost:
on 1024 GPUs of 8 types not descending with it saves four checkpointed probes, one of them a
simulation of 1024 ring steps, and 0.25 s of a 1 s search; where every pick keeps it (64
GPUs of 8 types at 1M tokens), no descent goes without it. The greedy
picks and the best-screened candidates of each descent (SCREEN_KEEP) are what the search
evaluates in full. The screen misses the ring's exposed waits (it is 10-35 % optimistic for
low HP degrees) and prices each group by its rates at even loads (it can also be 44 %
pessimistic: b200x16 / llama2-13b / 128K without checkpointing), so it ranks candidates but
never rules one out by itself. Leaving out the short list's candidates whose estimate lost
to a plan already scored was tried: it cost one plan_quality cluster 16 % (a left-out
candidate was a start the polish needed). Only a candidate estimated more than
HOPELESS_RATIO times slower than a plan already scored is left out (`hopeless`): on 1024
GPUs the low HP degrees the descent tries run 6-7x slower than the best, and each costs a
simulation of up to 1024 ring steps. From CLOSE_FROM devices, where the polish has few
evaluations and spends them on the best start, the bar is CLOSE_RATIO times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from hexiseq.search import helper
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    GlobalChoices,
    attention_speeds,
    candidate_hp_degrees,
    greedy_candidates,
    speed_by_type,
)
from hexiseq.search.screen import (
    BOUND_MARGIN,
    bound_s,
    estimate_s,
    fastest_estimated,
    memory_binds,
    rates_table,
    tie_key,
    with_checkpointing,
)

SCREEN_KEEP = 1
"""Screened candidates evaluated in full per checkpointing setting besides the greedy picks. One
since the polish tries every ring at the current quantum first: with 3, all 20
plan_quality clusters kept the same worst gap (0.98 %), 48 of 50 other searches the same
plan (the other two 0.03 and 0.13 % faster), and searches took 2-12 % longer."""
SCREEN_SWEEPS = 2
HOPELESS_RATIO = 2.0
"""A candidate whose estimate is over HOPELESS_RATIO x a scored step time is not scored (on
clusters below CLOSE_FROM devices: `hopeless_ratio`). Over
the 4,707 distinct candidates scored in 201 default searches (the 16 planner-scaling cells,
65 preset searches and 120 plan_quality clusters of seeds 2024-2029) the estimate was at most
1.442x the simulated step (93 over 1.3x), so such a candidate runs at least 1.39x slower.
At 1.5 (tried before `_lightest`, when 64 GPUs of 8 types still scored its uniform picks
without the recompute) it left that cell 4 plans fewer to build (-18 % in one process, the
same plans on 80 plan_quality and 20 plan_quality_medium clusters), but with 4 % to spare
against that 1.442: kept at 2. With `_lightest` that cell builds 12 plans at either."""
CLOSE_RATIO = 1.05
CLOSE_FROM = 64
"""From CLOSE_FROM devices a candidate estimated over CLOSE_RATIO x a scored step time is not
scored. There the polish evaluates at most 6 plans (`polish.polish_evaluations`), nearly all
from the best start, so a short-list candidate counts only if it beats the plans scored
before it. The estimate is no bound (on 64-256 GPUs it reads up to 1.56x a candidate's
simulated step), but it ranks candidates against a scored plan: over the 1,808 candidates
scored after the first in 600 default searches on random clusters of 64-256 GPUs (8-GPU
nodes of 1-6 of 10 types, 12.5-100 GB/s, five models, 128K-1M tokens), none estimated over
0.98x the fastest step scored before it beat it, and those estimated over 1.05x ran at least
4.1 % slower than it (on 600 other random clusters, held out: 0.976x and 4.95 %). The best
plans of those 1,200 searches, of the planner-scaling cells of 64-512 GPUs and of
plan_quality_medium's clusters are the same with this bar as with HOPELESS_RATIO. From 16
devices it made 3 of 600 plans of 16-48 GPUs up to 1.7 % slower."""
SCREEN_ALL_DEGREES = 8
SCREEN_ALL_DEGREES_UP_TO = 32
"""Clusters up to this many devices screen every HP degree; larger ones the powers of two and
the largest. At 64 it made 64 GPUs of 8 types 0.85 s against 0.60 s, for the same plans on
the 12 planner-scaling cells of 64 GPUs and 16 random clusters of 33-64 GPUs."""


def shortlist(
    problem: Problem,
    quanta: list[int],
    ahead: Callable[[list[GlobalChoices]], None] | None = None,
) -> list[GlobalChoices]:
    """The greedy picks (each without activation checkpointing where the screen finds that
    it fits and estimates it no slower, `_lightest`) and, for each checkpointing setting, the
    SCREEN_KEEP best-screened candidates of a descent from the best pick: the greedy default
    first, the others in order of estimate. Where the descents stay in this process, `ahead`
    is first given the picks that can be built at once (`ahead_of_descents`)."""
    quantum = quanta[len(quanta) // 2]
    picks = [_lightest(problem, c, quanta) for c in _greedy_seeds(problem, quantum)]
    chosen = {c.key(): c for c in picks}
    descents = []
    for checkpointing in problem.checkpointing_options:
        # each descent from the picks the screen prefers with its checkpointing setting
        starts = [c for c in picks if c.activation_checkpointing == checkpointing]
        if starts:
            descents.append(starts)
    # the picks' estimates are asked for here only where the descents stay in this process
    early = None if ahead is None else partial(_ahead_of_descents, ahead, problem, picks)
    for found in _descents(problem, descents, early):
        chosen.update((c.key(), c) for c in found)
    default, *others = chosen.values()
    finite = [c for c in others if math.isfinite(estimate_s(problem, c))]
    infinite = [c for c in others if not math.isfinite(estimate_s(problem, c))]
    return [default, *sorted(finite, key=lambda c: tie_key(estimate_s(problem, c))), *infinite[:1]]


def ahead_of_descents(problem: Problem, picks: list[GlobalChoices]) -> list[GlobalChoices]:
    """The picks whose plans can be built before the descents end, in the order the short
    list will have them (the default first, then by estimate): those with a finite estimate,
    whose groups' busy rates are known (and never change: `screen._fill_from`), so their
    plans are the same whenever they are built."""
    default, *others = {c.key(): c for c in picks}.values()
    finite = [c for c in others if math.isfinite(estimate_s(problem, c))]
    ordered = [default, *sorted(finite, key=lambda c: tie_key(estimate_s(problem, c)))]
    return [c for c in ordered if math.isfinite(estimate_s(problem, c))]


def _ahead_of_descents(ahead: Callable, problem: Problem, picks: list[GlobalChoices]) -> None:
    ahead(ahead_of_descents(problem, picks))


def hopeless(problem: Problem, choices: GlobalChoices, best_step_s: float) -> bool:
    """Whether `choices` is estimated over `hopeless_ratio` x slower than `best_step_s`, the
    fastest step time already scored (math.inf: none yet)."""
    ratio = hopeless_ratio(problem.cluster.world_size)
    return estimate_s(problem, choices) > ratio * best_step_s


def hopeless_ratio(devices: int) -> float:
    """HOPELESS_RATIO, or CLOSE_RATIO on clusters of CLOSE_FROM devices or more."""
    return CLOSE_RATIO if devices >= CLOSE_FROM else HOPELESS_RATIO


def _descended(problem: Problem, starts: list[GlobalChoices]) -> list[GlobalChoices]:
    """The best-screened candidates of a descent over HP degrees from the best start."""
    scored = {c.key(): c for c in starts}
    if not _moves(problem, starts):
        return []
    best = min(starts, key=lambda c: tie_key(estimate_s(problem, c)))
    for _ in range(SCREEN_SWEEPS):
        moved = _descend(problem, best, scored)
        if moved.key() == best.key():
            break
        best = moved
    return fastest_estimated(problem, list(scored.values()), SCREEN_KEEP)


def _moves(problem: Problem, starts: list[GlobalChoices]) -> bool:
    """Whether a descent from `starts` goes anywhere: some start fits (a finite estimate)."""
    return any(math.isfinite(estimate_s(problem, c)) for c in starts)


def _descents(
    problem: Problem, descents: list[list[GlobalChoices]], early: Callable[[], None] | None
) -> list[list]:
    """`_descended` of each of `descents` (at most one per checkpointing setting): the last
    one in the search's helper (`search.helper`) where it has one, while this process runs
    the others (else `early()` first, which may give the helper other work). A descent keeps
    to its own step (`problem.train` with its checkpointing): its busy rates, probes and
    estimates are that step's, so the two never see each other's, and the helper's are
    taken in here as if found here."""
    moving = [starts for starts in descents if _moves(problem, starts)]
    ticket = None
    if len(moving) > 1:  # a descent that ends at once is not worth waiting for
        ticket = helper.start(problem, _descended_beside, descents[-1])
    if ticket is None:
        if early is not None:
            early()
        return [_descended(problem, starts) for starts in descents]
    started_s = time.perf_counter()
    found = [_descended(problem, starts) for starts in descents[:-1]]
    wait_s = max(DESCENT_MIN_WAIT_S, DESCENT_WAIT_FACTOR * (time.perf_counter() - started_s))
    answer = helper.result(problem, ticket, wait_s)
    if answer is None:
        return [*found, _descended(problem, descents[-1])]
    last, memos, (train, found_rates) = answer[0]
    for key, value in memos.items():
        problem.cache.setdefault(key, value)
    table = rates_table(problem, train)
    for group, rates in found_rates.items():  # rates, once found, are kept (`screen._fill_from`)
        table.setdefault(group, rates)
    return [*found, last]


DESCENT_MEMOS = ("estimate", "bound", "probe")
"""The `Problem.cache` entries of a descent in the helper that come back with its answer,
beside its step's busy rates: those the order of scoring changes (the probes that found the
rates) and those the short list reads again (estimates and bounds); the rest are recomputed
here if asked."""
DESCENT_WAIT_FACTOR = 4.0
DESCENT_MIN_WAIT_S = 2.0
"""How long this process waits for the helper's descent once its own are done: this factor x
their seconds, at least DESCENT_MIN_WAIT_S; then it runs that descent itself."""


def _descended_beside(problem: Problem, starts: list[GlobalChoices]) -> tuple[list, dict, tuple]:
    """In the helper: `_descended(problem, starts)`, the memos it made (DESCENT_MEMOS) and
    its step's busy rates, `(train, rates_table)`."""
    before = set(problem.cache)
    found = _descended(problem, starts)
    train = with_checkpointing(problem, starts[0].activation_checkpointing).train
    memos = {
        key: value
        for key, value in problem.cache.items()
        if isinstance(key, tuple) and key[0] in DESCENT_MEMOS and key not in before
    }
    return found, memos, (train, rates_table(problem, train))


def _lightest(problem: Problem, choices: GlobalChoices, quanta: list[int]) -> GlobalChoices:
    """`_without_recompute(choices)`, unless memory binds there and the screen estimates
    `choices` with the recompute faster: memory then limits the split, and recomputing
    frees it (64 GPUs of 8 types at 1M tokens: uniform HP 4 is estimated at 92.1 s without,
    50.6 s with, and runs 98.7 and 52.0 s)."""
    lighter = _without_recompute(problem, choices, quanta)
    heavier = replace(choices, activation_checkpointing=True)
    if lighter.activation_checkpointing or True not in problem.checkpointing_options:
        return lighter
    if not memory_binds(problem, lighter):
        return lighter  # the busy optimum is reached: the recompute only adds to it
    if tie_key(estimate_s(problem, heavier)) < tie_key(estimate_s(problem, lighter)):
        return heavier
    return lighter


def _without_recompute(
    problem: Problem, choices: GlobalChoices, quanta: list[int]
) -> GlobalChoices:
    """`choices` without activation checkpointing where the screen finds a quantum at which
    that fits (the middle one, else smaller ones: their rounding margins are smaller)."""
    if False not in problem.checkpointing_options:
        return choices
    middle = quanta.index(choices.chunk_quantum) if choices.chunk_quantum in quanta else 0
    for quantum in reversed(quanta[: middle + 1]):
        lighter = replace(choices, activation_checkpointing=False, chunk_quantum=quantum)
        if math.isfinite(estimate_s(problem, lighter)):
            return lighter
    return choices


def screen_degrees(problem: Problem, gpu: str) -> list[int]:
    """HP degrees the screen tries for one type: every allowed one (up to SCREEN_ALL_DEGREES
    of them, on clusters up to SCREEN_ALL_DEGREES_UP_TO devices, where a probe is cheap),
    else the powers of two and the largest."""
    allowed = candidate_hp_degrees(problem.cluster, problem.model, gpu)
    small = problem.cluster.world_size <= SCREEN_ALL_DEGREES_UP_TO
    if small and len(allowed) <= SCREEN_ALL_DEGREES:
        return allowed
    powers = [d for d in allowed if d & (d - 1) == 0]
    return sorted({*powers, max(allowed)})


def _greedy_seeds(problem: Problem, quantum: int) -> list[GlobalChoices]:
    speeds = problem.memo(("speeds", problem.train), lambda: attention_speeds(problem))
    by_type = speed_by_type(problem.cluster, speeds)
    checkpointing = True in problem.checkpointing_options
    found = greedy_candidates(problem.cluster, problem.model, checkpointing, by_type)
    return [replace(c, chunk_quantum=quantum) for c in found]


def _descend(problem: Problem, start: GlobalChoices, scored: dict) -> GlobalChoices:
    """One sweep: each type's HP degree in turn, kept where the estimate improves."""
    best, best_s = start, estimate_s(problem, start)
    for gpu in problem.cluster.gpu_types:
        for degree in screen_degrees(problem, gpu):
            candidate = replace(best, hp_degrees={**best.hp_degrees, gpu: degree})
            best, best_s = _better(problem, candidate, best, best_s, scored)
    return best


def _better(problem, candidate, best, best_s, scored):
    scored.setdefault(candidate.key(), candidate)
    if bound_s(problem, candidate) > best_s * (1 + BOUND_MARGIN):
        return best, best_s  # it cannot be faster: left unestimated
    seconds = estimate_s(problem, candidate)
    return (candidate, seconds) if tie_key(seconds) < tie_key(best_s) else (best, best_s)
