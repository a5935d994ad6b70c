"""Opening a (stored) Optuna study, and recovering the trials a killed process left running.

A hexiseq search writes only finished trials (`search.sampling`); a process sampling on the
storage the Optuna way (`study.optimize` on it, an older hexiseq) leaves its trial running when
killed. A stored study's running trials beat every `HEARTBEAT_S`. A trial whose process was
killed is failed by the next search on the study and scored again in that process, then added
to the study finished in one write: never re-enqueued as a waiting trial, which two processes
sharing a SQLite study could both take (SQLite cannot lock the row), nor run as a trial a
second kill could leave behind. Optuna fails a trial whose last beat is older than `GRACE_S`; a
trial killed before its first beat (between `ask` and the heartbeat thread's first write)
Optuna never fails, so `recover_killed_trials` also fails a running trial with no beat that
started more than `GRACE_S` ago.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState
from sqlalchemy import DateTime, bindparam, text
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from hexiseq.errors import InputError, StoreError
from hexiseq.search.objective import Objective, choices_from_params
from hexiseq.store import (
    SQLITE_BUSY_TIMEOUT_S,
    display_url,
    mask_url_passwords,
    retry_schema_race,
)
from hexiseq.store.busy_server import ENGINE_PLUGIN

HEARTBEAT_S = 10
GRACE_S = 60
"""A stored study's running trials beat every HEARTBEAT_S; one silent for GRACE_S (its process
was killed) is failed by the next search on the study and scored again once."""
RETRY_OF_ATTR = "retry_of"
"""User attribute of a trial scored again: the number of the killed trial it stands for."""


def create_study(
    storage: str | None,
    name: str,
    seed: int,
    multi_objective: bool,
    objective: Objective | None = None,
):
    """The study `name` in `storage` (created if new; in memory without a storage), with
    heartbeats on stored trials; `objective` scores again the trials of killed processes.
    A URL that cannot be used, or a study of the other kind (single- vs multi-objective),
    is one masked `InputError`."""
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)
    directions = ["maximize", "maximize"] if multi_objective else ["maximize"]
    try:
        study = retry_schema_race(
            lambda: optuna.create_study(
                storage=_storage(storage, objective),
                study_name=name,
                sampler=sampler,
                directions=directions,
                load_if_exists=True,
            )
        )
    except (ArgumentError, ImportError, SQLAlchemyError) as error:
        # SQLAlchemy's message repeats the URL, password and all: one masked line instead.
        reason = mask_url_passwords((str(error).splitlines() or [type(error).__name__])[0])
        raise InputError(
            f"storage URL {display_url(str(storage))!r} is not usable: {reason}"
        ) from None
    except RuntimeError as error:  # Optuna's own tables, made by an older Optuna
        reason = mask_url_passwords((str(error).splitlines() or ["RuntimeError"])[0])
        if "optuna storage upgrade" not in reason:
            raise
        raise InputError(
            f"storage URL {display_url(str(storage))!r} holds Optuna tables of a schema that "
            f"the installed Optuna {optuna.__version__} cannot use; back the database up and "
            "run `optuna storage upgrade --storage <URL>`, or use another storage"
        ) from None
    except ValueError as error:  # e.g. a stored study with other directions
        reason = mask_url_passwords((str(error).splitlines() or ["ValueError"])[0])
        raise InputError(f"study {name!r} cannot be used for this search: {reason}") from None
    if len(study.directions) != len(directions):
        kinds = {1: "throughput only", 2: "throughput and memory headroom (Pareto)"}
        raise InputError(
            f"study {name!r} was made to search {kinds[len(study.directions)]}, this search "
            f"wants {kinds[len(directions)]}; use another storage or study name (`hexiseq plan "
            "--study-name`, `plan_search(study_name=...)`)"
        )
    return study


@contextmanager
def study_storage_errors(url: str | None) -> Iterator[None]:
    """A stored study's database failing mid-search (the server refusing more clients, gone,
    the disk full) as one masked `StoreError` line naming the storage, not Optuna's traceback
    (whose message, "An exception is raised during the commit", hides why)."""
    try:
        yield
    except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as error:
        cause = error.__cause__ if isinstance(error.__cause__, SQLAlchemyError) else error
        reason = mask_url_passwords((str(cause).splitlines() or [type(cause).__name__])[0])
        raise StoreError(
            f"study storage {display_url(str(url))} failed during the search: {reason}"
        ) from None


def _storage(url: str | None, objective: Objective | None):
    if url is None:
        return None
    with warnings.catch_warnings():  # heartbeats are marked experimental; they are what we want
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Optuna 4.9 renamed the callback's argument; older releases (>= 3.4 allowed) know
        # the old name.
        parameters = inspect.signature(optuna.storages.RDBStorage).parameters
        if "heartbeat_stale_trial_callback" in parameters:
            callback = {"heartbeat_stale_trial_callback": ScoreAgain(objective)}
        else:
            callback = {"failed_trial_callback": ScoreAgain(objective)}
        return optuna.storages.RDBStorage(
            url,
            engine_kwargs=_engine_kwargs(url),
            heartbeat_interval=HEARTBEAT_S,
            grace_period=GRACE_S,
            **callback,
        )


def _engine_kwargs(url: str) -> dict:
    """A study waits for its database as long as a store does: SQLite for another process's
    write lock (the driver's 5 s made 1-2 of 29 processes sharing a new study fail "database
    is locked"), PostgreSQL for a connection slot (`hexiseq.store.busy_server`)."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
    return {"plugins": [ENGINE_PLUGIN]}  # a PostgreSQL server out of connection slots: wait


class ScoreAgain:
    """Optuna's stale-trial callback: the killed trial's choices scored here and added to the
    study finished, marked `RETRY_OF_ATTR`. A trial killed before it chose everything has
    nothing to score again."""

    def __init__(self, objective: Objective | None) -> None:
        self.objective = objective

    def __call__(self, study, trial: optuna.trial.FrozenTrial) -> None:
        if self.objective is None:
            return
        try:
            choices_from_params(self.objective.problem, trial.params)
        except (KeyError, TypeError, ValueError):
            return
        study.add_trial(self.objective.scored_trial(trial.params, **{RETRY_OF_ATTR: trial.number}))


def recover_killed_trials(study, objective: Objective) -> None:
    """Fail the running trials of killed processes (beat older than `GRACE_S`, or no beat and
    started more than `GRACE_S` ago) and score each again (once: another process recovering
    the same study at the same moment takes the ones it failed first)."""
    storage = _rdb_storage(study)
    if storage is None:
        return
    with warnings.catch_warnings():  # marked experimental, like the heartbeats
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # beat too long ago: Optuna's check, our callback
    for trial_id in _beatless_trial_ids(storage, study.study_name):
        try:
            if storage.set_trial_state_values(trial_id, state=TrialState.FAIL) is False:
                continue
        except UpdateFinishedTrialError:  # another process failed it first
            continue
        ScoreAgain(objective)(study, storage.get_trial(trial_id))


def _rdb_storage(study) -> optuna.storages.RDBStorage | None:
    storage = getattr(study._storage, "_backend", study._storage)  # Optuna wraps it in a cache
    return storage if isinstance(storage, optuna.storages.RDBStorage) else None


_BEATLESS_TRIALS = text(
    "SELECT trials.trial_id FROM trials"
    " JOIN studies ON studies.study_id = trials.study_id"
    " LEFT JOIN trial_heartbeats ON trial_heartbeats.trial_id = trials.trial_id"
    " WHERE studies.study_name = :name AND trials.state = 'RUNNING'"
    " AND trial_heartbeats.trial_id IS NULL AND trials.datetime_start < :started_before"
).bindparams(bindparam("started_before", type_=DateTime()))
"""Running trials of a study that never beat, started before a time (Optuna's RDB schema:
stable since Optuna 2; `datetime_start` is the asking process's local time)."""


def _beatless_trial_ids(storage: optuna.storages.RDBStorage, name: str) -> list[int]:
    started_before = datetime.now() - timedelta(seconds=GRACE_S)
    with storage.engine.connect() as connection:
        rows = connection.execute(
            _BEATLESS_TRIALS, {"name": name, "started_before": started_before}
        )
        return [row[0] for row in rows]
