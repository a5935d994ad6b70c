"""Stored studies: a killed search keeps what it finished and leaves nothing running; trials
left running by another process (Optuna's own sampling on the storage) are failed and scored
again by the next search; a study searched over another space, or of another kind, is refused
with one clear message."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest
from sqlalchemy.exc import OperationalError

from hexiseq.errors import InputError, StoreError
from hexiseq.search import plan_search, sampling, studies

CHILD = textwrap.dedent(
    """
    import sys, time
    import hexiseq.search.objective as objective
    import hexiseq.search.optuna_layer as optuna_layer
    import hexiseq.search.studies as studies
    studies.HEARTBEAT_S, studies.GRACE_S = 1, 2
    original = objective.Objective.__call__

    def stuck_after_six(self, trial):
        if trial.number >= 6:  # this trial chooses, then runs until killed
            self.sample(trial)
            print("stuck", flush=True)
            time.sleep(600)
        return original(self, trial)

    def optuna_on_the_storage(study, objective, options, count, budget_s):
        study.optimize(objective, n_trials=count)  # Optuna's own way: trials run stored

    objective.Objective.__call__ = stuck_after_six
    if sys.argv[2] == "optuna":
        optuna_layer.sample = optuna_on_the_storage
    from hexiseq import plan_search
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=40, storage=sys.argv[1],
                study_name="killed")
    """
)


def _killed_while_stuck(url: str, sampling: str) -> None:
    """The CHILD search (`sampling`: "hexiseq" or "optuna"), killed in its seventh trial (the
    short list is its first four)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, sampling], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "stuck"
        time.sleep(1.5)  # killed mid-trial, after a first heartbeat where there are any
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def test_a_killed_search_keeps_the_trials_it_finished_and_leaves_none_running(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    _killed_while_stuck(url, "hexiseq")
    study = optuna.load_study(study_name="killed", storage=url)
    assert [t.number for t in study.trials] == [0, 1, 2, 3, 4, 5]  # trial 6 was never written
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}
    sampled = [t.system_attrs.get(sampling.WRITER_ATTR) for t in study.trials[4:]]
    assert None not in sampled  # 4 and 5 were sampled, then written by the mirror
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="killed")
    study = optuna.load_study(study_name="killed", storage=url)
    assert len(study.trials) == 9
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}


def test_a_trial_left_running_by_a_killed_process_is_failed_and_scored_again(
    tmp_path, monkeypatch
):
    """A process sampling on the storage the Optuna way leaves its trial RUNNING when killed;
    the next search fails it (its heartbeat stopped) and scores its choices again, once."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    _killed_while_stuck(url, "optuna")
    study = optuna.load_study(study_name="killed", storage=url)
    running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(running) == 1
    monkeypatch.setattr(studies, "GRACE_S", 2)
    time.sleep(3)  # the killed trial's heartbeat is older than the grace period now
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="killed")
    study = optuna.load_study(study_name="killed", storage=url)
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.number for t in failed] == [running[0].number]
    retried = [
        t for t in study.trials if t.user_attrs.get(studies.RETRY_OF_ATTR) == failed[0].number
    ]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    assert retried[0].params == failed[0].params


def _beatless_trial(url: str, name: str, like: optuna.trial.FrozenTrial, count: int) -> int:
    """A RUNNING trial as a process killed before its first heartbeat leaves it: asked
    without heartbeats, the first `count` choices of trial `like` taken, never told."""
    study = optuna.load_study(study_name=name, storage=url)  # no heartbeats on this storage
    study.enqueue_trial(like.params)
    trial = study.ask()
    for name, distribution in list(like.distributions.items())[:count]:
        trial.suggest_categorical(name, distribution.choices)
    assert trial.params == dict(list(like.params.items())[:count])
    return trial.number


def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_scored_again(
    tmp_path, monkeypatch
):
    """Optuna never fails a running trial that has no heartbeat at all; the next search does,
    once it is older than the grace period, and scores its choices again."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=2, storage=url, study_name="s")
    whole = next(t for t in optuna.load_study(study_name="s", storage=url).trials if t.params)
    chosen = _beatless_trial(url, "s", whole, len(whole.params))
    half = _beatless_trial(url, "s", whole, 1)
    monkeypatch.setattr(studies, "GRACE_S", 3600)  # younger than the grace period
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=1, storage=url, study_name="s")
    young = {t.number: t.state for t in optuna.load_study(study_name="s", storage=url).trials}
    monkeypatch.setattr(studies, "GRACE_S", 0.5)
    time.sleep(0.6)  # both older than the grace period now
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=1, storage=url, study_name="s")
    trials = optuna.load_study(study_name="s", storage=url).trials
    states = {t.number: t.state for t in trials}
    retried = [t for t in trials if studies.RETRY_OF_ATTR in t.user_attrs]
    assert young[chosen] == young[half] == optuna.trial.TrialState.RUNNING
    assert states[chosen] == states[half] == optuna.trial.TrialState.FAIL
    assert [t.user_attrs[studies.RETRY_OF_ATTR] for t in retried] == [chosen]  # half: nothing
    assert retried[0].state == optuna.trial.TrialState.COMPLETE
    assert retried[0].params == whole.params and retried[0].values == whole.values


