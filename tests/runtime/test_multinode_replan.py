"""`hexiseq run --replan` over several nodes: each node's supervisor starts its ranks (here:
two supervisors on loopback, one per node of cpu-emulated-2type) around one shared run folder;
node 0 answers a drift on a rank of node 1 and every rank takes the new plan over in place; a
device lost on node 1 is planned around and every node relaunches its part; both with the losses
of one machine's run of the first plan. `--print-launch` gives each node its supervised
command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import run_main
from distributed import free_port
from supervised_cases import LOSS_RTOL, STEPS, THRESHOLD, write_plan

from hexiseq import Plan, plan_search, supervision
from hexiseq.cli import peer_watch, supervise_nodes
from hexiseq.cli.supervise_nodes import NodeRun, shared_run_folder
from hexiseq.errors import InputError
from hexiseq.store import Store
from hexiseq.supervision import read_steps


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    return write_plan(tmp_path_factory.mktemp("plan"))


def _node_command(plan: Path, folder: Path, node: int, master: str, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(plan), "--steps", str(STEPS),
        "--device", "cpu", "--replan", "--run-dir", str(folder / "run"),
        f"--drift-threshold={THRESHOLD}", "--node-rank", str(node), "--master", master,
        "--store", f"sqlite:///{folder / 'store.db'}", *flags,
    ]  # fmt: skip


def two_nodes(plan: Path, folder: Path, *flags: str) -> list[tuple[int, str, str]]:
    """Both nodes' supervisors, node 1 first (it waits for node 0's run folder): each one's
    exit code, output and errors."""
    master = f"127.0.0.1:{free_port()}"
    nodes = [  # each its own launch id: node 0's is the run's (the others take it over)
        subprocess.Popen(_node_command(plan, folder, k, master, *flags),
                         env={**os.environ, "HEXISEQ_LAUNCH_ID": f"node{k}-{folder.name}"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in (1, 0)
    ]  # fmt: skip
    outputs = [node.communicate(timeout=600) for node in nodes]
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


def one_machine_losses(plan: Path, folder: Path) -> dict[int, float]:
    """Rank 0's loss per step of the same plan run plainly on one machine."""
    url = f"sqlite:///{folder / 'reference.db'}"
    command = [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(plan),
               "--steps", str(STEPS), "--device", "cpu", "--store", url]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with Store.open(url) as store:
        (run,) = store.list_runtime_runs()
        rows = store.runtime_measurements(run["id"])
    return {m.step: m.loss for m in rows if m.rank == 0}


@pytest.mark.multiproc
def test_node_0_replans_a_drift_on_node_1_for_every_node(plan_path, tmp_path):
    (code1, out1, err1), (code0, out0, err0) = two_nodes(
        plan_path, tmp_path, "--inject-slowdown=3:3@4"
    )  # rank 3 is node 1's second rank
    assert (code0, code1) == (0, 0), (err0[-3000:], err1[-3000:])
    assert "supervised by node 0" in out1 and "re-planned" in out0, (out0[-2000:], out1[-2000:])
    steps = read_steps(tmp_path / "run")
    assert [s["step"] for s in steps] == list(range(STEPS)), "no step lost, none run twice"
    plans = [s["plan"] for s in steps]
    assert plans[0] == "hexiseq" and plans[-1] == "hexiseq-replan1", out0[-2000:]
    assert {s["world_size"] for s in steps} == {4}  # the world stays: work moved in place
    reference = one_machine_losses(plan_path, tmp_path)
    for entry in steps:
        assert entry["loss"] == pytest.approx(reference[entry["step"]], rel=LOSS_RTOL)

    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        (replan,) = store.list_replans()  # node 0 alone records
        runs = sorted(store.list_runtime_runs(), key=lambda run: run["id"])
    assert replan.reason == "drift" and replan.measured_slowdowns[3] > 1.5
    assert [run["status"] for run in runs] == ["replanned", "finished"]
    assert all(run["world_size"] == 4 for run in runs)
    assert {run["launch_id"] for run in runs} == {f"node0-{tmp_path.name}"}
    old, new = Plan.from_json_text(replan.old_plan_json), Plan.from_json_text(replan.new_plan_json)
    assert new.assignments[3].tokens < old.assignments[3].tokens  # the slowed rank does less


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_lost_device_on_node_1_is_planned_around_by_every_node(plan_path, tmp_path):
    """Rank 2 (node 1's first) killed when step 3 begins: node 1 reports it, node 0 plans on
    the three devices left, both relaunch from the newest checkpoint (node 1 with one rank),
    and the losses are one machine's run of the first plan."""
    (code1, out1, err1), (code0, out0, err0) = two_nodes(
        plan_path, tmp_path, "--inject-failure=2@3"
    )
    assert (code0, code1) == (0, 0), (err0[-3000:], err1[-3000:])
    assert "re-planned (rank 2 (slow #0, cpu) lost)" in out0, out0[-2000:]
    final = {entry["step"]: entry for entry in read_steps(tmp_path / "run")}
    assert sorted(final) == list(range(STEPS)), "a step was lost"
    assert [final[s]["world_size"] for s in range(STEPS)] == [4] * 3 + [3] * (STEPS - 3)
    reference = one_machine_losses(plan_path, tmp_path)
    for step, entry in final.items():
        assert entry["loss"] == pytest.approx(reference[step], rel=LOSS_RTOL)

    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        (replan,) = store.list_replans()
        runs = sorted(store.list_runtime_runs(), key=lambda run: run["id"])
    assert (replan.reason, replan.lost_ranks, replan.step) == ("lost", (2,), 3)
    new = Plan.from_json_text(replan.new_plan_json)
    assert [node.count for node in new.cluster.nodes] == [2, 1]
    assert [run["status"] for run in runs] == ["failed", "finished"] and runs[0]["failure"]


