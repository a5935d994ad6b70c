"""A plan over several nodes: `hexiseq run --print-launch` prints each node's command, `--node-rank
K --master ADDR:PORT` starts node K's ranks (here: separate launchers on loopback, nodes of
unequal size), and a rank started where the plan does not put it is refused before any
communication."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from cli_runner import run_main
from distributed import free_port

from hexiseq import Cluster, ModelSpec
from hexiseq.cli import build_parser
from hexiseq.cli.run import run_command
from hexiseq.runtime._startup import FoundDevice, rank_start_error
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


@pytest.fixture(scope="module")
def two_type_plan(tmp_path_factory):
    """The CPU preset of two nodes, "fast" and "slow", of two ranks each."""
    plan = plan_search(Cluster.preset("cpu-emulated-2type"), ModelSpec.preset("tiny"), 128).best
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.to_json(path)
    return plan, path


@pytest.fixture(scope="module")
def gpu_plan():
    """Two nodes of two GPU types: ranks 0-1 on H100s, 2-3 on A100 80 GB cards."""
    cluster = Cluster.from_dict(
        {
            "name": "h100x2-a100x2",
            "nodes": [
                {"name": "h", "gpu": "H100-SXM", "count": 2},
                {"name": "a", "gpu": "A100-80G", "count": 2},
            ],
            "network": {"inter_node_GBps": 25},
        }
    )
    # the best plan for a tiny model leaves the A100s out; the uniform baseline uses all four
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 1024, seed=0).baselines["uniform-usp"]
    assert [a.gpu for a in plan.assignments] == ["H100-SXM"] * 2 + ["A100-80G"] * 2
    return plan


def torchrun_environment(rank: int, local_rank: int, local_world_size: int, world_size=4):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
    }


def test_print_launch_of_the_two_type_preset(two_type_plan, monkeypatch):
    """Both nodes of cpu-emulated-2type, two processes each, the user's run flags carried to
    every node, one launch id, the default rendezvous explained, no store URL anywhere."""
    _, path = two_type_plan
    monkeypatch.setenv("HEXISEQ_STORE_URL", "postgresql+psycopg://u:s3cret@db.example/runs")
    flags = ["--steps", "3", "--seed", "7", "--device", "cpu", "--state-sharding", "replicated"]
    secret = ["--store", "postgresql+psycopg://u:other-pw@db.example/runs"]
    done = run_main(["run", "--plan", str(path), "--print-launch", *flags, *secret])
    assert done.code == 0 and done.stderr == ""
    assert "s3cret" not in done.stdout and "other-pw" not in done.stdout
    lines = done.stdout.splitlines()
    starts = [line for line in lines if line.startswith("HEXISEQ_LAUNCH_ID=")]
    by_hand = [line.split("by hand: ", 1)[1] for line in lines if "by hand: " in line]
    assert "# node 0 (fast): 2 x cpu, ranks 0..1" in lines
    assert "# node 1 (slow): 2 x cpu, ranks 2..3" in lines
    run_flags = "--steps=3 --seed=7 --device=cpu --state-sharding=replicated"
    for node, (start, torchrun) in enumerate(zip(starts, by_hand, strict=True)):
        assert f"hexiseq run --plan={path} --node-rank={node} --master=127.0.0.1:29500" in start
        assert start.endswith(run_flags) and torchrun.endswith(run_flags)
        assert f"--nnodes=2 --node-rank={node} --nproc-per-node=2" in torchrun
        assert "--master-addr=127.0.0.1 --master-port=29500" in torchrun
        assert "--standalone" not in torchrun and "-m hexiseq.runtime.train" in torchrun
    assert len({line.split()[0] for line in starts + by_hand}) == 1  # HEXISEQ_LAUNCH_ID=<one>
    assert any("$HEXISEQ_STORE_URL" in line for line in lines if line.startswith("#"))
    assert any("127.0.0.1:29500 is the default" in line for line in lines)


def test_a_node_rank_gives_torchrun_a_static_rendezvous(two_type_plan, monkeypatch):
    """Node K: --nnodes/--node-rank/--nproc-per-node and the master, the store URL only in the
    environment; without --node-rank the one-machine --standalone launch of before."""
    _, path = two_type_plan
    url = "postgresql+psycopg://u:s3cret@db.example/runs"
    argv = ["run", "--plan", str(path), "--store", url, "--device", "cpu"]
    node = build_parser().parse_args([*argv, "--node-rank", "1", "--master", "[::1]:29400"])
    command, environment = run_command(node, two_type_plan[0], "abc")
    assert command[3:9] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2",
                            "--master-addr=::1", "--master-port=29400", "-m"]  # fmt: skip
    assert url not in " ".join(command) and environment["HEXISEQ_STORE_URL"] == url
    assert environment["HEXISEQ_LAUNCH_ID"] == "abc"
    command, _ = run_command(build_parser().parse_args(argv), two_type_plan[0])
    assert command[3:5] == ["--standalone", "--nproc-per-node=4"]


def test_a_one_node_plan_takes_node_rank_0(tmp_path):
    one_node = Cluster.from_dict(
        {"name": "cpu4", "nodes": [{"name": "only", "gpu": "cpu", "count": 4}]}
    )
    path = tmp_path / "plan.json"
    plan_search(one_node, ModelSpec.preset("tiny"), 128).best.to_json(path)
    done = run_main(["run", "--plan", str(path), "--print-launch", "--node-rank", "0"])
    assert done.code == 0 and "--nnodes=1 --node-rank=0 --nproc-per-node=4" in done.stdout


def test_a_misplaced_rank_stops_before_any_communication(two_type_plan):
    """The entry point itself, given torchrun's variables for a node of 3 processes where the
    plan has 2: one line naming the rank, exit 2, no rendezvous tried (nothing listens)."""
    _, path = two_type_plan
    environment = {**os.environ, **torchrun_environment(2, 0, 3)}
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "hexiseq.runtime.train", f"--plan={path}", "--device=cpu"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(
        "hexiseq.runtime.train: error: rank 2 runs as local rank 0 of 3 on its machine"
    )
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        (
            torchrun_environment(2, 0, 2, world_size=3),
            "rank 2: plan 'PLAN' is for 4 ranks but torchrun started 3",
        ),
        (
            torchrun_environment(2, 0, 1),
            "rank 2 runs as local rank 0 of 1 on its machine, but plan 'PLAN' puts it at local "
            "rank 0 of node slow's 2 cpu device(s)",
        ),
        (
            torchrun_environment(3, 1, 3),
            "rank 3 runs as local rank 1 of 3 on its machine",
        ),
    ],
)
def test_the_start_check_refuses_a_wrong_world(two_type_plan, environment, expected):
    plan, _ = two_type_plan
    error = rank_start_error(plan, environment)
    assert error is not None and expected.replace("PLAN", plan.name) in error
    assert "\n" not in error


def test_the_start_check_accepts_each_rank_of_a_node_launch(two_type_plan):
    plan, _ = two_type_plan
    for rank in range(4):
        assert rank_start_error(plan, torchrun_environment(rank, rank % 2, 2)) is None
        assert rank_start_error(plan, torchrun_environment(rank, rank, 4)) is None


H100 = FoundDevice("NVIDIA H100 80GB HBM3", 79.2, 2)
A100_80 = FoundDevice("NVIDIA A100-SXM4-80GB", 79.1, 2)
A100_40 = FoundDevice("NVIDIA A100-SXM4-40GB", 39.4, 2)


def test_the_start_check_refuses_the_wrong_gpu_type(gpu_plan):
    assert rank_start_error(gpu_plan, torchrun_environment(0, 0, 2), H100) is None
    assert rank_start_error(gpu_plan, torchrun_environment(3, 1, 2), A100_80) is None
    error = rank_start_error(gpu_plan, torchrun_environment(1, 1, 2), A100_80)
    assert error is not None and error.startswith(
        "rank 1 is planned on a H100-SXM but its device cuda:1 is a NVIDIA A100-SXM4-80GB"
    )
    error = rank_start_error(gpu_plan, torchrun_environment(2, 0, 2), A100_40)  # memory too
    assert error is not None and "planned on a A100-80G" in error and "(A100-40G)" in error
    error = rank_start_error(
        gpu_plan, torchrun_environment(3, 1, 2), dataclasses.replace(A100_80, devices_here=1)
    )
    assert error is not None and "at cuda:1 but this machine has 1 CUDA device(s)" in error


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
