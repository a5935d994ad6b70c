"""A helper process that works beside the default search: forked once, kept for later searches.

The default search has work that does not depend on what it is doing meanwhile: the baselines
(`search.beside`), batches of candidates whose plans do not depend on each other (the polish's
neighbours, `search.polish`; the short-list candidates after the one being scored that are
not hopeless yet, `Objective.guess`), where both move, the short list's descent with
activation checkpointing beside the one without (`search.shortlist`), and else, while the
one descent runs here, the plans of the greedy picks the short list will score
(`Objective.build_ahead`: their busy rates are known and never change, so they are the plans
this process would build later).

The helper works in order, one piece of work at a time. Work not started yet can be
withdrawn (`withdraw`): the helper skips it, and its answer (an empty one where skipped) is
dropped. A plan built ahead is taken where the helper has built it or is building it
(`under_way`: the first asked for and not answered); the others still waiting are withdrawn
then. While the helper finishes the one asked for, the short-list candidates after it (the
withdrawn ones among them) are shared as a batch queued behind it (`evaluate_batch`'s
`behind`): built here from the front, and there from the back once it is done.

Where a fork is safe (`safe_to_fork`: Linux, a second CPU, no other thread), the first default
search forks one helper process, and the process keeps it for its later searches. A search
holds it from start to end (`helping`): it sends the baselines first, and later each batch's
plans one by one, the helper building from the back while this process builds from the front
(`evaluate_batch`); both run at once on two CPUs.

Forked once, not once a search or a batch: after a fork every memory page either process
touches (even to count a reference) is copied. Forking a child per batch made 16-32 GPU
searches up to 31 % slower, and a child per search for the baselines paid only from 64 GPUs;
here each page is copied once, in the first search.

Per search the helper gets the problem (without its cache) once, and with each batch the
busy-rate tables this process has found (`screen.group_rates`): those depend on the order
candidates were scored in, and with them the helper finds the very plans this process would.
Its answers come back pickled with the problem's cluster, model and cost model by name
(SHARED): the plans refer to this process's own objects, and a large cluster does not travel
with every plan. A batch goes to the helper only while it has nothing else to do (the
baselines may take longer than the study's first batches on large clusters), and only where
it is worth handing over (HELPER_MIN_SHARE_S): otherwise this process evaluates it all.

The helper runs the code and module state of the moment it was forked (each search's inputs
travel to it with the search). `HEXISEQ_SEARCH_HELPER=off` in the environment keeps every
search's work in its own process (the test suite does, so that a test's patches hold).

Where the helper cannot answer (what it ran raised, it died, or it is still not done
`wait_s` after this process asked), this process does the work itself: the same results,
later. A helper that failed to answer is stopped; the next search forks another. Answers come
back through a pipe from the helper this process forked; nothing from a file or from another
program is unpickled.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import dataclasses
import functools
import gc
import io
import itertools
import multiprocessing
import operator
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from hexiseq.errors import InputError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.screen import rate_tables, rates_table

FORKS = sys.platform.startswith("linux")
"""Where this module and the search's scoring workers (`search.sampling.WORKER_START`) fork
processes; elsewhere (macOS's system libraries are not safe to fork) they do not."""
FORK_WARNING = r".*multi-threaded, use of fork\(\) may lead to deadlocks"
"""Python 3.12 on warns at any fork of a process that runs threads; the forks here happen
where no Python thread runs but HiGHS's pool may (`search._highs` starts a fresh one in the
child), and the warning is left out."""
BATCH_WAIT_FACTOR = 4.0
BATCH_MIN_WAIT_S = 2.0
"""How long this process waits for the helper's half of a batch once its own half is done:
BATCH_WAIT_FACTOR x its own half's seconds (the halves are about as long), at least
BATCH_MIN_WAIT_S."""

HELPER_MIN_SHARE_S = 0.004
"""Plans go to the helper only where they would take it at least this long (at the mean time
of the search's plans so far, `objective.Objective`): handing them over costs about 1-3 ms
(the rates and the plans pickled, the helper's own first simulations of the search), and on
32 GPUs of one type (plans of 2-3 ms) handing over every batch made searches 16 % slower.
Before the search has built a plan, no batch goes (the exceptions: the greedy picks built
ahead while the short list's lone descent runs here, `Objective.build_ahead`, and the
short-list candidates queued behind one of them the helper is still building,
`Objective._take_ahead`)."""
SHARED = ("cluster", "model", "cost")
"""The problem's parts an answer refers to by name (`_Pickler`): this process has them."""
HELPER_VARIABLE = "HEXISEQ_SEARCH_HELPER"
HELPER_SETTINGS = {"on": True, "1": True, "yes": True, "off": False, "0": False, "no": False}

Scored = Plan | InfeasiblePlan


@contextmanager
def helping(problem: Problem, allowed: bool) -> Iterator[None]:
    """Let `problem`'s search use the helper until it ends, where `allowed` and no other
    thread's search holds it."""
    global _HOLDER
    if not (allowed and _wanted()) or not _LOCK.acquire(blocking=False):
        yield
        return
    try:
        if _HELPER is not None and (_HELPER.waiting or _HELPER.answers):
            _stop()  # still on the work of a search that did not end (interrupted)
        _HOLDER = _search_id(problem)
        yield
    finally:
        _HOLDER = None
        _LOCK.release()


def start(problem: Problem, work: Callable[..., Any], *args, rates: bool = True) -> int | None:
    """Start `work(problem, *args)` in the helper (`work` a module-level function), with
    this process's busy rates (`rates`: else the helper has them, from earlier work of the
    search); returns a ticket for `result`, or None where the search has no helper."""
    helper = _helper_of(problem)
    return None if helper is None else helper.call(problem, work, args, rates)


def result(problem: Problem, ticket: int | None, wait_s: float) -> tuple[Any] | None:
    """`(value,)` of the work `ticket` started, waiting at most `wait_s`; None where there is
    none (no ticket, the work raised, the helper died or is too slow: it is then stopped)."""
    helper = _helper_of(problem)
    if ticket is None or helper is None:
        return None
    answer = helper.take(problem, ticket, wait_s)
    if answer is None:
        _stop()
    return answer


def under_way(problem: Problem) -> int | None:
    """The ticket of the work the helper is doing now (it works in order: the first asked
    for and not answered), or None where it has nothing to do."""
    helper = _helper_of(problem)
    if helper is None:
        return None
    helper.idle()  # reads what is in
    return min(helper.waiting, default=None)


def withdraw(problem: Problem, ticket: int) -> None:
    """Withdraw `ticket`'s work: the helper skips it if it has not started it, and its
    answer, if it comes, is dropped."""
    helper = _helper_of(problem)
    if helper is not None:
        helper.withdraw(ticket)


def has_helper(problem: Problem) -> bool:
    """Whether `problem`'s search has a helper with nothing else to do."""
    helper = _helper_of(problem)
    return helper is not None and helper.idle()


def evaluate_batch(
    problem: Problem,
    batch: Sequence[GlobalChoices],
    evaluate: Callable[[GlobalChoices], Scored],
    more: Callable[[], list[GlobalChoices]] | None = None,
    worth: Callable[[int], bool] = lambda count: True,
    behind: int | None = None,
) -> tuple[list[GlobalChoices], list[Scored]]:
    """`batch + more()` and `[evaluate(c) for c in batch + more()]`, shared with the helper
    where the search has one with nothing else to do (module doc) and `worth` says half of
    them are worth sending (half of `batch`, before `more()`). Each plan goes to the
    helper on its own, the last first: `batch`'s before `more()` is called, so the helper
    builds while this process finds the rest (those plans must not depend on what `more()`
    does: their busy rates known, `screen._fill_from`), and those of `more()` once known
    (without `more`, this process starts on the first at once: it is not sent). This
    process then goes from the front: it builds, with `evaluate` (which may remember what
    it builds), each plan the helper has not started, withdrawing it there, and waits for
    the rest; the helper's plans are returned without `evaluate` seeing them. Neither
    waits while the other has a plan left to start, however long the plans and `more()`
    take. With `behind` (the ticket of the work the helper is at), the batch is shared
    where that is all the helper has to do: it starts on the batch once that is done."""
    helper = _helper_of(problem)
    everything = list(batch)
    tickets: dict[int, int] = {}  # position in `everything` -> the helper's ticket
    if helper is not None and helper.free(behind) and worth(len(batch) // 2):
        _offer(problem, helper, everything, range(0 if more else 1, len(batch)), tickets)
    if more is not None:
        everything += more()
    sharing = helper is not None and (
        bool(tickets) or (helper.free(behind) and worth(len(everything) // 2))
    )
    if sharing:  # with none sent yet, this process starts on the first at once
        unsent = range(len(batch) if tickets else 1, len(everything))
        _offer(problem, helper, everything, unsent, tickets)
    started_s = time.perf_counter()
    plans: dict[int, Scored] = {}
    for i, choices in enumerate(everything):
        if i in tickets and helper.taken(tickets[i]):
            continue
        if i in tickets:
            helper.withdraw(tickets.pop(i))
        plans[i] = evaluate(choices)
    wait_s = max(BATCH_MIN_WAIT_S, BATCH_WAIT_FACTOR * (time.perf_counter() - started_s))
    answered = True
    for i, ticket in tickets.items():
        # a helper that failed is stopped: the rest is built here, and it is not asked again
        answer = result(problem, ticket, wait_s) if answered else None
        answered = answer is not None
        plans[i] = answer[0] if answered else evaluate(everything[i])
    return everything, [plans[i] for i in range(len(everything))]


def _offer(
    problem: Problem,
    helper: _Helper,
    everything: list[GlobalChoices],
    positions: range,
    tickets: dict[int, int],
) -> None:
    """Send the plans of `everything` at `positions` to `helper`, one each, the last first
    (this process's busy rates with the first), into `tickets` by position."""
    rates = True
    for i in reversed(positions):
        ticket = helper.call(problem, _built, (everything[i],), rates)
        if ticket is None:
            return
        tickets[i], rates = ticket, False


def safe_to_fork() -> bool:
    """Whether a fork here is safe and can run beside this process: on Linux (`FORKS`), in
    the process's one thread (a fork copies one thread; a lock another thread held would stay
    held in the child), not a daemon (it may have no children), with a second CPU."""
    return (
        FORKS and _only_thread() and not multiprocessing.current_process().daemon and _cpus() >= 2
    )


def _wanted() -> bool:
    """Whether the environment lets searches have a helper (HELPER_VARIABLE; unset: yes)."""
    setting = os.environ.get(HELPER_VARIABLE, "on")
    if setting.strip().lower() not in HELPER_SETTINGS:
        allowed = ", ".join(HELPER_SETTINGS)
        raise InputError(f"{HELPER_VARIABLE}={setting!r} is not one of {allowed}")
    return HELPER_SETTINGS[setting.strip().lower()]


def _only_thread() -> bool:
    """Whether this is the process's one Python thread (a progress bar's monitor, a study
    writer or the caller's threads keep the work here)."""
    return threading.active_count() == 1


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class _Helper:
    """The helper process, the pipe to it, which search's problem it holds, and the answers
    read but not yet taken."""

    process: Any
    connection: Any
    owner_pid: int
    search_id: int | None = None
    waiting: set[int] = field(default_factory=set)
    answers: dict[int, Any] = field(default_factory=dict)
    withdrawn: set[int] = field(default_factory=set)  # answers to drop when they come
    rates_sent: dict = field(default_factory=dict)  # step -> its rates' entries sent so far

    def call(
        self, problem: Problem, work: Callable, args: tuple, with_rates: bool = True
    ) -> int | None:
        """Send `work(problem, *args)` (and the problem, once per search, and this process's
        busy rates, `with_rates`); a ticket, or None where the helper is gone."""
        ticket = next(_TICKETS)
        try:
            search_id = _search_id(problem)
            if self.search_id != search_id:
                self.connection.send(("problem", search_id, replace(problem, cache={})))
                self.search_id, self.rates_sent = search_id, {}
            rates = self._new_rates(problem) if with_rates else {}
            self.connection.send(("call", ticket, search_id, rates, work, args))
        except (OSError, ValueError):  # the helper is gone (or the pipe closed)
            return None
        self.waiting.add(ticket)
        return ticket

    def _new_rates(self, problem: Problem) -> dict:
        """The busy-rate entries this process found since it last sent them, by step: a
        table only grows (`screen.rates_table`: an entry, once set, never changes), in order."""
        rates = {}
        for train, table in rate_tables(problem).items():
            sent = self.rates_sent.get(train, 0)
            if len(table) > sent:
                rates[train] = dict(itertools.islice(table.items(), sent, None))
                self.rates_sent[train] = len(table)
        return rates

    def withdraw(self, ticket: int) -> None:
        if ticket not in self.waiting:
            self.answers.pop(ticket, None)
            return
        with contextlib.suppress(OSError, ValueError):  # else the helper is gone
            self.connection.send(("withdraw", ticket))
        self.waiting.discard(ticket)
        self.withdrawn.add(ticket)

    def taken(self, ticket: int) -> bool:
        """Whether the helper has answered `ticket` or is at it (it works in order)."""
        self._read(wait_s=0.0)
        return ticket not in self.waiting or ticket == min(self.waiting)

    def idle(self) -> bool:
        """Whether every answer asked for is in (read without waiting)."""
        return self.free()

    def free(self, behind: int | None = None) -> bool:
        """Whether every answer asked for is in but `behind`'s (read without waiting)."""
        self._read(wait_s=0.0)
        return self.waiting <= {behind}

    def take(self, problem: Problem, ticket: int, wait_s: float) -> tuple[Any] | None:
        """`(value,)` of `ticket`'s work, waiting at most `wait_s`; None where there is none
        (the work raised, its answer cannot be read, the helper died or was too slow)."""
        deadline = time.perf_counter() + wait_s
        while ticket in self.waiting:
            if not self._read(max(0.0, deadline - time.perf_counter())):
                return None
        answer = self.answers.pop(ticket, None)
        try:
            return None if answer is None else _loads(answer, problem)
        except Exception:  # an answer that cannot be read is no answer: done here
            return None

    def _read(self, wait_s: float) -> bool:
        """Read one answer, or every one already in (`wait_s` 0); False where none came."""
        try:
            if not self.connection.poll(wait_s):
                return False
            while True:
                ticket, answer = self.connection.recv()
                self.waiting.discard(ticket)
                if ticket in self.withdrawn:
                    self.withdrawn.discard(ticket)
                else:
                    self.answers[ticket] = answer
                if wait_s or not self.connection.poll(0.0):
                    return True
        except (EOFError, OSError):  # it died: nothing more will come
            return False


_LOCK = threading.Lock()
_HOLDER: int | None = None  # the search id of the search holding the helper
_HELPER: _Helper | None = None
_SEARCH_IDS = itertools.count()
_TICKETS = itertools.count()


def _helper_of(problem: Problem) -> _Helper | None:
    """The helper, where `problem`'s search holds it: the one this process forked and still
    runs, else a new one where a fork is safe; else None."""
    global _HELPER
    if _HOLDER is None or _search_id(problem) != _HOLDER:
        return None
    if _HELPER is not None and _HELPER.owner_pid != os.getpid():
        _HELPER = None  # forked with this process: the helper is its parent's
    if _HELPER is not None and not _HELPER.process.is_alive():
        _stop()
    if _HELPER is None and safe_to_fork():
        _HELPER = _fork()
    return _HELPER


def _fork() -> _Helper | None:
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    process = context.Process(target=_serve, args=(theirs,), daemon=True)
    try:
        with warnings.catch_warnings():  # HiGHS's idle pool threads (module doc)
            warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
            process.start()
    except OSError:  # no process to be had: the work is done here
        mine.close()
        return None
    finally:
        theirs.close()
    return _Helper(process, mine, os.getpid())


def _stop() -> None:
    """Stop and reap the helper (a later search forks another)."""
    global _HELPER
    helper, _HELPER = _HELPER, None
    if helper is None or helper.owner_pid != os.getpid():
        return
    helper.connection.close()
    if helper.process.is_alive():
        helper.process.kill()
    helper.process.join()


def _search_id(problem: Problem) -> int:
    """A number for the search `problem` belongs to (its cache is the search's)."""
    return problem.memo("helper search id", lambda: next(_SEARCH_IDS))


def _built(problem: Problem, choices: GlobalChoices) -> Scored:
    """In the helper: the plan of `choices`."""
    return plan_for_choices(problem, choices)


def planned(problem: Problem, choices: GlobalChoices) -> tuple[Scored, float]:
    """In the helper: the plan of `choices`, and the seconds it took."""
    started_s = time.perf_counter()
    return plan_for_choices(problem, choices), time.perf_counter() - started_s


class _Pickler(pickle.Pickler):
    """Pickles the problem's cluster, model and cost model by name: the other process has
    them (`_dumps`, `_loads`); and the frozen slotted dataclasses of plans and clusters as
    their field values (`_slotted_reducers`). Both through a dispatch table, which pickle
    consults in C, by type, for objects of classes other than the built-in ones: a
    `persistent_id` method is a Python call for every object pickled, and the dataclasses'
    own slotted pickling looks their fields up for every object (the two were 85 % of
    pickling the baselines of 128 GPUs: 3.0 ms, now 0.5 ms; unpickling 1.5 ms, now 1.3 ms)."""

    def __init__(self, file, problem: Problem) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        table = {**copyreg.dispatch_table, **_slotted_reducers()}
        for name in SHARED:
            shared = getattr(problem, name)
            fallback = table.get(type(shared))
            table[type(shared)] = functools.partial(_reduce_shared, shared, name, fallback)
        self.dispatch_table = table


def _reduce_shared(shared, name: str, fallback, obj):
    """`obj` by `name` where it is the problem's `shared` part; else as its class would."""
    if obj is shared:
        return _shared_part, (name,)
    return fallback(obj) if fallback is not None else obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _shared_part(name: str):
    """Stands in a pickle for the problem's part `name`: `_Unpickler` resolves it."""
    raise pickle.UnpicklingError(f"{name!r} is the unpickling problem's own part")


@functools.cache
def _slotted_reducers() -> dict[type, Callable]:
    """Reducers of the frozen slotted dataclasses a plan or a cluster holds: the class and
    its field values, restored by `_restored` (the fields looked up once per class)."""
    from hexiseq.cluster import Device, Node
    from hexiseq.model import ModelSpec, TrainSpec
    from hexiseq.plan import Prediction, RankAssignment, RankPrediction, RankTime

    slotted = (RankAssignment, RankTime, RankPrediction, Prediction, Node, Device)
    return {
        cls: functools.partial(_reduce_slotted, cls, _field_values(cls))
        for cls in (*slotted, ModelSpec, TrainSpec)
    }


def _field_values(cls: type) -> Callable[[Any], tuple]:
    return operator.attrgetter(*_field_names(cls))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _reduce_slotted(cls: type, values: Callable[[Any], tuple], obj):
    return _restored, (cls, values(obj))


def _restored(cls: type, values: tuple):
    """The frozen dataclass `cls` with these field values, as its own unpickling makes it
    (no `__init__`, no `__post_init__`: the values were checked when first made)."""
    obj = object.__new__(cls)
    for name, value in zip(_field_names(cls), values):
        object.__setattr__(obj, name, value)
    return obj


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, problem: Problem) -> None:
        super().__init__(file)
        self.problem = problem

    def find_class(self, module: str, name: str):
        if module == __name__ and name == "_shared_part":
            return self._part
        return super().find_class(module, name)

    def _part(self, name: str):
        if name not in SHARED:
            raise pickle.UnpicklingError(f"no shared object {name!r}")
        return getattr(self.problem, name)


def _dumps(value, problem: Problem) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, problem).dump(value)
    return buffer.getvalue()


def _loads(data: bytes, problem: Problem):
    return _Unpickler(io.BytesIO(data), problem).load()


def _serve(connection) -> None:
    """In the helper: do what is sent until the pipe closes. Each answer is `(ticket,
    bytes)`, the bytes `(value,)` pickled by `_dumps`, or `(ticket, None)` where the work
    raised (this process then does it, and raises what it raises) or its value cannot be
    pickled."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # As in the parent's searches (`search.api`), the collector is paused while a search
    # runs, and collects once a new search's problem comes (the cache cleared, nothing was
    # left to free over 60 searches): enabled, its collections made the helper's share of a
    # 64-GPU search 1.25x slower than the same work in the parent. What was inherited stays
    # out of every collection (walking it would copy every page of it).
    gc.freeze()
    gc.disable()
    problem, search_id = None, None
    work: collections.deque = collections.deque()
    withdrawn: set[int] = set()
    while True:
        try:  # take in all that was sent; wait for more only with nothing to do
            while not work or connection.poll(0.0):
                message = connection.recv()
                if message[0] == "problem":
                    if problem is not None:
                        problem.cache.clear()  # its local models refer back to it
                        gc.collect()  # the last search's cycles, if any (about 1 ms)
                    _, search_id, problem = message
                    withdrawn.clear()
                elif message[0] == "withdraw":
                    withdrawn.add(message[1])
                else:
                    work.append(message)
        except (EOFError, OSError):
            return
        _, ticket, wanted, rates, function, args = work.popleft()
        if wanted == search_id:  # the rates found since the last call, withdrawn or not
            for train, table in rates.items():
                rates_table(problem, train).update(table)
        if ticket in withdrawn:  # skipped; the empty answer lets the parent forget it
            withdrawn.discard(ticket)
            try:
                connection.send((ticket, None))
            except (OSError, ValueError):
                return
            continue
        try:
            if wanted != search_id:
                raise LookupError("work of another search")
            answer = _dumps((function(problem, *args),), problem)
        except Exception:
            answer = None
        try:
            connection.send((ticket, answer))
        except (OSError, ValueError):
            return
        except Exception:  # cannot be sent: done there instead
            connection.send((ticket, None))