def _node_run(plan: Plan, folder: Path) -> NodeRun:
    from hexiseq.cli import build_parser
    from hexiseq.cli.run import replan_options
    from hexiseq.cli.supervise import Fleet

    args = replan_options(
        build_parser().parse_args(
            [
                "run",
                "--plan",
                "p.json",
                "--replan",
                "--run-dir",
                str(folder),
                "--node-rank",
                "0",
                "--device",
                "cpu",
                "--no-store",
            ]  # fmt: skip
        )
    )
    fleet = Fleet(list(range(plan.cluster.world_size)), [], [])
    environment = {"HEXISEQ_LAUNCH_ID": "test"}
    return NodeRun(args, environment, "fast", folder, plan, folder / "plan-0.json", plan, fleet)


def test_node_0_counts_a_silent_node_as_lost_and_stops_when_it_loses_its_own(
    plan_path, tmp_path, monkeypatch
):
    """The decision after a launch ended in error, without launching: a node that never says
    how its launch ended lost every device; losing node 0's devices stops the run (node 0
    holds the rendezvous); no device lost is a failure, not a re-plan."""
    from hexiseq.costmodel import DatasheetCostModel

    monkeypatch.setattr(supervise_nodes, "REPORT_TIMEOUT_S", 0.2)
    plan = Plan.from_json(plan_path)
    exchange = tmp_path / "launch-000"
    exchange.mkdir()
    supervision.write_json(supervision.ended_path(exchange, 0), {"code": 1, "lost": []})
    assert supervise_nodes._lost_ranks(plan, exchange) == [2, 3]  # node 1 never reported
    supervision.write_json(supervision.ended_path(exchange, 1), {"code": 1, "lost": [3]})
    assert supervise_nodes._lost_ranks(plan, exchange) == [3]

    node = _node_run(plan, tmp_path)
    names = iter(["next"])
    cost = DatasheetCostModel()
    stop = supervise_nodes._decide(node, cost, [0, 1], 2, None, names)
    assert stop["action"] == "stop" and "node 0 (fast) holds the rendezvous" in stop["why"]
    assert supervise_nodes._decide(node, cost, [], 2, None, names)["action"] == "stop"
    again = supervise_nodes._decide(node, cost, [3], 2, 2, names)
    assert again["action"] == "stop" and "again before step 2 ran" in again["why"]
    go = supervise_nodes._decide(node, cost, [3], 2, None, names)
    assert go["action"] == "relaunch" and go["rank_map"] == {"0": 0, "1": 1, "2": 2}
    assert Plan.from_json(go["plan"]).cluster.world_size == 3


