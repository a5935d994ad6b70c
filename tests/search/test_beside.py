"""The baselines scored beside the study, in a forked process (`search.beside`)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from hexiseq import Cluster, ModelSpec, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.plan import Plan
from hexiseq.search import api, beside, plan_search
from hexiseq.search._evaluate import Problem

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the baselines are forked on Linux only"
)


def problem_on(preset: str) -> Problem:
    cluster = Cluster.preset(preset)
    return Problem(
        cluster, ModelSpec.preset("llama3-8b"), TrainSpec(seq_len=2**20), DatasheetCostModel()
    )


ONLY_THREAD = beside._only_thread


@pytest.fixture(autouse=True)
def two_cpus_one_thread(monkeypatch):
    """The machine's CPU count is not the test's business, nor the threads earlier tests
    left behind (a progress bar's monitor lives as long as the process): forking is allowed
    to need two CPUs and one thread."""
    monkeypatch.setattr(beside, "_cpus", lambda: 2)
    monkeypatch.setattr(beside, "_only_thread", lambda: True)


def pid_and_devices(problem: Problem) -> tuple[int, int]:
    return os.getpid(), problem.cluster.world_size


def in_child_only(action):
    """A score that does `action()` first in a child process (not in this one), then
    answers `pid_and_devices`."""
    parent = os.getpid()

    def score(problem: Problem):
        if os.getpid() != parent:
            action()
        return pid_and_devices(problem)

    return score


def raise_(error: Exception):
    raise error


def test_a_large_cluster_is_scored_in_a_child_process():
    pending = beside.score_beside(problem_on("mix2-128"), pid_and_devices, allowed=True)
    assert pending.forked
    pid, devices = pending.result()
    assert pid != os.getpid() and devices == 128
    assert not pending.forked  # reaped


def test_a_search_not_allowed_to_fork_scores_here():
    pending = beside.score_beside(problem_on("mix2-128"), pid_and_devices, allowed=False)
    assert not pending.forked
    assert pending.result()[0] == os.getpid()


def test_only_large_clusters_fork_for_their_baselines():
    assert not beside.baselines_worth_forking(problem_on("h100x8-a100x24"))  # 32 devices
    assert beside.baselines_worth_forking(problem_on("mix2-128"))


def test_with_another_thread_running_it_is_scored_here(monkeypatch):
    monkeypatch.setattr(beside, "_only_thread", ONLY_THREAD)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        pending = beside.score_beside(problem_on("mix2-128"), pid_and_devices, allowed=True)
        assert not pending.forked
        assert pending.result()[0] == os.getpid()
    finally:
        release.set()
        other.join()


def test_what_fails_in_the_child_is_scored_here_and_raises_here():
    parent = os.getpid()
    fails_in_child = in_child_only(lambda: raise_(RuntimeError("child only")))
    pending = beside.score_beside(problem_on("mix2-128"), fails_in_child, allowed=True)
    assert pending.forked
    assert pending.result()[0] == parent

    def always_fails(problem: Problem):
        raise ValueError("bad problem")

    pending = beside.score_beside(problem_on("mix2-128"), always_fails, allowed=True)
    with pytest.raises(ValueError, match="bad problem"):
        pending.result()
    assert not pending.forked


def test_a_child_that_dies_leaves_the_scoring_here():
    dies_in_child = in_child_only(lambda: os._exit(3))
    pending = beside.score_beside(problem_on("mix2-128"), dies_in_child, allowed=True)
    assert pending.result()[0] == os.getpid()


def test_a_child_too_slow_is_stopped_and_the_scoring_done_here(monkeypatch):
    monkeypatch.setattr(beside, "BESIDE_MIN_WAIT_S", 0.3)
    monkeypatch.setattr(beside, "BESIDE_WAIT_FACTOR", 0.0)
    parent = os.getpid()
    hangs_in_child = in_child_only(lambda: time.sleep(60))
    pending = beside.score_beside(problem_on("mix2-128"), hangs_in_child, allowed=True)
    child = pending.process
    started = time.perf_counter()
    assert pending.result()[0] == parent
    assert time.perf_counter() - started < 10
    assert not child.is_alive() and not pending.forked


def test_close_stops_a_child_still_running():
    def sleeps(problem: Problem):
        time.sleep(60)

    pending = beside.score_beside(problem_on("mix2-128"), sleeps, allowed=True)
    child = pending.process
    pending.close()
    pending.close()  # again: nothing
    assert not child.is_alive() and not pending.forked


def describe(result) -> dict:
    """What a search reports, as plain values."""
    rows = {"best": (result.best.name, result.best.predicted.tokens_per_s)}
    for name, plan in result.baselines.items():
        value = plan.predicted.tokens_per_s if isinstance(plan, Plan) else plan.reason
        rows[name] = (plan.name, value)
    parallel = result.data_parallel
    rows["data parallel"] = None if parallel is None else parallel.describe()
    return rows


def test_plan_search_reports_the_same_baselines_scored_beside_the_study(monkeypatch):
    forked = []

    def recording(problem, score, allowed):
        pending = beside.score_beside(problem, score, allowed)
        forked.append(pending.forked)
        return pending

    monkeypatch.setattr(api, "score_beside", recording)
    found = describe(plan_search("mix4-128", "llama3-8b", "1M"))
    monkeypatch.setattr(beside, "BESIDE_MIN_DEVICES", 10**9)
    here = describe(plan_search("mix4-128", "llama3-8b", "1M"))
    small = plan_search("h100x8-a100x24", "llama3-8b", "1M")  # 32 devices: never forked
    assert forked == [True, False, False]
    assert found == here
    assert set(found) >= {"uniform-usp", "ring-only", "ulysses-only", "homogeneous-subset"}
    assert small.baselines
