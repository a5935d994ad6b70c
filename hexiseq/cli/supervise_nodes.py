"""`hexiseq run --replan` over several nodes: one supervisor per node, one shared run folder.

Each node runs `hexiseq run --plan P --replan --node-rank K --master ADDR:PORT --run-dir DIR`,
DIR one folder every node sees at the same path (a network file system). Every supervisor
launches its own node's ranks (torch elastic's launcher with torchrun's static rendezvous:
global ranks in node order); node 0's makes the run folder, writes the first plan there, answers
drift and records plans and re-plans in the store. The others wait for that first plan (proof
that the folder is shared and that they run the same plan), take node 0's launch id from the
folder (their ranks' store rows and the rendezvous name share it) and only launch. Each launch
meets under its own name: `hexiseq-<launch id>-<launch number>`.

- **Drift** anywhere: rank 0 (on node 0) reports it, node 0's supervisor answers
  (`supervise.Watcher`), and every rank takes the new plan over in place, reading it and the
  checkpoint from the shared folder: no launch ends.
- **A lost device**: its node's launch ends with it lost, the others' with their peers' errors
  (`hexiseq.cli.peer_watch` stops a node's ranks as soon as another node's launch ended in
  error, or another node's supervisor stopped beating: on NCCL they would first wait out a
  collective's timeout).
  Every supervisor then writes how its launch ended into the launch's folder
  (`ended-<node>.json`: exit code and lost ranks). Node 0 waits for every node's (a node that
  never reports within `REPORT_TIMEOUT_S` lost all its devices: its machine is gone), plans on
  the devices left (`search.replan`) and writes the outcome, `end.json`: relaunch with this
  plan (and how ranks were renumbered), or stop. Every node then launches its part of the new
  plan from the newest checkpoint (node indices follow the new plan: a node left without
  devices leaves the run), or stops. Node 0 must keep a device: it holds the rendezvous.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hexiseq import supervision
from hexiseq.cli.peer_watch import PeerWatch
from hexiseq.cli.supervise import (
    MAX_LAUNCHES,
    POLL_S,
    Change,
    Fleet,
    Watcher,
    check_supervised,
    device_label,
    launch_arguments,
    ranks_environment,
    record_replan,
    record_taken,
    remember_plan,
    replan_cost_model,
    replan_lost,
    resume_step,
    run_folder,
)
from hexiseq.errors import InfeasibleError, InputError
from hexiseq.plan import Plan

if TYPE_CHECKING:
    from hexiseq.costmodel.base import CostModel
    from hexiseq.runtime.launcher import LaunchOutcome, NodeLaunch

SHARED_FOLDER_TIMEOUT_S = 120.0
"""How long a node other than node 0 waits for node 0's first plan in the shared run folder."""
REPORT_TIMEOUT_S = 60.0
"""How long node 0 waits, after its launch ended, for every node's report of how its ended."""
DECISION_TIMEOUT_S = 1200.0
"""How long another node waits for node 0's decision after its launch ended: node 0's ranks
may first wait out a collective's timeout on the lost peer (NCCL's default is 10 minutes;
gloo notices a closed socket at once)."""
LAUNCH_FILE = "launch.json"
"""Node 0's launch id, flags and start in the run folder: every node's ranks and rendezvous
use the id, every node must have the same flags."""


