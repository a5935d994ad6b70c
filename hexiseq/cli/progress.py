"""The progress bar of `hexiseq plan`: on stderr, and only when stderr is a terminal, so that a
pipe or a log file stays clean.

One worker: Optuna's own bar in this process (`plan_search(show_progress=True)`). Several
workers (`--workers N`) search in other processes, so this process reads the stored study's
finished trials every half second and shows them against `--trials` (or the seconds of
`--time-budget` when no count is given), with tqdm (a dependency).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

POLL_S = 0.5


class SearchProgress:
    """`with search_progress(...) as progress: plan_search(..., show_progress=progress.
    optuna_bar)`; a disabled one does nothing."""

    optuna_bar: bool = False

    def __enter__(self) -> SearchProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


class _OptunaBar(SearchProgress):
    optuna_bar = True


def search_progress(
    *,
    storage: str | None,
    study_name: str,
    workers: int,
    n_trials: int | None,
    time_budget_s: float | None,
    stream: TextIO | None = None,
) -> SearchProgress:
    """The bar for a search: none unless `stream` (stderr) is a terminal and the search samples
    (a trial count, or a time budget over a second); Optuna's with one worker; else a
    `StudyBar` reading the stored study."""
    stream = sys.stderr if stream is None else stream
    long_search = n_trials is not None or (time_budget_s is not None and time_budget_s > 1)
    if not (long_search and stream.isatty()):
        return SearchProgress()
    if workers == 1 or storage is None:
        return _OptunaBar()
    return StudyBar(storage, study_name, n_trials, time_budget_s, stream)


class StudyBar(SearchProgress):
    """A tqdm bar of the trials that finish in a stored study while the block runs (its own
    thread reads the storage; a read that fails is skipped, never raised)."""

    def __init__(
        self,
        storage: str,
        study_name: str,
        n_trials: int | None,
        time_budget_s: float | None,
        stream: TextIO,
        poll_s: float = POLL_S,
    ) -> None:
        self.storage_url, self.study_name = storage, study_name
        self.n_trials, self.time_budget_s = n_trials, time_budget_s
        self.stream, self.poll_s = stream, poll_s
        self._storage = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hexiseq-progress", daemon=True)
        self._bar = None
        self._base = 0
        self._started = 0.0

    def __enter__(self) -> StudyBar:
        from tqdm import tqdm

        self._base = self.finished_trials() or 0  # a resumed study's earlier trials
        self._started = time.monotonic()
        by_count = self.n_trials is not None
        self._bar = tqdm(
            total=self.n_trials if by_count else round(self.time_budget_s or 0),
            desc="search",
            unit="trial" if by_count else "s",
            file=self.stream,
            leave=True,
            dynamic_ncols=True,
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._show()
        self._bar.close()
        if self._storage is not None:
            self._storage.remove_session()
            self._storage.engine.dispose()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._show()

    def _show(self) -> None:
        finished = self.finished_trials()
        done = 0 if finished is None else max(0, finished - self._base)
        if self.n_trials is not None:
            self._bar.n = min(done, self.n_trials)
        else:
            elapsed = time.monotonic() - self._started
            self._bar.n = min(round(elapsed), self._bar.total)
            self._bar.set_postfix_str(f"{done} trials", refresh=False)
        self._bar.refresh()

    def finished_trials(self) -> int | None:
        """Completed trials of the study now; None while it (or its storage) does not exist
        yet or cannot be read."""
        try:
            storage = self._open_storage()
            study_id = storage.get_study_id_from_name(self.study_name)
            from optuna.trial import TrialState

            trials = storage.get_all_trials(
                study_id, deepcopy=False, states=(TrialState.COMPLETE,)
            )
        except Exception:  # a progress bar must never end the search: skip this read
            return None
        return len(trials)

    def _open_storage(self):
        if self._storage is None:
            from optuna.storages import RDBStorage

            # Reads only: the search creates the tables (no race with its schema setup).
            self._storage = RDBStorage(
                self.storage_url, skip_compatibility_check=True, skip_table_creation=True
            )
        return self._storage
