"""`hexiseq run`: check the plan here (a clear error, no torch import), then start torchrun with
one rank per device of the plan — on this machine, or, with `--node-rank K --master ADDR:PORT`,
node K's ranks of a multi-node plan; `--print-launch` prints every node's command instead.

torchrun numbers global ranks node by node (a node's base rank is the sum of the earlier nodes'
process counts), as the cluster numbers its devices, so node K of the plan is torchrun's node
rank K with as many processes as the node has devices, whatever the other nodes have.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import uuid
from dataclasses import dataclass

from hexiseq.cli.arguments import positive_int, seed
from hexiseq.errors import InputError
from hexiseq.injections import add_injection_arguments
from hexiseq.store import LAUNCH_ID_ENV, STORE_URL_ENV, STORE_URL_HELP, child_environment
from hexiseq.supervision import DEFAULT_DRIFT_THRESHOLD, MIN_GAIN

DEFAULT_MASTER = "127.0.0.1:29500"


def add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run",
        help="train a plan for a few steps under torchrun and record measured times and memory",
        description="Start torchrun with one rank per device of the plan and run "
        "hexiseq.runtime.train: measured step time and peak memory per rank go to the store. "
        "A plan over several nodes: --print-launch prints each node's command; on node K, "
        "--node-rank K --master ADDR:PORT starts that node's ranks.",
    )
    run.add_argument("--plan", required=True, metavar="PATH", help="plan JSON file")
    run.add_argument("--steps", type=positive_int, default=5, metavar="K", help="steps (5)")
    run.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store the measurements go to {STORE_URL_HELP}; the ranks "
        "get it through their environment, never their command line",
    )
    run.add_argument("--no-store", action="store_true", help="record nothing")
    run.add_argument(
        "--seed", type=seed, default=0, help="parameter and token seed, 0..2**32-1 (default 0)"
    )
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL) when available, else CPU (gloo)",
    )
    run.add_argument(
        "--state-sharding",
        choices=("sharded", "replicated", "fsdp2"),
        default="sharded",
        help="sharded (default; 'fsdp2' is its former name): parameters, gradients and AdamW "
        "states split over the ranks in the plan's state fractions, even or not, "
        "as the memory model counts them; replicated: all on every rank, gradients all-reduced",
    )
    run.add_argument(
        "--print-launch",
        action="store_true",
        help="print the command that starts each node of the plan (node rank, process count, "
        "rendezvous, one shared launch id) and exit; starts nothing",
    )
    run.add_argument(
        "--node-rank",
        type=_node_rank,
        metavar="K",
        help="start node K's ranks of the plan (its nodes in file order, from 0) and meet the "
        "other nodes at --master",
    )
    run.add_argument(
        "--master",
        type=_master,
        metavar="ADDR:PORT",
        help=f"node 0's address and a free port, reachable from every node (default "
        f"{DEFAULT_MASTER}: all nodes on this machine)",
    )
    _add_replan_flags(run)


def _add_replan_flags(run) -> None:
    """Supervised runs that re-plan on drift or a lost device, and the faults to test them."""
    replan = run.add_argument_group(
        "re-planning (one machine, or every node with --node-rank and a shared --run-dir)"
    )
    replan.add_argument(
        "--replan",
        action="store_true",
        help="supervise the run: checkpoint every --checkpoint-every steps; when a rank drifts "
        "(its compute timed against the plan) or a device is lost, plan again from "
        "the measured rates, and go on from the same step with the new plan, state resharded",
    )
    replan.add_argument(
        "--run-dir",
        metavar="DIR",
        help="folder for the plans, checkpoints and step log of a --replan run "
        "(default ./hexiseq-run-<launch id>); with --node-rank, one folder every node "
        "shares (a network file system), given to every node",
    )
    replan.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="K",
        help="steps between checkpoints of a --replan run (1); a lost device costs the steps "
        "since the last one, run again",
    )
    replan.add_argument(
        "--drift-threshold",
        type=_above_one,
        metavar="X",
        help=f"a rank drifted when its compute stays X times its start "
        f"({DEFAULT_DRIFT_THRESHOLD})",
    )
    replan.add_argument(
        "--min-gain",
        type=_above_one,
        metavar="X",
        help=f"re-plan on drift only when the new plan is predicted X times faster ({MIN_GAIN})",
    )
    replan.add_argument(
        "--cost-model",
        choices=("auto", "fitted", "datasheet"),
        help="cost model of the re-plans: auto (the store's fit where it has one, else the "
        "datasheet), fitted, datasheet",
    )
    add_injection_arguments(replan)


REPLAN_DEFAULTS = {
    "run_dir": None,
    "checkpoint_every": 1,
    "drift_threshold": DEFAULT_DRIFT_THRESHOLD,
    "min_gain": MIN_GAIN,
    "cost_model": "auto",
}
"""The --replan options and their defaults (given without --replan: an error, not ignored)."""


def replan_options(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the --replan options' defaults filled in; InputError for one of them
    given without --replan."""
    given = [name for name in REPLAN_DEFAULTS if getattr(args, name, None) is not None]
    if not args.replan:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise InputError(f"{flags}: only with --replan (a supervised run)")
        return args
    filled = {name: getattr(args, name, None) for name in REPLAN_DEFAULTS}
    filled = {
        n: default if filled[n] is None else filled[n] for n, default in REPLAN_DEFAULTS.items()
    }
    return argparse.Namespace(**{**vars(args), **filled})