@dataclass
class NodeRun:
    """One node's supervisor: its node (by name: indices change when a node leaves), the run
    folder, the plan it runs and how its devices were renumbered."""

    args: argparse.Namespace
    environment: dict[str, str]
    name: str
    folder: Path
    plan: Plan
    plan_path: Path
    first: Plan
    fleet: Fleet

    @property
    def launch_id(self) -> str:
        from hexiseq.store import LAUNCH_ID_ENV

        return self.environment[LAUNCH_ID_ENV]

    @property
    def index(self) -> int:
        return [node.name for node in self.plan.cluster.nodes].index(self.name)

    @property
    def coordinator(self) -> bool:
        return self.index == 0

    def node_launch(self, launch: int) -> NodeLaunch:
        from hexiseq.cli.run import DEFAULT_MASTER
        from hexiseq.runtime.launcher import NodeLaunch

        master = str(self.args.master or DEFAULT_MASTER)
        return NodeLaunch(self.index, len(self.plan.cluster.nodes), master, launch)

    def run(self, launch: int) -> LaunchOutcome:
        """This node's ranks of the plan in launch number `launch`, until they end (or until
        another node's ended in error or went silent: `PeerWatch`)."""
        from hexiseq.runtime.launcher import launch as launch_ranks
        from hexiseq.runtime.launcher import stop_ranks

        exchange = supervision.launch_folder(self.folder, launch)
        arguments = launch_arguments(
            self.args, self.plan_path, self.folder, exchange, self.fleet, launch > 0
        )
        count = self.plan.cluster.nodes[self.index].count
        watch = PeerWatch(exchange, self.index, len(self.plan.cluster.nodes), stop_ranks)
        thread = watch.start()
        try:
            with ranks_environment(self.environment, self.visible_devices()):
                return launch_ranks(arguments, count, self.launch_id, self.node_launch(launch))
        finally:
            watch.stop(thread)

    def visible_devices(self) -> str | None:
        """`CUDA_VISIBLE_DEVICES` for this node's devices still present (its local rank r is
        the GPU of its original local rank); None while none of them was lost."""
        present = [d.rank for d in self.plan.cluster.devices if d.node == self.name]
        originals = [self.first.cluster.devices[self.fleet.original[r]] for r in present]
        local = [device.local_rank for device in originals]
        count = next(node.count for node in self.first.cluster.nodes if node.name == self.name)
        if local == list(range(count)):
            return None
        listed = self.environment.get("CUDA_VISIBLE_DEVICES")
        visible = listed.split(",") if listed else [str(i) for i in range(count)]
        if len(visible) < count:
            raise InputError(
                f"CUDA_VISIBLE_DEVICES={listed} lists {len(visible)} GPU(s) but node "
                f"{self.name} of the plan has {count}"
            )
        return ",".join(visible[i] for i in local)

    def take(self, decision: dict) -> None:
        """The plan `decision` relaunches with, its ranks renumbered."""
        self.plan_path = Path(decision["plan"])
        self.plan = Plan.from_json(self.plan_path)
        self.fleet.renumber({int(old): int(new) for old, new in decision["rank_map"].items()})


def supervise_nodes(args: argparse.Namespace, plan: Plan, environment: dict[str, str]) -> int:
    """This node's supervisor of a run over several nodes (module docstring); the exit code."""
    from hexiseq.cli.run import node_share
    from hexiseq.store import LAUNCH_ID_ENV

    name = node_share(plan, args.node_rank).name
    coordinator = args.node_rank == 0
    if coordinator:
        folder = run_folder(args, plan, environment[LAUNCH_ID_ENV])
        cost = replan_cost_model(args, plan)  # before the others see the run start
        started = {
            "launch_id": environment[LAUNCH_ID_ENV],
            "flags": shared_flags(args),
            "written_at": time.time(),
        }
        supervision.write_json(folder / LAUNCH_FILE, started)
        plan.to_json(folder / "plan-0.json")
    else:
        folder = shared_run_folder(args, plan)
        launch_file = supervision.read_json(folder / LAUNCH_FILE) or {}
        environment = {**environment, LAUNCH_ID_ENV: str(launch_file.get("launch_id", ""))}
    fleet = Fleet(list(range(plan.cluster.world_size)), args.inject_slowdown, args.inject_failure)
    node = NodeRun(args, environment, name, folder, plan, folder / "plan-0.json", plan, fleet)
    if coordinator:
        print(f"hexiseq run: supervising '{plan.name}' over {len(plan.cluster.nodes)} nodes; "
              f"run folder {folder}", flush=True)  # fmt: skip
        remember_plan(args, plan, "run")
        return _coordinate(node, cost)
    print(f"hexiseq run: node {args.node_rank} ({name}) of '{plan.name}', supervised by node 0; "
          f"run folder {folder}", flush=True)  # fmt: skip
    return _follow(node)


