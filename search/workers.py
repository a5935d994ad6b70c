"""Worker processes that search one stored Optuna study together.

Each worker opens the study from its storage URL with its own sampler seed and runs the
shared objective. The trial count is exact: a worker that draws a trial numbered at or past
the study's target stops the study and leaves that trial pruned (never completed), so the
completed trials number exactly what was asked however the workers race. Workers return
nothing: the parent reads the trials' values from the storage and rebuilds only the plans
it reports (the best, the Pareto front).
"""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import optuna

from hexiseq.search._evaluate import Problem
from hexiseq.search.objective import Objective
from hexiseq.search.studies import create_study, study_storage_errors


def run_workers(
    problem: Problem,
    storage: str,
    name: str,
    seed: int,
    multi_objective: bool,
    workers: int,
    last_trial: int | None,
    budget_s: float | None,
) -> None:
    """`workers` processes optimize the stored study `name` until trial number `last_trial`
    (None: no count) or `budget_s` seconds; a worker's exception surfaces here."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        arguments = (problem, storage, name, multi_objective, last_trial, budget_s)
        futures = [pool.submit(_worker, seed + i, *arguments) for i in range(workers)]
        for future in futures:
            future.result()


class _Counted(Objective):
    """The objective, stopping the study at trial number `last_trial`."""

    def __init__(self, problem, multi_objective, study, last_trial: int | None) -> None:
        super().__init__(problem, multi_objective)
        self.study, self.last_trial = study, last_trial

    def __call__(self, trial: optuna.Trial):
        if self.last_trial is not None and trial.number > self.last_trial:
            self.study.stop()
            raise optuna.TrialPruned("the study has all its trials")
        return super().__call__(trial)


def _worker(seed, problem, storage, name, multi_objective, last_trial, budget_s) -> None:
    optuna.logging.set_verbosity(logging.WARNING)
    objective = _Counted(problem, multi_objective, None, last_trial)
    with study_storage_errors(storage):
        objective.study = create_study(storage, name, seed, multi_objective, objective)
        objective.study.optimize(objective, timeout=budget_s)
