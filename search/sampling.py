"""Optuna's sampling for a search: in this process, on an in-memory mirror of a stored study.

Optuna writes a stored trial row by row as it is sampled, a transaction for every choice (on
SQLite about two thirds of a 200-trial search's time). Here a stored study is mirrored in
memory (its finished trials copied in), TPE asks and is told there, and each finished trial
is written to the stored study once, whole (`study.add_trial`), as soon as it is told: a
killed search never leaves a running trial behind, and it keeps the trials it finished (with
workers, all but those still queued for the writer thread when it was killed). The trials
other processes add to the stored study meanwhile are copied into the mirror every `SYNC_S`
(searches sharing a study should each have their own seed: the same seed on the same
history samples the same trials). With one worker the same seed samples the same trials as a
search in memory.

With `workers` > 1 the trials are scored in worker processes while this process samples: it
keeps every worker busy (a trial each; a choice already scored, or being scored, is not
scored again), tells the study each result as it comes back (in the order they come: the
seed no longer fixes the trials), and a thread of its own writes the finished trials to the
stored study (a write costs about as much CPU as a score). The trial count is exact: this
process asks exactly the trials it was given. Workers return values, not plans: only the
plans reported (the best, the Pareto front) are rebuilt here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import multiprocessing
import os
import signal
import time
import uuid
import warnings
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field

import optuna

from hexiseq.search.helper import FORK_WARNING, FORKS
from hexiseq.search.objective import Objective
from hexiseq.search.options import SearchOptions

WORKER_START = "fork" if FORKS else "spawn"
"""How scoring workers start. On Linux they are forked: a worker is ready in milliseconds
with this process's modules imported. A spawned worker imports hexiseq anew (0.8 s of CPU
each on this 2-core machine, beside the sampling process): spawned, 2 workers ran a
200-trial search in memory at 0.84x the speed of one; forked, at 1.16x (`benchmarks/
search_workers.py`). The problem goes to a worker with an empty cache even so: one that
kept the search's caches ran slower (2.14 s against 1.77 s), its reads copying the pages
they touch. Elsewhere (macOS's system libraries are not safe to fork) workers are spawned.
The workers fork at the first trial sent, before the study writer's thread starts (at the
first finished trial). Other threads may run then (tqdm's monitor of a progress bar,
HiGHS's pool, the caller's): a worker only scores (no output, no store, no progress bar),
takes none of their locks, and starts a HiGHS pool of its own (`search._highs`)."""
SYNC_S = 5.0
"""How often the mirror takes in the trials other processes finished in the stored study."""
WRITER_ATTR = "hexiseq_writer"
"""System attribute of a trial this search wrote: the mirror does not copy it back."""


def sample(
    study: optuna.Study,
    objective: Objective,
    options: SearchOptions,
    count: int | None,
    budget_s: float | None,
) -> None:
    """`count` more trials (None: until `budget_s`) on `study` (module docstring)."""
    stored = options.storage is not None
    mirror = _Mirror.of(study) if stored else None
    target = mirror.memory if mirror else study
    if options.workers == 1:
        callbacks = [mirror.finished] if mirror else []
        target.optimize(
            objective,
            n_trials=count,
            timeout=budget_s,
            callbacks=callbacks,
            show_progress_bar=options.show_progress,
        )
        return
    _sample_with_workers(target, objective, options, count, budget_s, mirror)


@dataclass
class _Mirror:
    """An in-memory copy of a stored study, which writes back each trial finished in it."""

    stored: optuna.Study
    memory: optuna.Study
    seen: set[int]
    """Numbers of the stored trials copied in."""
    writer: str = field(default_factory=lambda: uuid.uuid4().hex)
    synced_at: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, stored: optuna.Study) -> _Mirror:
        memory = optuna.create_study(
            sampler=stored.sampler, directions=stored.directions, study_name=stored.study_name
        )
        mirror = cls(stored, memory, set())
        mirror.take_in()
        return mirror

    def take_in(self) -> None:
        """Copy in the stored trials finished since the last look, but this search's own."""
        finished = self.stored.get_trials(deepcopy=False, states=_FINISHED)
        new = [
            t
            for t in finished
            if t.number not in self.seen and t.system_attrs.get(WRITER_ATTR) != self.writer
        ]
        self.seen.update(t.number for t in finished)
        self.memory.add_trials(new)
        self.synced_at = time.monotonic()

    def finished(self, _study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """Optuna's callback: the trial just finished in the mirror, written to the stored
        study in one write; now and then, what other processes finished taken in."""
        self.stored.add_trial(self.written(trial))
        self.take_in_when_due()

    def take_in_when_due(self) -> None:
        """`take_in`, once `SYNC_S` has passed since the last look."""
        if time.monotonic() - self.synced_at > SYNC_S:
            self.take_in()

    def written(self, trial: optuna.trial.FrozenTrial) -> optuna.trial.FrozenTrial:
        """The trial as this search writes it to the stored study."""
        return _with_writer(trial, self.writer)


def _with_writer(trial: optuna.trial.FrozenTrial, writer: str) -> optuna.trial.FrozenTrial:
    """`trial` (its times too) marked as written by `writer`."""
    written = copy.deepcopy(trial)
    written.system_attrs = {**trial.system_attrs, WRITER_ATTR: writer}
    return written


_FINISHED = (
    optuna.trial.TrialState.COMPLETE,
    optuna.trial.TrialState.PRUNED,
    optuna.trial.TrialState.FAIL,
)


def _sample_with_workers(
    study: optuna.Study,
    objective: Objective,
    options: SearchOptions,
    count: int | None,
    budget_s: float | None,
    mirror: _Mirror | None,
) -> None:
    """Ask and tell here, score in `options.workers` processes, write in a thread (module
    docstring)."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    context = multiprocessing.get_context(WORKER_START)
    problem = dataclasses.replace(objective.problem, cache={})  # small: no wait on a pipe
    arguments = (problem, objective.multi_objective)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(
            ProcessPoolExecutor(options.workers, context, _start_scorer, arguments)
        )
        writer = None if mirror is None else stack.enter_context(_Writer(mirror))
        bar = stack.enter_context(_Progress(options.show_progress, count, budget_s))
        queue = _Queue(study, objective, pool, writer)
        try:
            _ask_and_tell(queue, options.workers, count, deadline, bar)
        except BaseException:
            pool.shutdown(cancel_futures=True)  # what no worker started yet: never started
            raise


def _ask_and_tell(
    queue: _Queue, workers: int, count: int | None, deadline: float | None, bar: _Progress
) -> None:
    asked = 0
    while True:
        while queue.busy < workers and _more(asked, count, deadline):
            queue.ask()  # told at once when its choice was scored already
            asked += 1
        bar.show(queue.told)
        if not queue.busy:
            return
        queue.tell_finished()


def _more(asked: int, count: int | None, deadline: float | None) -> bool:
    if count is not None and asked >= count:
        return False
    return deadline is None or time.monotonic() < deadline


class _Writer:
    """Writes each trial finished in the mirror to the stored study as soon as it is told, in
    a thread of its own (the scorers' results keep coming while it writes). A write that
    failed is raised at the next trial; on leaving, every trial was written."""

    def __init__(self, mirror: _Mirror) -> None:
        self.mirror = mirror
        self.pool = ThreadPoolExecutor(1, "hexiseq-study-writer")
        self.writes: list[Future] = []

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.pool.shutdown()  # the trials told are written, whatever ended the search
        failed = [f.exception() for f in self.writes if f.exception() is not None]
        if failed and exc_value is None:
            raise failed[0]
        if failed and hasattr(exc_value, "add_note"):  # Python 3.11 on
            exc_value.add_note(f"writing the finished trials failed too: {failed[0]}")

    def finished(self, trial: optuna.trial.FrozenTrial) -> None:
        self._raise_failed()
        self.writes.append(
            self.pool.submit(self.mirror.stored.add_trial, self.mirror.written(trial))
        )
        self.mirror.take_in_when_due()

    def _raise_failed(self) -> None:
        """The first failed write's exception, once it is known; written ones are let go."""
        pending = []
        for future in self.writes:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None:
                self.writes.remove(future)  # raised here, not again on leaving
                raise future.exception()
        self.writes = pending


@dataclass
class _Queue:
    """Trials asked in the study and scored by the workers, each choice once."""

    study: optuna.Study
    objective: Objective
    pool: ProcessPoolExecutor
    writer: _Writer | None
    scored: dict[tuple, tuple[list[float], dict]] = field(default_factory=dict)
    running: dict[Future, tuple[tuple, list[optuna.Trial]]] = field(default_factory=dict)
    waiting: dict[tuple, Future] = field(default_factory=dict)
    told: int = 0

    @property
    def busy(self) -> int:
        return len(self.running)

    def ask(self) -> None:
        """A new trial: told at once when its choices were scored, else waiting on them."""
        trial = self.study.ask()
        key = self.objective.sample(trial).key()
        if key in self.scored:
            self._tell(trial, *self.scored[key])
        elif key in self.waiting:
            self.running[self.waiting[key]][1].append(trial)
        else:
            future = self._submit(trial.params)
            self.running[future] = (key, [trial])
            self.waiting[key] = future

    def _submit(self, params: dict) -> Future:
        """`_score(params)` in a worker. The first submit forks the workers (`WORKER_START`):
        Python 3.12 on warns at any fork of a process that runs threads, which this one may
        (`WORKER_START` says why the workers are safe); the warning, on stderr wherever
        deprecation warnings are shown (pytest, `-W default`), is left out."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
            return self.pool.submit(_score, params)

    def tell_finished(self) -> None:
        """Wait for a worker to finish, and tell the study what came back."""
        done, _ = wait(self.running, return_when=FIRST_COMPLETED)
        for future in done:
            key, trials = self.running.pop(future)
            del self.waiting[key]
            self.scored[key] = future.result()  # a worker's exception surfaces here
            for trial in trials:
                self._tell(trial, *self.scored[key])

    def _tell(self, trial: optuna.Trial, values: list[float], user_attrs: dict) -> None:
        for name, value in user_attrs.items():
            trial.set_user_attr(name, value)
        frozen = self.study.tell(trial, values)
        self.told += 1
        if self.writer is not None:
            self.writer.finished(frozen)


class _Progress:
    """The search's bar on stderr (tqdm, as Optuna's own): trials against the count, or
    seconds against the time budget; nothing when not `shown`."""

    def __init__(self, shown: bool, count: int | None, budget_s: float | None) -> None:
        self.bar, self.count, self.started = None, count, time.monotonic()
        self.told = 0
        if shown:
            from tqdm import tqdm

            by_count = count is not None
            total = count if by_count else round(budget_s or 0)
            self.bar = tqdm(total=total, desc="search", unit="trial" if by_count else "s")

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.bar is not None:
            self.show(self.told)
            self.bar.close()

    def show(self, told: int) -> None:
        """The bar with `told` trials finished."""
        self.told = told
        if self.bar is None:
            return
        if self.count is not None:
            self.bar.n = min(told, self.count)
        else:
            self.bar.n = min(round(time.monotonic() - self.started), self.bar.total)
            self.bar.set_postfix_str(f"{told} trials", refresh=False)
        self.bar.refresh()


SCORER_NICENESS = 10
"""Scorers yield the CPU to this process (its sampling and its writer thread), which the
search waits on when the cores are fewer than the processes (a stored trial costs about as
much CPU to write as to score)."""
_objective: Objective | None = None
"""A scoring worker's objective (its plans cached for the whole search)."""


def _start_scorer(problem, multi_objective: bool) -> None:
    global _objective
    gc.freeze()  # what a forked worker inherits stays out of its collections (and shared)
    os.nice(SCORER_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the searching process's to handle
    _objective = Objective(problem, multi_objective)


def _score(params: dict) -> tuple[list[float], dict]:
    """A worker's score of one trial's choices: its values and user attributes."""
    trial = _objective.scored_trial(params)
    return list(trial.values), dict(trial.user_attrs)
