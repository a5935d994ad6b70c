"""Optuna layer: the study loop over the global choices (greedy -> MILP -> simulator each).

A new study first scores the screened short list (`search.shortlist`: the greedy default
first, so a search never returns worse than the hierarchy alone; from 128 GPUs a default whose
first split simulates over twice as slow as the next candidate's plan is left out,
`_default_outrun`: in all 720 regroupings measured, such a split meant a slower plan), then
samples with seeded TPE for `n_trials` or `time_budget_s` (`search.sampling`: on an in-memory
mirror of a stored study, scored in this process or in worker processes), and every
single-objective search ends with the polish (`search.polish`), a deterministic local search
from the best trials whose full evaluations are capped so the default search keeps its time
goal. A storage URL (SQLite, PostgreSQL) keeps the study and lets a later run go on where an
earlier one stopped: old trials are read back as their values, and only the plans reported
(the best, the Pareto front) are rebuilt. With `multi_objective` the study trades throughput
against the fullest device's memory headroom and returns the Pareto front.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial

import optuna

from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.hierarchy import PLAN_NAME
from hexiseq.search.objective import (
    INFEASIBLE_ATTR,
    INFEASIBLE_SCORE,
    Objective,
    check_search_space,
    check_train_spec,
    choices_from_params,
    default_study_name,
    params_of,
)
from hexiseq.search.options import SearchOptions
from hexiseq.search.polish import POLISH_STARTS, polish, polish_evaluations, step_s
from hexiseq.search.sampling import sample
from hexiseq.search.screen import estimate_s, simulated_first_s
from hexiseq.search.shortlist import HOPELESS_RATIO, hopeless, shortlist
from hexiseq.search.studies import create_study, recover_killed_trials, study_storage_errors


@dataclass(frozen=True)
class Trial:
    """One candidate the search scored: its choices and throughput, or why it cannot run."""

    name: str
    tokens_per_s: float | None
    reason: str | None = None
    params: dict = field(default_factory=dict)


def trial_of(params: dict, candidate: Plan | InfeasiblePlan) -> Trial:
    """The `Trial` of a scored plan (or of one that cannot run)."""
    if isinstance(candidate, Plan):
        return Trial(candidate.name, candidate.predicted.tokens_per_s, None, dict(params))
    return Trial(candidate.name, None, candidate.reason, dict(params))


@dataclass
class StudyOutcome:
    """What the study found: the best plan, every candidate scored, and the Pareto front."""

    best: Plan | None
    records: list[Trial] = field(default_factory=list)
    pareto: list[Plan] = field(default_factory=list)
    study_name: str = ""
    infeasible: list[InfeasiblePlan] = field(default_factory=list)  # built in this process


def run_study(problem: Problem, options: SearchOptions) -> StudyOutcome:
    """Run (or continue) the study, polish it, and rebuild the plans it reports.

    A new study first scores the screened short list (counted in `n_trials`); a continued one
    runs `n_trials` more. With neither `n_trials` nor `time_budget_s`, only the short list
    and the polish.
    """
    with study_storage_errors(options.storage):
        return _run_study(problem, options)


def _run_study(problem: Problem, options: SearchOptions) -> StudyOutcome:
    optuna.logging.set_verbosity(logging.WARNING)
    objective = Objective(problem, options.multi_objective, beside=options.beside)
    name = options.study_name or default_study_name(problem, options)
    study = create_study(options.storage, name, options.seed, options.multi_objective, objective)
    check_search_space(study, problem)
    check_train_spec(study, problem)
    recover_killed_trials(study, objective)
    started, scored_here = time.perf_counter(), 0
    if not study.get_trials(deepcopy=False):  # a new study starts from the short list
        scored_here = _score_shortlist(study, objective, options.n_trials)
    _sample(study, objective, options, scored_here, started)
    polished: list[Trial] = []
    if not options.multi_objective:
        polished = _polish(study, objective, options, started)
    return _outcome(study, objective, options.multi_objective, polished)


def _sample(study, objective: Objective, options: SearchOptions, scored: int, started: float):
    """Optuna's sampling for what is left of `n_trials` / `time_budget_s`."""
    if not options.searching:
        return
    remaining = None if options.n_trials is None else options.n_trials - scored
    elapsed_s = time.perf_counter() - started
    budget_s = None if options.time_budget_s is None else options.time_budget_s - elapsed_s
    if (remaining is not None and remaining <= 0) or (budget_s is not None and budget_s <= 0):
        return
    sample(study, objective, options, remaining, budget_s)


def _polish(study, objective: Objective, options: SearchOptions, started: float):
    deadline = None if options.time_budget_s is None else started + options.time_budget_s
    starts = [
        (choices_from_params(objective.problem, t.params), t.values[0])
        for t in _best_feasible(study, POLISH_STARTS)
    ]
    scored = polish(
        objective.problem,
        starts,
        objective.plan,
        objective.plans,
        lambda choices: choices.key() in objective.cache,
        objective.quanta,
        polish_evaluations(objective.problem.cluster.world_size),
        deadline,
    )
    return [trial_of(params_of(c, objective.quanta[0]), plan) for c, plan in scored]