def _coordinate(node: NodeRun, cost: CostModel) -> int:
    """Node 0: launches, answers drift, decides after a loss and records."""
    from hexiseq.cli.run import fail_unended_runs

    args = node.args
    names = map(f"{node.plan.name}-replan{{}}".format, itertools.count(1))
    remember = functools.partial(remember_plan, args, label="replan")
    recorded: list[tuple[int | None, str]] = []
    last_loss_step = None
    for index in range(MAX_LAUNCHES):
        exchange = supervision.launch_folder(node.folder, index)
        exchange.mkdir(exist_ok=True)  # the next launch's is made before node 0 decides
        watcher = Watcher(exchange, node.folder, node.plan, cost, args.min_gain, names, remember)
        thread = watcher.start()
        try:
            outcome = node.run(index)
        finally:
            watcher.stop(thread)
        record_taken(args, node.launch_id, watcher, node.folder, recorded)
        node.plan = watcher.plan
        if outcome.code == 0:  # the run is done: a node still waiting hears it
            supervision.claim_json(
                supervision.end_path(exchange), {"action": "stop", "why": "node 0 finished"}
            )
            return 0
        _report(exchange, node.index, outcome)
        lost = _lost_ranks(node.plan, exchange)
        step = resume_step(node.folder)
        if index == MAX_LAUNCHES - 1:
            decision = {"action": "stop", "why": f"{MAX_LAUNCHES} launches made"}
        else:
            decision = _decide(node, cost, lost, step, last_loss_step, names)
        if decision["action"] == "stop":
            supervision.claim_json(supervision.end_path(exchange), decision)
            return _stopped(node, decision, outcome.code)
        last_loss_step = step
        fail_unended_runs(args, node.launch_id, f"{decision['detail']} (killed)")
        new = Plan.from_json(decision["plan"])
        remember(new)
        change = Change("lost", decision["detail"], {}, tuple(lost), None)
        replanned = _replanned_record(new, decision)
        recorded.append((record_replan(args, node.launch_id, node.plan, replanned, change, step),
                         new.name))  # fmt: skip
        supervision.launch_folder(node.folder, index + 1).mkdir()
        supervision.claim_json(supervision.end_path(exchange), decision)
        print(
            f"hexiseq run: re-planned ({decision['detail']}) -> '{new.name}' on "
            f"{new.cluster.world_size} ranks of {len(new.cluster.nodes)} nodes",
            flush=True,
        )
        node.take(decision)
    print(f"hexiseq run: stopped after {MAX_LAUNCHES} launches", file=sys.stderr)
    return 1


def _follow(node: NodeRun) -> int:
    """Node K > 0: launches its ranks, reports how they ended and does what node 0 decides."""
    for index in range(MAX_LAUNCHES):
        exchange = supervision.launch_folder(node.folder, index)
        outcome = node.run(index)
        _report(exchange, node.index, outcome)  # node 0 counts only silent nodes as lost
        if outcome.code == 0:
            return 0
        decision = _wait_for_end(exchange)
        if decision["action"] == "stop":
            return _stopped(node, decision, outcome.code)
        node.take(decision)
        if node.name not in {n.name for n in node.plan.cluster.nodes}:
            print(f"hexiseq run: node {node.name} has no device in the new plan "
                  f"'{node.plan.name}': leaving the run", flush=True)  # fmt: skip
            return 0
        count = node.plan.cluster.nodes[node.index].count
        print(f"hexiseq run: node {node.name} relaunches its {count} rank(s) of "
              f"'{node.plan.name}' from the newest checkpoint", flush=True)  # fmt: skip
    return 1


