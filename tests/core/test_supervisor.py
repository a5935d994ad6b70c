"""The supervisor of `hexiseq run --replan`, piece by piece: its device book-keeping, how it
reads a launch's end, its answers to drift reports, and the file protocol with rank 0."""

from __future__ import annotations

import argparse
import signal
import threading

import pytest

from hexiseq import plan_search
from hexiseq.cli.run import replan_options
from hexiseq.cli.supervise import Fleet, Watcher
from hexiseq.costmodel.datasheet import DatasheetCostModel
from hexiseq.errors import InputError
from hexiseq.injections import FailureInjection, SlowdownInjection
from hexiseq.runtime.launcher import outcome_of
from hexiseq.supervision import (
    claim_json,
    decision_path,
    drift_path,
    read_decision,
    write_json,
)


def test_faults_follow_their_device_across_two_losses():
    fleet = Fleet(
        list(range(4)),
        [SlowdownInjection(3, 2.5, 1)],
        [FailureInjection(1, 2), FailureInjection(2, 9)],
    )
    assert fleet.injections() == [
        "--inject-slowdown=3:2.5@1", "--inject-failure=1@2", "--inject-failure=2@9"
    ]  # fmt: skip
    assert fleet.visible_devices({}) is None
    fleet.renumber({0: 0, 2: 1, 3: 2})  # rank 1 lost
    assert fleet.original == [0, 2, 3]
    assert fleet.injections() == ["--inject-slowdown=2:2.5@1", "--inject-failure=1@9"]
    fleet.renumber({1: 0, 2: 1})  # then rank 0 (original 0) lost
    assert fleet.original == [2, 3]
    assert fleet.injections() == ["--inject-slowdown=1:2.5@1", "--inject-failure=0@9"]
    assert fleet.visible_devices({}) == "2,3"  # the GPUs left, not the first two
    assert fleet.visible_devices({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "6,7"


def test_a_launch_ends_by_its_ranks_exit_codes():
    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    assert outcome_of({0: term, 1: kill, 2: term}).lost == (1,)  # the launcher stopped 0, 2
    assert outcome_of({0: 1, 1: term}).lost == ()
    assert outcome_of({0: 1, 1: term}).code == 1
    assert outcome_of({0: 2, 1: 2}).code == 2  # bad input on every rank: exit 2, no re-plan


def test_replan_options_only_with_replan():
    plain = argparse.Namespace(replan=False, run_dir=None, checkpoint_every=None,
                               drift_threshold=None, min_gain=None, cost_model=None)  # fmt: skip
    assert replan_options(plain) is plain
    with pytest.raises(InputError, match="--run-dir, --min-gain: only with --replan"):
        replan_options(argparse.Namespace(**{**vars(plain), "run_dir": "x", "min_gain": 2.0}))
    filled = replan_options(argparse.Namespace(**{**vars(plain), "replan": True}))
    assert (filled.checkpoint_every, filled.cost_model, filled.min_gain) == (1, "auto", 1.05)


def test_the_first_decision_written_is_the_decision(tmp_path):
    path = decision_path(tmp_path, 7)
    assert read_decision(path) is None
    assert claim_json(path, {"action": "keep"})
    assert not claim_json(path, {"action": "replan", "plan": "x.json"})
    assert read_decision(path) == {"action": "keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ('{"action": "replan"}', 'expected {"action": "keep"} or'),
        ('{"action": "replan", "plan": 3}', "expected"),
        ('["keep"]', "expected"),
    ],
)
def test_a_malformed_decision_is_one_message(tmp_path, text, message):
    path = decision_path(tmp_path, 1)
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_decision(path)


@pytest.fixture(scope="module")
def cpu_plan():
    return plan_search("cpu-emulated-2type", "tiny", 2048).best


def answer(watcher: Watcher, step: int, factors: dict[int, float]) -> dict | None:
    write_json(drift_path(watcher.folder, step), {"step": step, "factors": factors})
    thread = watcher.start()
    try:
        for _ in range(500):
            if (decision := read_decision(decision_path(watcher.folder, step))) is not None:
                return decision
            threading.Event().wait(0.01)
    finally:
        watcher.stop(thread)
    return None


def make_watcher(tmp_path, plan, min_gain=1.05) -> Watcher:
    names = iter(f"p{n}" for n in range(1, 100))
    exchange = tmp_path / "launch-000"
    exchange.mkdir(exist_ok=True)
    return Watcher(exchange, tmp_path, plan, DatasheetCostModel(), min_gain, names)


def test_a_worthwhile_replan_is_handed_over_and_taken(tmp_path, cpu_plan):
    watcher = make_watcher(tmp_path, cpu_plan)
    decision = answer(watcher, 4, {"0": 3.0})
    assert decision["action"] == "replan"
    (taken,) = watcher.taken
    assert taken.step == 5 and taken.old is cpu_plan and taken.change.factors == {0: 3.0}
    assert decision["plan"] == str((tmp_path / "plan-0.json").resolve())
    assert watcher.plan.name == "p1" and watcher.plan.cluster.devices[0].measured_slowdown == 3.0


def test_a_kept_drift_still_counts_in_the_next_replan(tmp_path, cpu_plan):
    watcher = make_watcher(tmp_path, cpu_plan, min_gain=100.0)  # nothing is worth it
    assert answer(watcher, 4, {"0": 1.5}) == {"action": "keep"}
    assert watcher.taken == [] and watcher.plan.cluster.devices[0].measured_slowdown == 1.5
    assert answer(watcher, 6, {"0": 2.0}) == {"action": "keep"}
    assert watcher.plan.cluster.devices[0].measured_slowdown == 3.0  # 1.5 x 2


def test_rank_0_that_kept_first_wins(tmp_path, cpu_plan):
    watcher = make_watcher(tmp_path, cpu_plan)
    claim_json(decision_path(watcher.folder, 4), {"action": "keep"})  # rank 0 timed out
    assert answer(watcher, 4, {"0": 3.0}) == {"action": "keep"}
    assert watcher.taken == [] and watcher.plan is cpu_plan


def test_a_report_it_cannot_read_is_answered_keep(tmp_path, cpu_plan):
    watcher = make_watcher(tmp_path, cpu_plan)
    (watcher.folder / "drift-00000003.json").write_text('{"step": 3}')  # no factors
    thread = watcher.start()
    try:
        for _ in range(500):
            if read_decision(decision_path(watcher.folder, 3)) is not None:
                break
            threading.Event().wait(0.01)
    finally:
        watcher.stop(thread)
    assert read_decision(decision_path(watcher.folder, 3)) == {"action": "keep"}