def test_the_short_list_leaves_no_waiting_or_running_trial(tmp_path):
    """Shared-study safety: the short list's trials are added finished, never enqueued (two
    processes could take one waiting trial) or left running."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = plan_search("cpu-emulated-2type", "tiny", 512, n_trials=3, storage=url,
                         study_name="s")  # fmt: skip
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert result.best is not None and len(trials) == 3
    assert {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}


@pytest.mark.parametrize(
    ("first", "then", "message"),
    [
        ({}, {"activation_checkpointing": True}, "was searched over another space"),
        ({}, {"multi_objective": True}, "was made to search throughput only"),
    ],
)
def test_a_study_of_another_search_is_refused(tmp_path, first, then, message):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search(
        "cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="s", **first
    )
    with pytest.raises(InputError, match=message):
        plan_search(
            "cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="s", **then
        )


def test_a_study_of_another_cluster_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="s")
    with pytest.raises(InputError, match=r"another space \(trial 0: hp_degree\["):
        plan_search("h100x8-a100x8", "tiny", 8192, n_trials=3, storage=url, study_name="s")


def test_forced_checkpointing_gets_a_study_of_its_own(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    free = plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url)
    forced = plan_search(
        "cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, activation_checkpointing=True
    )
    assert forced.study_name == free.study_name + "/checkpointing-on"


def test_an_unreachable_storage_is_one_masked_line():
    with pytest.raises(InputError) as caught:
        plan_search(
            "cpu-emulated-2type", "tiny", 8192, n_trials=2, storage="sqlite:////no/such/dir/x.db"
        )
    assert "is not usable" in str(caught.value) and "\n" not in str(caught.value)


def test_a_trial_another_process_is_sampling_right_now_is_not_another_space(tmp_path):
    """A RUNNING trial of a concurrent search may hold only some of its choices yet: the
    search-space check does not mistake it for a study of another space (it did, under 29
    processes sharing one new study: benchmarks/store_safety.py)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=2, storage=url, study_name="s")
    study = optuna.load_study(study_name="s", storage=url)
    halfway = study.ask()  # another worker, one choice sampled so far
    halfway.suggest_categorical("hp_degree[cpu]", [1, 2])
    result = plan_search("cpu-emulated-2type", "tiny", 512, n_trials=3, storage=url,
                         study_name="s")  # fmt: skip
    assert result.best is not None
    running = optuna.trial.TrialState.RUNNING
    assert [t.state for t in study.get_trials(deepcopy=False)].count(running) == 1


def _refused(*_args, **_kwargs):
    """What Optuna raises when the server refuses another connection mid-search."""
    cause = OperationalError(
        "SELECT 1", {}, Exception("connection to server at 10.0.0.9 failed: FATAL: sorry, too "
                                  "many clients already (postgresql://u:hunter2@10.0.0.9/db)")
    )  # fmt: skip
    raise optuna.exceptions.StorageInternalError(
        "An exception is raised during the commit."
    ) from (cause)


def test_a_storage_failing_mid_search_is_one_masked_store_error(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=2, storage=url, study_name="s")
    monkeypatch.setattr(optuna.storages.RDBStorage, "_create_new_trial", _refused)
    with pytest.raises(StoreError) as caught:
        plan_search("cpu-emulated-2type", "tiny", 512, n_trials=3, storage=url, study_name="s")
    message = str(caught.value)
    assert "\n" not in message and "hunter2" not in message
    assert "too many clients already" in message and str(tmp_path / "study.db") in message


class _ReadWhileFinishing:
    """A study read while another process finishes a trial: Optuna reads a trial's rows one
    table at a time, so trial 1 comes back RUNNING with its value but one choice missing."""

    def __init__(self, complete: optuna.trial.FrozenTrial) -> None:
        torn = copy.deepcopy(complete)
        torn.number, torn.state, torn.values = 1, optuna.trial.TrialState.RUNNING, [9e9]
        torn.params = dict(list(complete.params.items())[:-1])
        self.trials = [complete, torn]

    def get_trials(self, deepcopy=True, states=None):
        return [t for t in self.trials if states is None or t.state in states]


def test_a_trial_read_while_another_process_finishes_it_is_no_polish_start(tmp_path):
    from hexiseq.search.optuna_layer import _best_feasible

    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=1, storage=url, study_name="s")
    complete = optuna.load_study(study_name="s", storage=url).trials[0]
    assert [t.number for t in _best_feasible(_ReadWhileFinishing(complete), 4)] == [0]