def _report(exchange: Path, index: int, outcome: LaunchOutcome) -> None:
    """How this node's launch ended (node `index` of the launch's plan), for node 0."""
    report = {"code": outcome.code, "lost": list(outcome.lost)}
    supervision.write_json(supervision.ended_path(exchange, index), report)


def _lost_ranks(plan: Plan, exchange: Path) -> list[int]:
    """Every node's lost ranks, once each node has reported (a node that never does within
    REPORT_TIMEOUT_S lost all of its devices)."""
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    while len(reports) < len(plan.cluster.nodes) and time.monotonic() < deadline:
        for index in range(len(plan.cluster.nodes)):
            if index not in reports:
                found = supervision.read_json(supervision.ended_path(exchange, index))
                if found is not None:
                    reports[index] = found
        time.sleep(POLL_S * 5)
    lost = {int(rank) for report in reports.values() for rank in report["lost"]}
    silent = {node.name for i, node in enumerate(plan.cluster.nodes) if i not in reports}
    lost |= {device.rank for device in plan.cluster.devices if device.node in silent}
    return sorted(lost)


def _decide(
    node: NodeRun,
    cost: CostModel,
    lost: list[int],
    step: int,
    last_loss_step: int | None,
    names,
) -> dict:
    """Node 0's answer to a launch that ended in error: relaunch on the devices left, or
    stop (no device lost: a failure, not a loss; node 0's own node lost; lost again before a
    step ran; nothing fits any more)."""
    plan = node.plan
    if not lost:
        return {"action": "stop", "why": "the ranks failed without losing a device"}
    detail = ", ".join(device_label(plan, r) for r in lost) + " lost"
    left = {d.node for d in plan.cluster.devices if d.rank not in set(lost)}
    if plan.cluster.nodes[0].name not in left:
        why = f"{detail}: node 0 ({plan.cluster.nodes[0].name}) holds the rendezvous"
        return {"action": "stop", "why": why}
    if step == last_loss_step:
        return {"action": "stop", "why": f"{detail} again before step {step} ran"}
    try:
        replanned = replan_lost(plan, cost, tuple(lost), next(names))
    except (InfeasibleError, InputError) as error:
        return {"action": "stop", "why": str(error)}
    path = node.folder / f"plan-{len(list(node.folder.glob('plan-*.json')))}.json"
    replanned.plan.to_json(path)
    return {
        "action": "relaunch",
        "plan": str(path.resolve()),
        "rank_map": {str(old): new for old, new in replanned.rank_map.items()},
        "lost": lost,
        "detail": detail,
        "predicted_new_step_s": replanned.predicted_new_step_s,
        "planning_s": replanned.planning_s,
    }


def _replanned_record(new: Plan, decision: dict):
    """The `Replanned` of a decision, for the store's record."""
    from hexiseq.search.replan import Replanned

    rank_map = {int(o): int(n) for o, n in decision["rank_map"].items()}
    return Replanned(new, rank_map, None, decision["predicted_new_step_s"], decision["planning_s"])


def _wait_for_end(exchange: Path) -> dict:
    """Node 0's decision after a launch that ended in error (stop when none comes)."""
    path = supervision.end_path(exchange)
    deadline = time.monotonic() + DECISION_TIMEOUT_S
    while time.monotonic() < deadline:
        found = supervision.read_json(path)
        if found is not None:
            return found
        time.sleep(POLL_S * 5)
    return {"action": "stop", "why": f"no decision from node 0 in {DECISION_TIMEOUT_S:.0f} s"}


def _stopped(node: NodeRun, decision: dict, code: int) -> int:
    """The run stops on every node: why, and where its newest checkpoint is."""
    from hexiseq.cli.run import fail_unended_runs

    step = resume_step(node.folder)
    print(f"hexiseq run: node {node.name} stops: {decision['why']}; the newest checkpoint, "
          f"step {step}, is in {node.folder / 'checkpoints'}", file=sys.stderr)  # fmt: skip
    if node.coordinator:
        fail_unended_runs(node.args, node.launch_id, decision["why"])
    return code or 1


