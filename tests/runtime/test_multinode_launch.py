"""A plan over several nodes: `hexiseq run --print-launch` prints each node's command, `--node-rank
K --master ADDR:PORT` starts node K's ranks (here: separate launchers on loopback, nodes of
unequal size), and a rank started where the plan does not put it is refused before any
communication."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from cli_runner import run_main
from distributed import free_port

from hexiseq import Cluster, ModelSpec
from hexiseq.runtime.train import check_world_size, placement_error
from hexiseq.search import plan_search
from hexiseq.store import Store

UNEVEN = {
    "name": "cpu-one-and-three",
    "nodes": [
        {"name": "small", "gpu": "cpu", "count": 1},
        {"name": "large", "gpu": "cpu", "count": 3, "emulation_slowdown": 2.0},
    ],
    "network": {"inter_node_GBps": 2.0, "inter_node_latency_us": 50},
}


@pytest.fixture(scope="module")
def uneven_plan(tmp_path_factory):
    plan = plan_search(Cluster.from_dict(UNEVEN), ModelSpec.preset("tiny"), 128, seed=0).best
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.to_json(path)
    return plan, path


def test_print_launch_gives_each_node_its_command_and_no_password(uneven_plan, monkeypatch):
    _, path = uneven_plan
    monkeypatch.setenv("HEXISEQ_STORE_URL", "postgresql+psycopg://u:hunter2@db.example/runs")
    done = run_main(["run", "--plan", str(path), "--print-launch", "--master", "10.0.0.1:29400"])
    assert done.code == 0 and "hunter2" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    starts = [line for line in lines if line.startswith("HEXISEQ_LAUNCH_ID=")]
    by_hand = [line for line in lines if "torchrun" in line]
    assert [re.search(r"--node-rank=(\d)", line)[1] for line in starts] == ["0", "1"]
    assert all("--master=10.0.0.1:29400" in line for line in starts)
    assert ["--nproc-per-node=1" in by_hand[0], "--nproc-per-node=3" in by_hand[1]] == [True] * 2
    assert all("--nnodes=2" in line and "--master-port=29400" in line for line in by_hand)
    launch_ids = {re.search(r"HEXISEQ_LAUNCH_ID=(\w+)", line)[1] for line in starts + by_hand}
    assert len(launch_ids) == 1  # one launch, every node
    assert "# node 0 (small): 1 x cpu, ranks 0..0" in lines
    assert "# node 1 (large): 3 x cpu, ranks 1..3" in lines


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--node-rank", "2"], "has 2 node(s), so the node rank is 0..1"),
        (["--node-rank", "-1"], "must be 0 or more"),
        (["--node-rank", "one"], "is not a whole number"),
        (["--node-rank", "0", "--master", "10.0.0.1"], "is not ADDR:PORT"),
        (["--node-rank", "0", "--master", "10.0.0.1:70000"], "a port in 1..65535"),
        (["--node-rank", "0", "--master", ":29400"], "is not ADDR:PORT"),
    ],
)
def test_a_bad_node_rank_or_master_is_one_line(uneven_plan, flags, message):
    _, path = uneven_plan
    done = run_main(["run", "--plan", str(path), "--no-store", "--device", "cpu", *flags])
    assert done.code == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_rank_is_accepted_where_the_plan_puts_it(uneven_plan):
    plan, _ = uneven_plan
    for rank in range(4):
        assert placement_error(plan, rank, rank, 4) is None  # all on one machine
    assert placement_error(plan, 0, 0, 1) is None  # node "small"
    assert [placement_error(plan, r, r - 1, 3) for r in (1, 2, 3)] == [None] * 3  # "large"


@pytest.mark.parametrize(
    ("rank", "local_rank", "local_world_size", "expected"),
    [
        (1, 1, 2, "local rank 1 of 2 on its machine, but plan"),  # nodes of 2 + 2, not 1 + 3
        (1, 0, 1, "local rank 0 of node large's 3 cpu device(s)"),
        (3, 0, 3, "local rank 2 of node large's 3 cpu device(s)"),
        (4, 0, 1, "rank 4 is outside plan"),
    ],
)
def test_a_rank_started_elsewhere_than_the_plan_says_is_refused(
    uneven_plan, rank, local_rank, local_world_size, expected
):
    plan, _ = uneven_plan
    error = placement_error(plan, rank, local_rank, local_world_size)
    assert error is not None and expected in error
    assert "outside" in error or "--node-rank" in error  # how to start it right


def test_the_rank_check_runs_on_torchruns_environment(uneven_plan):
    plan, _ = uneven_plan
    node_launch = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}
    check_world_size(plan, node_launch)
    with pytest.raises(Exception, match="local rank 1 of 2 on its machine"):
        check_world_size(plan, {**node_launch, "LOCAL_WORLD_SIZE": "2"})


def _losses(url: str) -> dict[int, list[float]]:
    with Store.open(url) as store:
        runs = store.list_runtime_runs()
        return {
            run["id"]: [m.loss for m in store.runtime_measurements(run["id"]) if m.rank == 0]
            for run in runs
        }


@pytest.mark.multiproc
def test_two_nodes_on_loopback_train_as_one_machine_does(uneven_plan, tmp_path):
    """Node 0 (1 rank) and node 1 (3 ranks) started by two launchers meet at --master; the
    run is one row with every rank's measurements, and its losses are those of the same plan
    run on one machine."""
    _, path = uneven_plan
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    environment = {**os.environ, "HEXISEQ_STORE_URL": url, "HEXISEQ_LAUNCH_ID": "two-nodes"}
    base = [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(path), "--steps", "2"]
    base += ["--device", "cpu"]
    master = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen([*base, "--node-rank", str(k), "--master", master], env=environment,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in (1, 0)
    ]  # fmt: skip
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    with Store.open(url) as store:
        (run,) = store.list_runtime_runs()
        rows = store.runtime_measurements(run["id"])
    assert (run["status"], run["launch_id"], run["world_size"]) == ("finished", "two-nodes", 4)
    assert sorted((m.step, m.rank) for m in rows) == [(s, r) for s in range(2) for r in range(4)]
    del environment["HEXISEQ_LAUNCH_ID"]
    single = subprocess.run(base, env=environment, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-2000:]
    two_nodes, one_machine = _losses(url).values()
    assert two_nodes == pytest.approx(one_machine, rel=1e-5) and len(two_nodes) == 2
