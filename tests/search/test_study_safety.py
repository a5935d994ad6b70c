"""Stored studies: a killed search leaves nothing running after a resume; a study searched
over another space, or of another kind, is refused with one clear message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest

from hexiseq.errors import InputError
from hexiseq.search import objective, plan_search

CHILD = textwrap.dedent(
    """
    import sys, time
    import hexiseq.search.objective as objective
    objective.HEARTBEAT_S, objective.GRACE_S = 1, 2
    original = objective.Objective.__call__

    def stuck_after_four(self, trial):
        if trial.number >= 4:  # this trial stays RUNNING until the process is killed
            print("stuck", flush=True)
            time.sleep(600)
        return original(self, trial)

    objective.Objective.__call__ = stuck_after_four
    from hexiseq import plan_search
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=40, storage=sys.argv[1],
                study_name="killed")
    """
)


def test_a_killed_search_is_resumed_with_its_stuck_trial_failed_and_retried(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "stuck"
        time.sleep(1.5)  # killed mid-trial, after its first heartbeat
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    study = optuna.load_study(study_name="killed", storage=url)
    running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(running) == 1
    monkeypatch.setattr(objective, "GRACE_S", 2)
    time.sleep(3)  # the killed trial's heartbeat is older than the grace period now
    plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=3, storage=url, study_name="killed")
    study = optuna.load_study(study_name="killed", storage=url)
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.number for t in failed] == [running[0].number]
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert retried and retried[0].state == optuna.trial.TrialState.COMPLETE


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
