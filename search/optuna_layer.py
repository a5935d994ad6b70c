"""Optuna layer: samples the global choices and scores each with greedy -> MILP -> simulator.

A new study first scores the screened short list (`search.shortlist`: the greedy default
first, so a search never returns worse than the hierarchy alone). Every single-objective
search ends with the polish (`search.polish`), a deterministic local search from the best
trials whose full evaluations are capped so the default search keeps its time goal. Seeded
TPE sampling makes a run deterministic for a fixed number of trials (a time budget that cuts
a run short trades that for time). A storage URL (SQLite, PostgreSQL) keeps the study, lets
several worker processes search it together, and lets a later run go on where an earlier one
stopped. With `multi_objective` the study trades throughput against the fullest device's
memory headroom and returns the Pareto front.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import optuna
from sqlalchemy.exc import ArgumentError

from hexiseq.errors import InputError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    RING_ORDERS,
    GlobalChoices,
    candidate_hp_degrees,
    chunk_quantum,
)
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.polish import POLISH_STARTS, polish, polish_evaluations
from hexiseq.search.shortlist import shortlist
from hexiseq.store import display_url, mask_url_passwords

INFEASIBLE_SCORE = 0.0


@dataclass
class StudyOutcome:
    """What the study found: the best plan, every trial's plan, and the Pareto front."""

    best: Plan | None
    plans: list[tuple[dict, Plan | InfeasiblePlan]] = field(default_factory=list)
    pareto: list[Plan] = field(default_factory=list)
    study_name: str = ""