def test_print_launch_gives_each_node_its_supervised_command(plan_path, tmp_path):
    run_dir = str(tmp_path / "shared")
    done = run_main(["run", "--plan", str(plan_path), "--print-launch", "--replan",
                     "--run-dir", run_dir, "--checkpoint-every", "2", "--no-store"])  # fmt: skip
    assert done.code == 0, done.stderr
    lines = done.stdout.splitlines()
    starts = [line for line in lines if line.startswith("HEXISEQ_LAUNCH_ID=")]
    assert len(starts) == 2 and all("--replan" in line for line in starts)
    assert all(
        f"--run-dir={run_dir}" in line and "--checkpoint-every=2" in line for line in starts
    )
    assert not any("by hand" in line for line in lines)  # a supervised node needs its supervisor
    assert any("must be one folder every node shares" in line for line in lines)


def test_without_a_run_dir_several_nodes_are_refused(plan_path):
    done = run_main(["run", "--plan", str(plan_path), "--print-launch", "--replan", "--no-store"])
    assert done.code == 2 and "--replan over several nodes needs --run-dir" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_node_that_does_not_see_node_0s_folder_says_so(plan_path, tmp_path, monkeypatch):
    """Node 1 waits for node 0's first plan in the run folder; a folder where it never appears
    (not shared, or node 0 not started) is one clear error, as is one of another plan."""
    from hexiseq.cli import build_parser

    monkeypatch.setattr(supervise_nodes, "SHARED_FOLDER_TIMEOUT_S", 0.3)
    plan = Plan.from_json(plan_path)
    args = build_parser().parse_args(
        [
            "run",
            "--plan",
            str(plan_path),
            "--replan",
            "--run-dir",
            str(tmp_path / "run"),
            "--node-rank",
            "1",
            "--device",
            "cpu",
        ]  # fmt: skip
    )
    from hexiseq.cli.run import replan_options

    args = replan_options(args)
    with pytest.raises(InputError, match="did not appear in 0 s; give every node the same"):
        shared_run_folder(args, plan)
    (tmp_path / "run").mkdir()
    other = plan_search("cpu-emulated-2type", "tiny", 1024).best
    other.to_json(tmp_path / "run" / "plan-0.json")
    with pytest.raises(InputError, match="node 0 runs another plan"):
        shared_run_folder(args, plan)


def _follower_args(plan_path: Path, folder: Path, *flags: str):
    from hexiseq.cli import build_parser
    from hexiseq.cli.run import replan_options

    argv = ["run", "--plan", str(plan_path), "--replan", "--run-dir", str(folder),
            "--node-rank", "1", "--device", "cpu", *flags]  # fmt: skip
    return replan_options(build_parser().parse_args(argv))


def _node_0_started(plan_path: Path, folder: Path, *flags: str, written_at: float | None = None):
    """The run folder as node 0 leaves it when it starts with `flags`."""
    folder.mkdir(exist_ok=True)
    node_0 = _follower_args(plan_path, folder, *flags)
    launch = {
        "launch_id": "node0",
        "flags": supervise_nodes.shared_flags(node_0),
        "written_at": time.time() if written_at is None else written_at,
    }
    supervision.write_json(folder / supervise_nodes.LAUNCH_FILE, launch)
    Plan.from_json(plan_path).to_json(folder / "plan-0.json")


def test_a_node_given_other_flags_than_node_0_is_refused(plan_path, tmp_path):
    folder = tmp_path / "run"
    _node_0_started(plan_path, folder, "--steps", "8", "--checkpoint-every", "2")
    plan = Plan.from_json(plan_path)
    assert shared_run_folder(
        _follower_args(plan_path, folder, "--steps", "8", "--checkpoint-every", "2"), plan
    ) == folder  # fmt: skip
    other = _follower_args(plan_path, folder, "--steps", "10", "--checkpoint-every", "2",
                           "--inject-failure", "3@2")  # fmt: skip
    with pytest.raises(InputError) as refused:
        shared_run_folder(other, plan)
    message = str(refused.value)
    assert "node 0 runs with --steps=8 where this node has --steps=10 --inject-failure=3@2" in (
        message
    )
    assert "give every node the same flags" in message and "\n" not in message