def _above_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not (value > 1 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number > 1 (got {text})")
    return value


@dataclass(frozen=True)
class Master:
    """The rendezvous: node 0's address and port."""

    address: str
    port: int

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


def _node_rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def _master(text: str) -> Master:
    address, colon, port = text.rpartition(":")
    address = address.strip("[]")  # an IPv6 address in brackets
    if not colon or not address or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not ADDR:PORT (a host name or address, and a port in 1..65535)"
        )
    return Master(address, int(port))


@dataclass(frozen=True)
class NodeShare:
    """Node `index` of a plan: its name, GPU type and global ranks first..last."""

    index: int
    name: str
    gpu: str
    first_rank: int
    count: int

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.count - 1


def node_shares(plan) -> list[NodeShare]:
    """Each node of the plan's cluster with the global ranks it runs, in node order."""
    shares, first = [], 0
    for index, node in enumerate(plan.cluster.nodes):
        shares.append(NodeShare(index, node.name, node.gpu, first, node.count))
        first += node.count
    return shares


def node_share(plan, node_rank: int) -> NodeShare:
    """Node `node_rank` of the plan; InputError naming the nodes there are."""
    shares = node_shares(plan)
    if node_rank >= len(shares):
        raise InputError(
            f"--node-rank {node_rank}: plan '{plan.name}' has {len(shares)} node(s), so the "
            f"node rank is 0..{len(shares) - 1}"
        )
    return shares[node_rank]


