"""`hexiseq run --replan` end to end on the emulated CPU cluster: a rank slowed mid-run and a
rank killed mid-run are planned around, the run goes on from the same step with the new
plan (state resharded from the checkpoint), and its losses are an uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run_main
from supervised_cases import LOSS_RTOL, STEPS, THRESHOLD, write_plan

from hexiseq import Plan
from hexiseq.store import Store
from hexiseq.supervision import read_steps

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    return write_plan(tmp_path_factory.mktemp("plan"))


def supervised(plan: Path, folder: Path, *flags: str) -> subprocess.CompletedProcess:
    run_dir = (
        [] if any(f.startswith("--run-dir") for f in flags) else ["--run-dir", str(folder / "run")]
    )
    return subprocess.run(
        [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(plan), "--steps", str(STEPS),
         "--device", "cpu", "--replan", *run_dir, f"--drift-threshold={THRESHOLD}",
         "--store", f"sqlite:///{folder / 'store.db'}", *flags],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(plan_path, tmp_path_factory) -> list[dict]:
    """The losses of an uninterrupted supervised run."""
    folder = tmp_path_factory.mktemp("reference")
    done = supervised(plan_path, folder)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_steps(folder / "run")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert {s["plan"] for s in steps} == {"hexiseq"}
    return steps


def by_step(steps: list[dict]) -> dict[int, dict]:
    """Each step as last run (steps since the last checkpoint run again after a loss)."""
    return {entry["step"]: entry for entry in steps}


def assert_same_losses(steps: list[dict], reference: list[dict]) -> None:
    ours = by_step(steps)
    assert sorted(ours) == list(range(STEPS)), "a step was lost"
    for entry in reference:
        assert ours[entry["step"]]["loss"] == pytest.approx(entry["loss"], rel=LOSS_RTOL)


def test_a_slowed_rank_is_planned_around_with_the_same_losses(plan_path, reference, tmp_path):
    done = supervised(plan_path, tmp_path, "--inject-slowdown=0:3@4")  # after the start steps
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_steps(tmp_path / "run")
    assert [s["step"] for s in steps] == list(range(STEPS)), "no step lost, none run twice"
    plans = [s["plan"] for s in steps]
    assert plans[0] == "hexiseq" and plans[-1] == "hexiseq-replan1", done.stdout
    assert_same_losses(steps, reference)

    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        (replan,) = store.list_replans()
        runs = sorted(store.list_runtime_runs(), key=lambda run: run["id"])
    assert replan.reason == "drift" and replan.step == plans.index("hexiseq-replan1")
    assert replan.measured_slowdowns[0] > 1.5 and replan.lost_ranks == ()
    assert replan.predicted_gain >= 1.05
    assert replan.measured_before_step_s > 0 and replan.measured_after_step_s > 0
    assert [run["status"] for run in runs] == ["replanned", "finished"]
    # both plans are in the store, so each run compares measured with predicted
    assert all(run["plan_id"] is not None for run in runs)

    old, new = Plan.from_json_text(replan.old_plan_json), Plan.from_json_text(replan.new_plan_json)
    assert new.cluster.devices[0].measured_slowdown > 1.5
    assert new.assignments[0].tokens < old.assignments[0].tokens  # the slow rank does less
    kept = sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == [f"step-{step:08d}" for step in (STEPS - 2, STEPS - 1)]  # the 2 newest


def test_a_lost_rank_is_planned_around_with_the_same_losses(plan_path, reference, tmp_path):
    done = supervised(plan_path, tmp_path, "--inject-failure=1@3")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_steps(tmp_path / "run")
    assert_same_losses(steps, reference)
    final = by_step(steps)
    assert [final[s]["world_size"] for s in range(STEPS)] == [4] * 3 + [3] * (STEPS - 3)

    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        (replan,) = store.list_replans()
        runs = sorted(store.list_runtime_runs(), key=lambda run: run["id"])
    assert (replan.reason, replan.lost_ranks, replan.step) == ("lost", (1,), 3)
    assert "rank 1" in replan.detail and "lost" in replan.detail
    new = json.loads(replan.new_plan_json)
    assert sum(node["count"] for node in new["cluster"]["nodes"]) == 3
    # the launch that lost rank 1 failed: recorded by rank 0 (a peer's error) if it could,
    # else by the supervisor
    assert [run["status"] for run in runs] == ["failed", "finished"] and runs[0]["failure"]


def test_a_drift_then_a_loss_in_one_run(plan_path, reference, tmp_path):
    """Rank 0 slowed 3x (re-planned in place), then rank 2 lost: the relaunch on three ranks
    keeps rank 0's measured slowdown and its injected fault, and the losses hold."""
    done = supervised(plan_path, tmp_path, "--inject-slowdown=0:3@4", "--inject-failure=2@7")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_steps(tmp_path / "run")
    assert_same_losses(steps, reference)
    final = by_step(steps)
    plans = [final[s]["plan"] for s in (0, STEPS - 2, STEPS - 1)]
    assert plans == ["hexiseq", "hexiseq-replan1", "hexiseq-replan2"], done.stdout
    assert final[STEPS - 1]["world_size"] == 3

    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        lost, drift = store.list_replans()  # newest first
    assert (drift.reason, lost.reason, lost.lost_ranks) == ("drift", "lost", (2,))
    after_loss = Plan.from_json_text(lost.new_plan_json)
    assert after_loss.cluster.devices[0].measured_slowdown > 1.5  # still known slow
    assert Plan.from_json_text(lost.old_plan_json).name == "hexiseq-replan1"
    # the relaunch still treats rank 0 (3x slow, fast type) as slow: fewer tokens than rank 1
    assert after_loss.assignments[0].tokens < after_loss.assignments[1].tokens


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--inject-slowdown=9:2@1"], "the plan has ranks 0..3 (got rank 9)"),
        (["--inject-slowdown=1:0.5@1"], "FACTOR must be a number in 1..100"),
        (["--inject-failure=x@1"], "RANK must be a whole number"),
        (["--node-rank=0", "--run-dir="], "--replan over several nodes needs --run-dir"),
        (["--min-gain=1"], "must be a number > 1"),
        (["--state-sharding=replicated"], "cannot go with --state-sharding replicated"),
        (
            ["--run-dir=/proc/version/run"],
            "--run-dir /proc/version/run: cannot make the run folder",
        ),
    ],
)
def test_bad_supervision_flags_are_one_line(plan_path, tmp_path, flags, message):
    """In-process: every one is refused before anything is launched, and this process's
    environment is as it was (the ranks' store URL and launch id are set only around a
    launch)."""
    environment = dict(os.environ)
    run_dir = (
        []
        if any(f.startswith("--run-dir") for f in flags)
        else ["--run-dir", str(tmp_path / "run")]
    )
    done = run_main(
        ["run", "--plan", str(plan_path), "--device", "cpu", "--replan", *run_dir,
         "--store", f"sqlite:///{tmp_path / 'store.db'}", *flags]
    )  # fmt: skip
    assert done.code == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert dict(os.environ) == environment


def test_a_run_folder_of_an_earlier_run_is_refused(plan_path, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "steps.jsonl").write_text("")
    done = supervised(plan_path, tmp_path)  # a real launch would follow: in a child process
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"--run-dir {tmp_path / 'run'} holds files already" in done.stderr
