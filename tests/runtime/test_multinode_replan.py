"""`hexiseq run --replan` over several nodes: each node's supervisor starts its ranks (here:
two supervisors on loopback, one per node of cpu-emulated-2type) around one shared run folder;
node 0 answers a drift on a rank of node 1 and every rank takes the new plan over in place,
with the losses of one machine's run of the first plan. A lost device stops every node, and
`--print-launch` gives each node its supervised command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run_main
from distributed import free_port

from hexiseq import Plan, plan_search
from hexiseq.cli import supervise
from hexiseq.cli.supervise import shared_run_folder
from hexiseq.errors import InputError
from hexiseq.store import Store
from hexiseq.supervision import read_steps

STEPS = 8
THRESHOLD = 2.0  # the injected slowdown is 3x: noise on 2 shared cores stays below
LOSS_RTOL = 1e-5  # fp32: the new layout and shares sum in another order


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    """Nodes "fast" (ranks 0-1) and "slow" (ranks 2-3, emulated 2x slower), 2K tokens."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan_search("cpu-emulated-2type", "tiny", 2048).best.to_json(path)
    return path


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
    environment = {**os.environ, "HEXISEQ_LAUNCH_ID": f"two-nodes-{folder.name}"}
    master = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(_node_command(plan, folder, k, master, *flags), env=environment,
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
    old, new = Plan.from_json_text(replan.old_plan_json), Plan.from_json_text(replan.new_plan_json)
    assert new.assignments[3].tokens < old.assignments[3].tokens  # the slowed rank does less


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_lost_device_stops_every_node_and_says_where_the_checkpoint_is(plan_path, tmp_path):
    (code1, _, err1), (code0, _, err0) = two_nodes(plan_path, tmp_path, "--inject-failure=2@3")
    assert code0 != 0 and code1 != 0
    assert "rank 2 (slow #0, cpu) lost" in err1 and "a run over several nodes stops" in err1
    assert "newest checkpoint, step 3" in err1, err1[-2000:]
    assert "Traceback" not in err1.split("hexiseq run:")[-1]
    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        assert store.list_replans() == []
        (run,) = store.list_runtime_runs()
    assert run["status"] == "failed" and run["failure"]


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

    monkeypatch.setattr(supervise, "SHARED_FOLDER_TIMEOUT_S", 0.3)
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
