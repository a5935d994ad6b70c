"""The baselines scored beside the study: a forked process computes them on the second CPU
while this one searches.

The baselines (uniform grids on the whole cluster and on each GPU type's nodes, ring-only,
Ulysses-only, the data-parallel replicas) need nothing the study finds, and the study needs
nothing they find, so the default search (no sampling, no stored study) forks a process for
them where that is safe: on Linux (`FORKS`), with a second CPU to run on, and
no other thread in this process (a fork copies one thread; a lock another thread held would
stay held in the child). The child scores them on the same problem as it stood at the fork,
so it finds exactly what this process would; this process takes them when the study is done.
Where the child cannot answer (no fork, it failed, it died, it is still not done
`BESIDE_WAIT_FACTOR` x the study's time after the study), this process scores them itself, as
before: the same results, later.

On 2 cores the baselines were 6-36 % of a default search on 64-128 GPUs
(`benchmarks/planner_breakdown.py`); the fork and the transfer back cost this process about
5 ms, and the searches of 2-8 types took 9-21 % less wall time (`benchmarks/planner_ab.py`;
one type, where the baselines are few: within noise). The answer
comes back through a pipe from the child this process forked (multiprocessing pickles it on
the way); nothing from a file or from another program is unpickled.

Smaller pieces of work do not pay for a fork: after it, every object either process touches
(even to count a reference) copies its memory page. Splitting each of the polish's batches of
full evaluations with a child made 16-32 GPU searches 9 % faster to 31 % slower (interleaved
A/B, same plans), and was dropped.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hexiseq.search._evaluate import Problem

BESIDE_MIN_DEVICES = 64
"""Smaller clusters score their baselines in this process: on 16 and 32 GPUs they are 8-11 %
of a search, and forking for them made no difference beyond the noise (-9 % to +9 % by cell
in an interleaved A/B, `benchmarks/planner_ab.py`)."""
FORKS = sys.platform.startswith("linux")
"""Where this module and the search's scoring workers (`search.sampling.WORKER_START`) fork
processes; elsewhere (macOS's system libraries are not safe to fork) they do not."""
FORK_WARNING = r".*multi-threaded, use of fork\(\) may lead to deadlocks"
"""Python 3.12 on warns at any fork of a process that runs threads; the forks here happen
where no Python thread runs but HiGHS's pool may (`search._highs` starts a fresh one in the
child), and the warning is left out."""
BESIDE_WAIT_FACTOR = 4.0
BESIDE_MIN_WAIT_S = 2.0
"""How long this process waits for the child once the study is done: BESIDE_WAIT_FACTOR x
the study's seconds, at least BESIDE_MIN_WAIT_S (the child's work is about as long as the
study's); then it stops the child and scores the baselines itself."""


@dataclass
class Pending:
    """Baselines being scored: in a child process, or (no child) by `result` here."""

    problem: Problem
    score: Callable[[Problem], Any]
    process: Any = None
    reader: Any = None
    started_s: float = 0.0

    @property
    def forked(self) -> bool:
        return self.process is not None

    def result(self) -> Any:
        """What `score(problem)` returns: the child's answer, or scored here."""
        answer = self._answer() if self.forked else None
        return answer[0] if answer is not None else self.score(self.problem)

    def close(self) -> None:
        """Stop the child if it still runs, and reap it (again: nothing)."""
        if not self.forked:
            return
        self.reader.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.process = self.reader = None

    def _answer(self) -> tuple[Any] | None:
        waited_s = time.perf_counter() - self.started_s
        wait_s = max(BESIDE_MIN_WAIT_S, BESIDE_WAIT_FACTOR * waited_s)
        try:
            if self.reader.poll(wait_s):
                return self.reader.recv()  # (value,), or None where the child failed
            return None  # too slow: scored here
        except (EOFError, OSError):  # the child died before it answered
            return None
        finally:
            self.close()


def score_beside(problem: Problem, score: Callable[[Problem], Any], allowed: bool) -> Pending:
    """Start `score(problem)` in a forked process where `allowed` and safe (module doc);
    `result()` of what this returns gives its value either way."""
    pending = Pending(problem, score)
    if not (allowed and _safe_to_fork()):
        return pending
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(problem, score, writer), daemon=True)
    try:
        with warnings.catch_warnings():  # HiGHS's idle pool threads (`search.sampling`)
            warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
            process.start()
    except OSError:  # no process to be had: score here
        reader.close()
        return pending
    finally:
        writer.close()
    pending.process, pending.reader, pending.started_s = process, reader, time.perf_counter()
    return pending


def baselines_worth_forking(problem: Problem) -> bool:
    """Whether the cluster is large enough for its baselines to pay for a fork
    (BESIDE_MIN_DEVICES)."""
    return problem.cluster.world_size >= BESIDE_MIN_DEVICES


def _safe_to_fork() -> bool:
    """Whether a fork here is safe and can run beside this process (module doc)."""
    return (
        FORKS
        and _only_thread()
        and not multiprocessing.current_process().daemon  # it may have no children
        and _cpus() >= 2
    )


def _only_thread() -> bool:
    """Whether this is the process's one Python thread (a progress bar's monitor, a study
    writer or the caller's threads keep the work here)."""
    return threading.active_count() == 1


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _child(problem: Problem, score: Callable[[Problem], Any], writer) -> None:
    """In the child: score, send `(value,)` back (None where scoring failed: the parent then
    scores, and raises what it raises), and leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        answer = (score(problem),)
    except BaseException:
        answer = None
    try:
        writer.send(answer)
    except Exception:  # an answer that cannot be sent back (pickled) is scored there
        writer.send(None)
    writer.close()
