"""The default search's short list: the greedy picks and their neighbours, screened.

The greedy stage proposes a handful of global choices (`greedy.greedy_candidates`, with and
without activation checkpointing). Each is screened (`search.screen`: cached busy rates and
the local LP, no simulation), then a coordinate descent on the screen moves one GPU type's
HP degree, or checkpointing, at a time while the estimate improves. The greedy picks and
the SCREEN_KEEP best-screened candidates are what the search evaluates in full.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    GlobalChoices,
    attention_speeds,
    candidate_hp_degrees,
    greedy_candidates,
    speed_by_type,
)
from hexiseq.search.screen import estimate_s

SCREEN_KEEP = 1
"""Screened candidates evaluated in full besides the greedy picks."""
SCREEN_SWEEPS = 3


def shortlist(problem: Problem, quantum: int) -> list[GlobalChoices]:
    """The greedy picks (each without activation checkpointing where the screen finds that
    it fits, since the recompute is then pure cost), the greedy default first, then the
    best-screened candidates of the descent. The screen ranks loads and memory well but not
    the ring's exposed communication, so every greedy pick is evaluated in full."""
    picks = [_without_recompute(problem, c) for c in _greedy_seeds(problem, quantum)]
    scored = {c.key(): c for c in picks}
    best = min(picks, key=lambda c: estimate_s(problem, c))
    for _ in range(SCREEN_SWEEPS):
        moved = _descend(problem, best, scored)
        if moved.key() == best.key():
            break
        best = moved
    ranked = sorted(scored.values(), key=lambda c: estimate_s(problem, c))
    kept = [c for c in ranked if math.isfinite(estimate_s(problem, c))][:SCREEN_KEEP]
    chosen = {c.key(): c for c in picks}
    chosen.update((c.key(), c) for c in kept)
    return list(chosen.values())


def _without_recompute(problem: Problem, choices: GlobalChoices) -> GlobalChoices:
    if False not in problem.checkpointing_options:
        return choices
    lighter = replace(choices, activation_checkpointing=False)
    return lighter if math.isfinite(estimate_s(problem, lighter)) else choices


def screen_degrees(problem: Problem, gpu: str) -> list[int]:
    """HP degrees the screen tries for one type: powers of two and the largest allowed."""
    allowed = candidate_hp_degrees(problem.cluster, problem.model, gpu)
    powers = [d for d in allowed if d & (d - 1) == 0]
    return sorted({*powers, max(allowed)})


def _greedy_seeds(problem: Problem, quantum: int) -> list[GlobalChoices]:
    speeds = problem.memo(("speeds", problem.train), lambda: attention_speeds(problem))
    by_type = speed_by_type(problem.cluster, speeds)
    checkpointing = True in problem.checkpointing_options
    found = greedy_candidates(problem.cluster, problem.model, checkpointing, by_type)
    return [replace(c, chunk_quantum=quantum) for c in found]


def _descend(problem: Problem, start: GlobalChoices, scored: dict) -> GlobalChoices:
    """One sweep: each type's HP degree in turn, then checkpointing, kept where the
    estimate improves."""
    best, best_s = start, estimate_s(problem, start)
    for gpu in problem.cluster.gpu_types:
        for degree in screen_degrees(problem, gpu):
            candidate = replace(best, hp_degrees={**best.hp_degrees, gpu: degree})
            best, best_s = _better(problem, candidate, best, best_s, scored)
    for checkpointing in problem.checkpointing_options:
        candidate = replace(best, activation_checkpointing=checkpointing)
        best, best_s = _better(problem, candidate, best, best_s, scored)
    return best


def _better(problem, candidate, best, best_s, scored):
    scored.setdefault(candidate.key(), candidate)
    seconds = estimate_s(problem, candidate)
    return (candidate, seconds) if seconds < best_s else (best, best_s)