def test_a_node_refuses_an_earlier_runs_folder(plan_path, tmp_path):
    """A node started before node 0, in a folder an earlier run left, must not take that run's
    plan and launch id: node 0 will refuse the folder and never meet it."""
    plan = Plan.from_json(plan_path)
    stale = tmp_path / "stale"
    _node_0_started(plan_path, stale, written_at=0.0)  # 1970: longer ago than a rendezvous waits
    with pytest.raises(InputError, match="node 0 started this run more than 900 s ago"):
        shared_run_folder(_follower_args(plan_path, stale), plan)
    ran = tmp_path / "ran"
    _node_0_started(plan_path, ran)
    launch = supervision.launch_folder(ran, 0)
    launch.mkdir()
    supervision.write_json(supervision.ended_path(launch, 0), {"code": 0, "lost": []})
    with pytest.raises(InputError, match="holds an earlier run's steps, reports or checkpoints"):
        shared_run_folder(_follower_args(plan_path, ran), plan)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_node_stops_its_ranks_when_another_nodes_launch_failed(tmp_path):
    stops = []
    watch = peer_watch.PeerWatch(tmp_path, 0, 3, lambda: stops.append(1) or 2)
    supervision.write_json(supervision.ended_path(tmp_path, 1), {"code": 0, "lost": []})
    watch.check()
    assert not stops and watch.stopped is None  # node 1 finished: nothing to stop
    supervision.write_json(supervision.ended_path(tmp_path, 2), {"code": 1, "lost": [5]})
    watch.check()
    watch.check()  # once
    assert stops == [1] and watch.stopped == "node 2's launch ended in error"


def test_a_node_stops_its_ranks_when_another_node_goes_silent(tmp_path, monkeypatch):
    """Node 1 beats, then stops beating (its machine vanished, no socket closed): after
    SILENT_S node 0 stops its own ranks. A node that never beat has not started yet: its
    silence is the rendezvous's to time out."""
    clock = _Clock()
    stopped = []
    ranks = [0]  # none yet: they start once every node has met
    watch = peer_watch.PeerWatch(tmp_path, 0, 3, lambda: stopped.append(ranks[0]) or ranks[0],
                                      clock)  # fmt: skip
    for beat in range(1, 4):
        supervision.write_json(supervision.beat_path(tmp_path, 1), beat)
        clock.now += peer_watch.BEAT_S
        watch.check()
    assert watch.stopped is None and not stopped
    clock.now += peer_watch.SILENT_S + 1
    watch.check()
    assert stopped == [0] and watch.stopped is None  # no rank to stop yet: it tries again
    ranks[0] = 2
    watch.check()
    assert watch.stopped == "node 1's supervisor has been silent for 180 s"
    watch.beat()
    assert supervision.read_json(supervision.beat_path(tmp_path, 0)) == 1


def test_a_watch_lives_on_when_the_shared_folder_fails(tmp_path, monkeypatch, capsys):
    """A beat file that cannot be read (an NFS hiccup, a torn file) is said and tried again:
    the watch must not die, or the other nodes would take this node for gone."""
    monkeypatch.setattr(peer_watch, "BEAT_S", 0.0)
    monkeypatch.setattr(peer_watch, "PEER_POLL_S", 0.01)
    supervision.beat_path(tmp_path, 1).write_text("{not json")
    watch = peer_watch.PeerWatch(tmp_path, 0, 2, lambda: 0)
    thread = watch.start()
    try:
        deadline = time.monotonic() + 10
        while watch.beats < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.stop(thread)
    assert watch.beats >= 5 and watch.stopped is None
    assert "could not read or write its beat (JSONDecodeError" in capsys.readouterr().err


def test_stop_ranks_signals_this_process_s_ranks_only(tmp_path):
    """`stop_ranks` (PeerWatch's default) sends SIGTERM, a launcher signal (no rank counts as
    lost), to the child processes running the runtime, and to nothing else."""
    import signal

    from hexiseq.runtime.launcher import outcome_of, stop_ranks

    sleep = "import time; time.sleep(60)"
    rank = subprocess.Popen([sys.executable, "-c", sleep, "-m", "hexiseq.runtime.train"])
    other = subprocess.Popen([sys.executable, "-c", sleep])
    try:
        assert stop_ranks() == 1
        assert rank.wait(timeout=30) == -signal.SIGTERM
        assert other.poll() is None
        assert outcome_of({0: rank.returncode}).lost == ()
    finally:
        for process in (rank, other):
            process.kill()
            process.wait()
