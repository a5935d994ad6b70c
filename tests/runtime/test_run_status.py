"""A runtime run's status in the store: "finished" when its steps ran, "failed" with why when a
step raised, and "failed" when its ranks were killed before they could say so (`hexiseq run`
records that for them)."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed import free_port

from hexiseq import Cluster, ModelSpec
from hexiseq.runtime import train
from hexiseq.search import plan_search
from hexiseq.store import Store

ONE_CPU = {"name": "one-cpu", "nodes": [{"name": "n", "gpu": "cpu", "count": 1}]}


@pytest.fixture
def one_rank_world(monkeypatch):
    """torchrun's environment for a world of one rank (`train.init_rank` joins it)."""
    environment = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    for name, value in {**environment, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _one_rank_run(tmp_path: Path, steps: int) -> tuple[train.TrainOptions, object]:
    plan = plan_search(Cluster.from_dict(ONE_CPU), ModelSpec.preset("tiny"), 64, seed=0).best
    plan.to_json(tmp_path / "plan.json")
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    options = train.parse_args(
        ["--plan", str(tmp_path / "plan.json"), "--steps", str(steps), "--store", url]
    )
    return options, plan


def test_a_run_whose_steps_all_ran_ends_finished(tmp_path, one_rank_world, monkeypatch):
    monkeypatch.setenv("HEXISEQ_LAUNCH_ID", "launch-a")
    options, plan = _one_rank_run(tmp_path, steps=2)
    assert train.train(plan, options, train.init_rank(plan, options)) == 0
    with Store.open(options.store_url) as store:
        (run,) = store.list_runtime_runs()
        steps = {m.step for m in store.runtime_measurements(run["id"])}
    assert (run["status"], run["failure"], run["launch_id"]) == ("finished", None, "launch-a")
    assert run["finished_at"] is not None and steps == {0, 1}


def test_a_step_that_raises_ends_the_run_failed_with_why(tmp_path, one_rank_world, monkeypatch):
    options, plan = _one_rank_run(tmp_path, steps=3)
    real_step = train.measure_step

    def fails_at_step_1(*args):
        if args[7] == 1:  # measure_step(plan, options, context, model, optimizer, padding, ...)
            raise RuntimeError("injected failure at step 1")
        return real_step(*args)

    monkeypatch.setattr(train, "measure_step", fails_at_step_1)
    with pytest.raises(RuntimeError, match="injected failure"):
        train.train(plan, options, train.init_rank(plan, options))
    with Store.open(options.store_url) as store:
        (run,) = store.list_runtime_runs()
        steps = {m.step for m in store.runtime_measurements(run["id"])}
    assert run["status"] == "failed" and steps == {0}  # step 0's rows are kept
    assert run["failure"] == "RuntimeError: injected failure at step 1"


def _rank_processes(parent: int) -> list[int]:
    """The pids of `hexiseq.runtime.train` processes below `parent` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    below, frontier = [], [parent]
    while frontier:
        found_children = children.get(frontier.pop(), [])
        below.extend(found_children)
        frontier.extend(found_children)
    found = []
    for pid in below:
        try:
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"hexiseq.runtime.train" in command and b"torch.distributed.run" not in command:
            found.append(pid)
    return found


def _wait_for_measured_step(database: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if database.exists():
            try:
                with sqlite3.connect(database) as connection:
                    if connection.execute("SELECT COUNT(*) FROM runtime_measurements").fetchone()[
                        0
                    ]:
                        return
            except sqlite3.Error:
                pass
        time.sleep(0.2)
    raise AssertionError(f"no step was recorded in {timeout_s} s")


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_ranks_killed_mid_run_leave_it_failed_with_why(tmp_path):
    cluster = Cluster.from_dict({**ONE_CPU, "nodes": [{"name": "n", "gpu": "cpu", "count": 2}]})
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 64, seed=0).best
    plan.to_json(tmp_path / "plan.json")
    database = tmp_path / "runs.db"
    with subprocess.Popen(  # leaving the block closes its stderr pipe
        [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(tmp_path / "plan.json"),
         "--steps", "100000", "--store", f"sqlite:///{database}", "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that its whole tree can be stopped if the test fails
    ) as launcher:  # fmt: skip
        try:
            _wait_for_measured_step(database, timeout_s=120)
            ranks = _rank_processes(launcher.pid)
            assert len(ranks) == 2
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            code = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        stderr_tail = launcher.stderr.read()[-2000:]
    assert code != 0
    with Store.open(f"sqlite:///{database}") as store:
        (run,) = store.list_runtime_runs()
    assert run["status"] == "failed", stderr_tail
    assert run["failure"].startswith(f"torchrun exited with code {code}")


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_ranks_whose_launcher_is_killed_stop_and_record_why(tmp_path):
    """SIGKILL to `hexiseq run` and torchrun (their process group) leaves the ranks, in
    sessions of their own, orphaned: they notice at the next step, stop, and rank 0 records
    the run failed with that reason instead of training on."""
    cluster = Cluster.from_dict({**ONE_CPU, "nodes": [{"name": "n", "gpu": "cpu", "count": 2}]})
    plan_search(cluster, ModelSpec.preset("tiny"), 64, seed=0).best.to_json(tmp_path / "p.json")
    database = tmp_path / "runs.db"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(tmp_path / "p.json"),
         "--steps", "100000", "--store", f"sqlite:///{database}", "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    ranks = []
    try:
        _wait_for_measured_step(database, timeout_s=120)
        ranks = _rank_processes(launcher.pid)
        assert len(ranks) == 2
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and torchrun, not the ranks
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), "the orphaned ranks trained on"
    finally:
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with Store.open(f"sqlite:///{database}") as store:
        (run,) = store.list_runtime_runs()
    assert run["status"] == "failed" and "the launcher" in run["failure"], run["failure"]
