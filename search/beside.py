"""The baselines scored beside the study, in the search's helper process (`search.helper`).

The baselines (uniform grids on the whole cluster and on each GPU type's nodes, ring-only,
Ulysses-only, the data-parallel replicas) need nothing the study finds, and the study needs
nothing they find, so the default search (no sampling, no stored study) sends them to its
helper first, where it has one, and takes them when the study is done. The helper scores them
on the same problem, so it finds exactly what this process would. Where it cannot answer (no
helper, it failed, it died, it is still not done `BESIDE_WAIT_FACTOR` x the study's time after
the study), this process scores them itself: the same results, later.

On 2 cores the baselines are 2-29 % of a default search (`benchmarks/planner_breakdown.py`);
a child forked for them per search paid only from 64 GPUs. The helper is forked once
(`search.helper`), so they go beside the study at every size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hexiseq.search import helper
from hexiseq.search._evaluate import Problem

BESIDE_WAIT_FACTOR = 4.0
BESIDE_MIN_WAIT_S = 2.0
"""How long this process waits for the helper once the study is done: BESIDE_WAIT_FACTOR x
the study's seconds, at least BESIDE_MIN_WAIT_S (the baselines take about as long as the
study); then it stops the helper and scores the baselines itself."""


@dataclass
class Pending:
    """Baselines being scored: in the helper (`ticket`), or (none) by `result` here."""

    problem: Problem
    score: Callable[[Problem], Any]
    ticket: int | None = None
    started_s: float = 0.0

    @property
    def beside(self) -> bool:
        """Whether the helper scores them."""
        return self.ticket is not None

    def result(self) -> Any:
        """What `score(problem)` returns: the helper's answer, or scored here."""
        answer = None
        if self.beside:
            waited_s = time.perf_counter() - self.started_s
            wait_s = max(BESIDE_MIN_WAIT_S, BESIDE_WAIT_FACTOR * waited_s)
            answer = helper.result(self.problem, self.ticket, wait_s)
            self.ticket = None
        return answer[0] if answer is not None else self.score(self.problem)


def score_beside(problem: Problem, score: Callable[[Problem], Any]) -> Pending:
    """Start `score(problem)` (a module-level function) in the search's helper where it has
    one (`helper.helping`); `result()` of what this returns gives its value either way."""
    return Pending(problem, score, helper.start(problem, score), time.perf_counter())