def quantum_choices(problem: Problem) -> list[int]:
    """The automatic chunk quantum and its neighbours that still divide the sequence."""
    base = chunk_quantum(problem.train.seq_len, problem.cluster.world_size)
    options = [q for q in (base // 2, base, base * 2) if q >= 1]
    return [q for q in dict.fromkeys(options) if problem.train.seq_len % (2 * q) == 0]


def choices_from_params(problem: Problem, params: dict) -> GlobalChoices:
    degrees = {gpu: int(params[f"hp_degree[{gpu}]"]) for gpu in problem.cluster.gpu_types}
    return GlobalChoices(
        degrees,
        str(params["ring_order"]),
        int(params["chunk_quantum"]),
        bool(params["activation_checkpointing"]),
    )


def params_of(choices: GlobalChoices, quantum: int) -> dict:
    params = {f"hp_degree[{gpu}]": d for gpu, d in choices.hp_degrees.items()}
    params.update(
        ring_order=choices.ring_order,
        chunk_quantum=choices.chunk_quantum or quantum,
        activation_checkpointing=choices.activation_checkpointing,
    )
    return params


class _Objective:
    """Scores trials; remembers every plan it built (trials repeating a choice are free)."""

    def __init__(self, problem: Problem, multi_objective: bool) -> None:
        self.problem = problem
        self.multi_objective = multi_objective
        self.cache: dict[tuple, Plan | InfeasiblePlan] = {}
        self.quanta = quantum_choices(problem)

    def __call__(self, trial: optuna.Trial):
        choices = self._sample(trial)
        plan = self.plan(choices)
        if isinstance(plan, InfeasiblePlan):
            trial.set_user_attr("infeasible", plan.reason)
            return (INFEASIBLE_SCORE, -1.0) if self.multi_objective else INFEASIBLE_SCORE
        throughput = plan.predicted.tokens_per_s
        if self.multi_objective:
            return throughput, 1.0 - plan.predicted.max_memory_fraction
        return throughput

    def plan(self, choices: GlobalChoices) -> Plan | InfeasiblePlan:
        key = choices.key()
        if key not in self.cache:
            self.cache[key] = plan_for_choices(self.problem, choices)
        return self.cache[key]

    def _sample(self, trial: optuna.Trial) -> GlobalChoices:
        cluster, model = self.problem.cluster, self.problem.model
        degrees = {
            gpu: trial.suggest_categorical(
                f"hp_degree[{gpu}]", candidate_hp_degrees(cluster, model, gpu)
            )
            for gpu in cluster.gpu_types
        }
        return GlobalChoices(
            degrees,
            trial.suggest_categorical("ring_order", list(RING_ORDERS)),
            trial.suggest_categorical("chunk_quantum", self.quanta),
            trial.suggest_categorical(
                "activation_checkpointing", list(self.problem.checkpointing_options)
            ),
        )


def run_study(
    problem: Problem,
    *,
    n_trials: int | None,
    time_budget_s: float | None,
    seed: int,
    storage: str | None = None,
    study_name: str | None = None,
    workers: int = 1,
    multi_objective: bool = False,
    show_progress: bool = False,
) -> StudyOutcome:
    """Run (or continue) the study and rebuild the plans of its best trials.

    A new study first scores the screened short list (counted in `n_trials`); a continued one
    runs `n_trials` more. With neither `n_trials` nor `time_budget_s`, only the short list.
    """
    optuna.logging.set_verbosity(logging.WARNING)
    objective = _Objective(problem, multi_objective)
    name = study_name or _default_study_name(problem, multi_objective)
    study = _create_study(storage, name, seed, multi_objective)
    started, scored_here = time.perf_counter(), 0
    if not study.trials:  # a new study starts from the greedy stage's short list
        # Scored here, before any worker starts: workers sharing a SQLite study could both
        # take the same enqueued trial.
        scored_here = _score_shortlist(study, objective)
    remaining = None if n_trials is None else n_trials - scored_here
    budget = None if time_budget_s is None else time_budget_s - (time.perf_counter() - started)
    searching = n_trials is not None or time_budget_s is not None
    no_room = (remaining is not None and remaining <= 0) or (budget is not None and budget <= 0)
    if searching and not no_room:
        if workers > 1:
            _run_workers(problem, storage, name, seed, multi_objective, workers, remaining, budget)
        else:
            study.optimize(
                objective, n_trials=remaining, timeout=budget, show_progress_bar=show_progress
            )
    polished = []
    if not multi_objective:
        deadline = None if time_budget_s is None else started + time_budget_s
        starts = [
            (choices_from_params(problem, t.params), t.values[0])
            for t in _best_feasible(study, POLISH_STARTS)
        ]
        scored = polish(
            problem,
            starts,
            objective.plan,
            lambda choices: choices.key() in objective.cache,
            objective.quanta,
            polish_evaluations(problem.cluster.world_size),
            deadline,
        )
        polished = [(params_of(c, objective.quanta[0]), p) for c, p in scored]
    return _outcome(study, objective, multi_objective, polished)


def _best_feasible(study, count: int) -> list:
    """The `count` fastest feasible trials with distinct choices, fastest first."""
    done = [t for t in study.trials if t.values and t.values[0] > INFEASIBLE_SCORE]
    distinct = {}
    for trial in sorted(done, key=lambda t: -t.values[0]):
        distinct.setdefault(tuple(sorted(trial.params.items())), trial)
    return list(distinct.values())[:count]


def _score_shortlist(study, objective: _Objective) -> int:
    """The screened short list, the greedy default first. Returns how many trials it ran."""
    quantum = objective.quanta[len(objective.quanta) // 2]
    candidates = shortlist(objective.problem, quantum)
    for choices in candidates:
        study.enqueue_trial(params_of(choices, quantum))
    study.optimize(objective, n_trials=len(candidates))
    return len(candidates)


def _create_study(storage: str | None, name: str, seed: int, multi_objective: bool):
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)
    directions = ["maximize", "maximize"] if multi_objective else ["maximize"]
    try:
        return optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=sampler,
            directions=directions,
            load_if_exists=True,
        )
    except (ArgumentError, ImportError) as error:
        # SQLAlchemy's message repeats the URL, password and all: one masked line instead.
        reason = mask_url_passwords((str(error).splitlines() or [type(error).__name__])[0])
        raise InputError(
            f"storage URL {display_url(str(storage))!r} is not usable: {reason}"
        ) from None


def _default_study_name(problem: Problem, multi_objective: bool) -> str:
    kind = "pareto" if multi_objective else "throughput"
    return f"{problem.cluster.name}/{problem.model.name}/{problem.train.seq_len}/{kind}"


def _outcome(
    study,
    objective: _Objective,
    multi_objective: bool,
    polished: list[tuple[dict, Plan | InfeasiblePlan]] = (),
) -> StudyOutcome:
    plans = []
    for trial in study.trials:
        if trial.state == optuna.trial.TrialState.COMPLETE:
            choices = choices_from_params(objective.problem, trial.params)
            plans.append((trial.params, objective.plan(choices)))
    plans += polished
    feasible = [plan for _, plan in plans if isinstance(plan, Plan)]
    best = max(feasible, key=lambda p: p.predicted.tokens_per_s) if feasible else None
    pareto = []
    if multi_objective:
        front = [t for t in study.best_trials if t.values[0] > INFEASIBLE_SCORE]
        choices = {
            c.key(): c for c in (choices_from_params(objective.problem, t.params) for t in front)
        }
        pareto = [objective.plan(c) for c in choices.values()]
    return StudyOutcome(best, plans, [p for p in pareto if isinstance(p, Plan)], study.study_name)


def _run_workers(problem, storage, name, seed, multi_objective, workers, n_trials, budget) -> None:
    """`workers` processes optimize the same stored study, each with its own seed."""
    per_worker = None if n_trials is None else max(1, -(-n_trials // workers))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        arguments = (problem, storage, name, multi_objective, per_worker, budget)
        futures = [pool.submit(_worker, seed + i, *arguments) for i in range(workers)]
        for future in futures:
            future.result()  # a worker's exception (or a crashed worker) surfaces here


def _worker(seed, problem, storage, name, multi_objective, n_trials, budget) -> None:
    optuna.logging.set_verbosity(logging.WARNING)
    study = _create_study(storage, name, seed, multi_objective)
    study.optimize(_Objective(problem, multi_objective), n_trials=n_trials, timeout=budget)