def shared_run_folder(args: argparse.Namespace, plan: Plan) -> Path:
    """The run folder node 0 made (its first plan in it, the same plan as this node's), after
    this node's own checks; InputError when it does not appear in SHARED_FOLDER_TIMEOUT_S
    (not a folder the nodes share?) or holds another plan."""
    check_supervised(args, plan)
    folder = Path(args.run_dir)
    first = folder / "plan-0.json"
    deadline = time.monotonic() + SHARED_FOLDER_TIMEOUT_S
    while not first.exists():
        if time.monotonic() > deadline:
            raise InputError(
                f"--run-dir {folder}: node 0's first plan (plan-0.json) did not appear in "
                f"{SHARED_FOLDER_TIMEOUT_S:.0f} s; give every node the same folder on a file "
                "system they share, and start node 0 too"
            )
        time.sleep(POLL_S * 5)
    if Plan.from_json(first).to_json_text() != plan.to_json_text():
        raise InputError(
            f"--run-dir {folder}: node 0 runs another plan ({first}); give every node the same "
            "plan file and a run folder of its own run"
        )
    started = supervision.read_json(folder / LAUNCH_FILE) or {}
    problem = _earlier_run(folder, started) or _other_flags(started, shared_flags(args))
    if problem is not None:
        raise InputError(f"--run-dir {folder}: {problem}")
    return folder


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The flags every node of a supervised run must be given alike: the ranks of all nodes
    train, checkpoint and report drift together, and each node's supervisor injects the
    faults of its own ranks."""
    from hexiseq.cli.run import train_flags

    own = ("--plan=", "--no-store")  # the plan is compared whole; the store is each node's
    flags = [flag for flag in train_flags(args, "") if not flag.startswith(own)]
    return [
        *flags,
        f"--checkpoint-every={args.checkpoint_every}",
        f"--drift-threshold={args.drift_threshold!r}",
    ]


def _earlier_run(folder: Path, started: dict) -> str | None:
    """Why the run folder is an earlier run's, not the one node 0 starts now (None: it is
    this run's): its steps, launch reports or checkpoints, or a start (`started`: node 0's
    `LAUNCH_FILE`) older than a rendezvous waits (node 0 itself refuses a folder that is not
    empty)."""
    from hexiseq.runtime.launcher import RENDEZVOUS_TIMEOUT_S

    launches = supervision.launch_folders(folder)
    reports = [p for launch in launches for p in launch.glob("end*.json")]
    checkpoints = folder / "checkpoints"
    written_at = started.get("written_at")
    if (
        supervision.read_steps(folder)
        or reports
        or (checkpoints.is_dir() and any(checkpoints.iterdir()))
    ):
        return (
            "it holds an earlier run's steps, reports or checkpoints; give every node a new or "
            "empty folder (node 0 makes the run's files)"
        )
    stale = not isinstance(written_at, (int, float))
    if stale or time.time() - written_at > RENDEZVOUS_TIMEOUT_S:
        return (
            f"node 0 started this run more than {RENDEZVOUS_TIMEOUT_S} s ago (an earlier "
            "run's folder?); give every node a new or empty folder and start them together"
        )
    return None


def _other_flags(started: dict, flags: list[str]) -> str | None:
    """Which flags this node was given otherwise than node 0, whose start (`LAUNCH_FILE`)
    holds its own (None: all alike)."""
    theirs = started.get("flags", [])
    if sorted(theirs) == sorted(flags):  # faults may be given in any order
        return None
    node0 = " ".join(flag for flag in theirs if flag not in flags) or "(none)"
    mine = " ".join(flag for flag in flags if flag not in theirs) or "(none)"
    return (
        f"node 0 runs with {node0} where this node has {mine}; give every node the same "
        "flags (--steps, --seed, --device, --state-sharding, --checkpoint-every, "
        "--drift-threshold and the injected faults)"
    )