def _best_feasible(study, count: int) -> list:
    """The `count` fastest feasible trials with distinct choices, fastest first. Completed
    trials only: a trial another process is finishing can read back running with its values
    but not yet all its choices (Optuna reads a trial's rows one table at a time; found by
    benchmarks/store_safety.py, 2 of 6 runs of 29 processes sharing one new study)."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    done = [t for t in complete if t.values[0] > INFEASIBLE_SCORE]
    distinct = {}
    for trial in sorted(done, key=lambda t: -t.values[0]):
        distinct.setdefault(tuple(sorted(trial.params.items())), trial)
    return list(distinct.values())[:count]


def _score_shortlist(study, objective: Objective, limit: int | None) -> int:
    """The screened short list, the greedy default first, at most `limit` trials (a trial
    count is exact), less the candidates `hopeless` beside a plan scored before them. Each
    is scored here and added to the study finished, in one write: never a waiting trial that
    two processes sharing the study could both take (SQLite cannot lock it), nor a running
    one a kill could leave behind. Returns how many trials it added."""
    try:
        return _scored_shortlist(study, objective, limit)
    finally:
        objective.drop_ahead()


def _scored_shortlist(study, objective: Objective, limit: int | None) -> int:
    problem = objective.problem
    quantum = objective.quanta[len(objective.quanta) // 2]
    best_step_s, added = math.inf, 0
    # Meanwhile the helper builds the picks whose plans do not depend on when they are built.
    waiting = shortlist(problem, objective.quanta, objective.build_ahead)[:limit]
    if _default_outrun(problem, objective, waiting):
        objective.drop_ahead(waiting[0])
        waiting = waiting[1:]
    for index, choices in enumerate(waiting):
        if added and hopeless(problem, choices, best_step_s):
            objective.drop_ahead(choices)
            continue
        # The candidates after it that are not hopeless yet are built beside it, and each
        # is taken at its turn where it is still not hopeless (as it would then be built).
        objective.guess(choices, partial(_hopeful, problem, waiting[index + 1 :], best_step_s))
        study.add_trial(objective.scored_trial(params_of(choices, quantum)))
        best_step_s = min(best_step_s, step_s(objective.plan(choices)))
        added += 1
    return added


DEFAULT_CHECKED_FROM = 128
"""The smallest cluster whose greedy default is checked (`_default_outrun`). Below it the
check is mostly lost work: the default ran at most 1.74x slower than the best plan on the 12
planner-scaling cells of 16-64 GPUs and the 20 plan_quality clusters (at 128 GPUs of 4 and 8
types, 2.38x and 2.85x), and the helper often builds it ahead, where its first split would
be simulated twice."""


def _default_outrun(problem: Problem, objective: Objective, waiting: list) -> bool:
    """Whether the greedy default, first on the short list, is left out: where its first
    split (`screen.simulated_first_s`, which sees the ring's waits) simulates over
    HOPELESS_RATIO x the next candidate's estimate, that candidate is built first, and the
    default goes where its first split is also over HOPELESS_RATIO x that plan's step. The
    full solve's step was at least 0.52x its first split's in all of 720 polish
    regroupings (`polish.POLISH_FIRST_SLACK`), so such a default runs slower than that
    plan (built anyway on the two cells below, 2.4 and 2.8x). The default mixes HP degrees
    by speed, and the estimate prices such a ring as if its groups waited for nothing: on
    128 GPUs of 8 types it estimates 21.4 s and runs 59.6 s, beside 21.0 s for uniform HP 8.
    Only on clusters of DEFAULT_CHECKED_FROM devices or more."""
    if len(waiting) < 2 or problem.cluster.world_size < DEFAULT_CHECKED_FROM:
        return False
    default, rival = waiting[0], waiting[1]
    first_s = simulated_first_s(problem, default)  # kept for its full evaluation
    if not first_s > HOPELESS_RATIO * estimate_s(problem, rival):
        return False
    return first_s > HOPELESS_RATIO * step_s(objective.plan(rival))


def _hopeful(problem, candidates: list, best_step_s: float) -> list:
    """Those of `candidates` not hopeless beside `best_step_s`."""
    return [c for c in candidates if not hopeless(problem, c, best_step_s)]


def _outcome(
    study, objective: Objective, multi_objective: bool, polished: list[Trial]
) -> StudyOutcome:
    """Every completed trial as a record (from its stored values: old and workers' trials
    are not rebuilt), the best plan and the Pareto front rebuilt."""
    records = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state == optuna.trial.TrialState.COMPLETE:
            throughput = trial.values[0]
            if throughput > INFEASIBLE_SCORE:
                records.append(Trial(PLAN_NAME, throughput, None, dict(trial.params)))
            else:
                reason = trial.user_attrs.get(INFEASIBLE_ATTR, "infeasible")
                records.append(Trial(PLAN_NAME, None, reason, dict(trial.params)))
    records += polished
    best = _best_plan(objective, records)
    pareto = []
    if multi_objective:
        front = [t for t in study.best_trials if t.values[0] > INFEASIBLE_SCORE]
        choices = {
            c.key(): c for c in (choices_from_params(objective.problem, t.params) for t in front)
        }
        pareto = [objective.plan(c) for c in choices.values()]
    return StudyOutcome(
        best,
        records,
        [p for p in pareto if isinstance(p, Plan)],
        study.study_name,
        [p for p in objective.cache.values() if isinstance(p, InfeasiblePlan)],
    )


def _best_plan(objective: Objective, records: list[Trial]) -> Plan | None:
    feasible = [r for r in records if r.tokens_per_s is not None]
    if not feasible:
        return None
    best = max(feasible, key=lambda r: r.tokens_per_s)
    plan = objective.plan(choices_from_params(objective.problem, best.params))
    return plan if isinstance(plan, Plan) else None