def run_command(
    args: argparse.Namespace, plan, launch_id: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line of `hexiseq run` and its environment: the store URL (it may
    hold a password) is in the environment only, since any user can read a command line, with
    the launch id that the run's row keeps ($HEXISEQ_LAUNCH_ID: `launch_id`, else the one in
    this environment, else a new one)."""
    command = [sys.executable, "-m", "torch.distributed.run", *_rendezvous(args, plan)]
    command += ["-m", "hexiseq.runtime.train", *_train_flags(args)]
    environment = child_environment(None if args.no_store else args.store)
    environment[LAUNCH_ID_ENV] = launch_id or environment.get(LAUNCH_ID_ENV) or new_launch_id()
    return command, environment


def new_launch_id() -> str:
    return uuid.uuid4().hex


def _rendezvous(args: argparse.Namespace, plan) -> list[str]:
    if args.node_rank is None:
        return ["--standalone", f"--nproc-per-node={plan.cluster.world_size}"]
    share = node_share(plan, args.node_rank)
    master = args.master or _master(DEFAULT_MASTER)
    return [
        f"--nnodes={len(plan.cluster.nodes)}",
        f"--node-rank={share.index}",
        f"--nproc-per-node={share.count}",
        f"--master-addr={master.address}",
        f"--master-port={master.port}",
    ]


def _train_flags(args: argparse.Namespace) -> list[str]:
    return train_flags(args, args.plan)


def train_flags(args: argparse.Namespace, plan_path) -> list[str]:
    """The runtime's flags for `hexiseq run`'s own (`plan_path`: the plan file it runs)."""
    return [
        f"--plan={plan_path}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        f"--device={args.device}",
        f"--state-sharding={args.state_sharding}",
        *(f"--inject-slowdown={s}" for s in args.inject_slowdown),
        *(f"--inject-failure={f}" for f in args.inject_failure),
        *(["--no-store"] if args.no_store else []),
    ]


def launch_text(args: argparse.Namespace, plan) -> str:
    """What `--print-launch` prints: per node, the `hexiseq run` command that starts it (with
    its checks and failure records) and the bare torchrun command it runs, all under one new
    launch id. No store URL: each node takes it from its own $HEXISEQ_STORE_URL."""
    master = args.master or _master(DEFAULT_MASTER)
    launch_id = new_launch_id()
    shares = node_shares(plan)
    lines = [
        f"# plan '{plan.name}': {plan.cluster.world_size} ranks on {len(shares)} node(s); "
        f"rendezvous at {master} (node 0's address, reachable from every node)",
        f"# every node needs the same plan file at {args.plan}"
        + ("" if args.no_store else f" and the store URL in ${STORE_URL_ENV}"),
    ]
    if args.replan:
        lines.append(
            f"# --replan: {args.run_dir} must be one folder every node shares, at that path; "
            "node 0 supervises: it answers drift (every node takes the new plan over in "
            "place) and re-plans after a lost device (every node relaunches its part)"
        )
    if args.master is None:
        lines.append(
            f"# {DEFAULT_MASTER} is the default: for nodes on other machines give --master "
            "with node 0's address, reachable from every node, and a free port"
        )
    for share in shares:
        node_args = argparse.Namespace(**{**vars(args), "node_rank": share.index,
                                          "master": master})  # fmt: skip
        hexiseq = ["hexiseq", "run", *_hexiseq_flags(node_args)]
        torchrun, _ = run_command(node_args, plan, launch_id)
        torchrun = ["torchrun", *torchrun[3:]]  # `python -m torch.distributed.run` as installed
        lines += [
            "",
            f"# node {share.index} ({share.name}): {share.count} x {share.gpu}, ranks "
            f"{share.first_rank}..{share.last_rank}",
            f"{LAUNCH_ID_ENV}={launch_id} {shlex.join(hexiseq)}",
        ]
        if not args.replan:  # a supervised node needs its supervisor: no bare torchrun
            lines.append(f"#   or, by hand: {LAUNCH_ID_ENV}={launch_id} {shlex.join(torchrun)}")
    return "\n".join(lines)


def _hexiseq_flags(args: argparse.Namespace) -> list[str]:
    plan, *rest = _train_flags(args)
    node = [plan, f"--node-rank={args.node_rank}", f"--master={args.master}", *rest]
    if not args.replan:
        return node
    return [
        *node,
        "--replan",
        f"--run-dir={args.run_dir}",
        f"--checkpoint-every={args.checkpoint_every}",
        f"--drift-threshold={args.drift_threshold!r}",
        f"--min-gain={args.min_gain!r}",
        f"--cost-model={args.cost_model}",
    ]


def run_run(args: argparse.Namespace) -> int:
    """`hexiseq run`: the plan and this node's devices checked, then torchrun (or, with
    `--print-launch`, every node's command printed)."""
    import subprocess

    from hexiseq.plan import Plan

    args = replan_options(args)
    plan = Plan.from_json(args.plan)
    if args.node_rank is not None:
        node_share(plan, args.node_rank)  # a node the plan has
    if args.replan and (args.print_launch or args.node_rank is not None) and not args.run_dir:
        raise InputError(
            "--replan over several nodes needs --run-dir: one folder every node shares (a "
            "network file system), for the plans, checkpoints and drift reports"
        )
    if args.print_launch:
        print(launch_text(args, plan))
        return 0
    if args.device != "cpu":
        from hexiseq.runtime.devices import check_run_devices  # torch: only for a run

        check_run_devices(plan, args.device, args.node_rank)
    command, environment = run_command(args, plan)
    launch_id = environment[LAUNCH_ID_ENV]
    if args.replan:
        return _supervised(args, plan, environment)
    try:
        code = subprocess.run(command, env=environment, check=False).returncode
    except KeyboardInterrupt:
        fail_unended_runs(args, launch_id, "interrupted (Ctrl-C) before its ranks ended it")
        raise
    if code != 0:
        fail_unended_runs(
            args, launch_id, f"torchrun exited with code {code} before its ranks ended the run"
        )
    return code


def _supervised(args: argparse.Namespace, plan, environment: dict[str, str]) -> int:
    """`--replan`: the supervisor in this process, its ranks seeing `environment`."""
    from hexiseq.cli.supervise import supervise

    launch_id = environment[LAUNCH_ID_ENV]
    try:
        code = supervise(args, plan, environment)
    except KeyboardInterrupt:
        fail_unended_runs(args, launch_id, "interrupted (Ctrl-C) before its ranks ended it")
        raise
    if code != 0:
        fail_unended_runs(args, launch_id, f"ranks exited with code {code}")
    return code


def fail_unended_runs(args: argparse.Namespace, launch_id: str, failure: str) -> None:
    """Mark this launch's runs that no rank could end (killed, crashed) failed with why."""
    from hexiseq.errors import HexiseqError
    from hexiseq.store import Store

    if args.no_store:
        return
    try:
        with Store.open(args.store) as store:
            store.fail_unended_runs(launch_id, failure)
    except HexiseqError as error:
        print(f"hexiseq run: could not record the failure: {error}", file=sys.stderr)
