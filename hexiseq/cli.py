"""The `hexiseq` command line: a thin shell over the library.

Bad input exits with code 2 and one line on stderr, never a traceback. Every command takes the
store URL from `--store`, else $HEXISEQ_STORE_URL, else sqlite:///hexiseq.db; a URL with a
password belongs in the environment (argv is public), and no output shows the password.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

from hexiseq._cli_dashboard import add_dashboard_parser, run_dashboard
from hexiseq._cli_fit import add_cost_model_argument, add_fit_parser, plan_cost_model, run_fit
from hexiseq._cli_predict import add_predict_parser, run_predict
from hexiseq._cli_profile import add_profile_parser, run_profile
from hexiseq._cli_types import positive_float, positive_int
from hexiseq.cluster import cluster_presets
from hexiseq.errors import HexiseqError
from hexiseq.model import model_presets
from hexiseq.store import (
    DEFAULT_STORE_URL,
    LAUNCH_ID_ENV,
    STORE_URL_ENV,
    STORE_URL_HELP,
    child_environment,
    store_url_from,
)

EXIT_BAD_INPUT = 2
STORE_EPILOG = (
    f"Every command takes the store URL from --store, else ${STORE_URL_ENV}, else "
    f"{DEFAULT_STORE_URL}. Give a URL with a password in ${STORE_URL_ENV}: a command line is "
    "visible to every user of the machine (hexiseq passes it to its own children in the "
    "environment, and shows it with the password masked)."
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hexiseq", description=__doc__.splitlines()[0], epilog=STORE_EPILOG)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = commands.add_parser(
        "plan",
        help="find the fastest CP-HP plan for a cluster, model and sequence length",
        description="Find the fastest asymmetric CP-HP plan and compare it with the baselines.",
    )
    plan.add_argument(
        "--cluster",
        required=True,
        metavar="PATH|PRESET",
        help=f"cluster YAML file or preset: {', '.join(cluster_presets())}",
    )
    plan.add_argument(
        "--model",
        required=True,
        metavar="PRESET",
        help=f"model preset: {', '.join(model_presets())}",
    )
    plan.add_argument(
        "--seq-len", required=True, metavar="TOKENS", help="tokens per sequence: 131072, 128k, 1M"
    )
    plan.add_argument("--out", metavar="PATH", help="write the best plan as JSON here")
    plan.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store the plans are saved in {STORE_URL_HELP}",
    )
    plan.add_argument("--no-store", action="store_true", help="do not save the plans")
    plan.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help="let the Optuna layer search this long beyond the greedy candidates",
    )
    plan.add_argument(
        "--trials",
        type=positive_int,
        metavar="N",
        help="trials in this run, a new study's greedy short list included (deterministic "
        "for a given --seed)",
    )
    plan.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    plan.add_argument(
        "--storage",
        metavar="URL",
        help="SQLAlchemy URL of the Optuna study (SQLite, PostgreSQL): keeps it, lets workers "
        "share it and a later run go on with it",
    )
    plan.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="processes searching one study (needs --storage; default 1)",
    )
    plan.add_argument(
        "--pareto",
        action="store_true",
        help="search throughput against memory headroom and print the Pareto front",
    )
    plan.add_argument(
        "--checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation checkpointing: auto (off wherever memory allows), on, or off",
    )
    plan.add_argument(
        "--no-checkpointing", action="store_true", help="same as --checkpointing off"
    )
    add_cost_model_argument(plan)
    _add_run_parser(commands)
    add_fit_parser(commands)
    add_predict_parser(commands)
    add_dashboard_parser(commands)
    add_profile_parser(commands)
    return parser


def _add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run",
        help="train a plan for a few steps under torchrun and record measured times and memory",
        description="Start torchrun with one rank per device of the plan and run "
        "hexiseq.runtime.train: measured step time and peak memory per rank go to the store.",
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
    run.add_argument("--seed", type=int, default=0, help="parameter and token seed (default 0)")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hexiseq` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command != "predict":  # predict reads no store unless one is named
        args.store = store_url_from(args.store)
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "run":
            return _run(args)
        if args.command == "dashboard":
            return run_dashboard(args)
        if args.command == "fit":
            return run_fit(args)
        if args.command == "predict":
            return run_predict(args)
        if args.command == "profile":
            return run_profile(args)
    except HexiseqError as exc:
        print(f"hexiseq: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hexiseq.cluster import Cluster
    from hexiseq.model import ModelSpec
    from hexiseq.report import format_search_result
    from hexiseq.search import plan_search
    from hexiseq.units import parse_seq_len

    # Check every input before anything is created on disk.
    cluster, model = Cluster.load(args.cluster), ModelSpec.preset(args.model)
    seq_len = parse_seq_len(args.seq_len)
    store = _open_store(args)
    cost_model = plan_cost_model(args, store)  # None: the datasheet default
    result = plan_search(
        cluster,
        model,
        seq_len,
        time_budget_s=args.time_budget,
        n_trials=args.trials,
        seed=args.seed,
        storage=args.storage,
        workers=args.workers,
        multi_objective=args.pareto,
        activation_checkpointing=_checkpointing(args),
        show_progress=_wants_progress(args),
        cost_model=cost_model,
    )
    print(format_search_result(result))
    if cost_model is not None:
        labels = result.best.predicted.cost_model.items()
        print("\ncost model per device type: " + "; ".join(f"{g}: {m}" for g, m in labels))
    if args.out:
        _write_plan(result.best, args.out)
        print(f"\nplan written to {args.out}")
    if store is not None:
        plan_id = store.save_search_result(result.best, result.baselines)
        print(f"saved to {store.url} as plan {plan_id} (baselines beside it)")
        store.close()
    return 0


def _run(args: argparse.Namespace) -> int:
    """Check the plan here (a clear error, no torch import), then hand over to torchrun; the
    store URL goes to the ranks in $HEXISEQ_STORE_URL (`run_command`)."""
    import subprocess

    from hexiseq.plan import Plan

    plan = Plan.from_json(args.plan)
    if args.device != "cpu":
        check_run_devices(plan, args.device)
    command, environment = run_command(args, plan.cluster.world_size)
    launch_id = environment[LAUNCH_ID_ENV]
    try:
        code = subprocess.run(command, env=environment, check=False).returncode
    except KeyboardInterrupt:
        _fail_unended_runs(args, launch_id, "interrupted (Ctrl-C) before its ranks ended it")
        raise
    if code != 0:
        _fail_unended_runs(
            args, launch_id, f"torchrun exited with code {code} before its ranks ended the run"
        )
    return code


def _fail_unended_runs(args: argparse.Namespace, launch_id: str, failure: str) -> None:
    """Mark this launch's runs that no rank could end (killed, crashed) failed with why."""
    from hexiseq.errors import HexiseqError

    if args.no_store:
        return
    try:
        with _open_store(args) as store:
            store.fail_unended_runs(launch_id, failure)
    except HexiseqError as error:
        print(f"hexiseq run: could not record the failure: {error}", file=sys.stderr)


def check_run_devices(plan, device: str) -> None:
    """Before any process group forms: `--device cuda` needs one CUDA device per rank of the
    plan on this machine, each of the GPU type the plan put there; `auto` checks the same
    when CUDA is there (else the ranks run on the CPU)."""
    import torch

    from hexiseq.catalog import catalog_type_for
    from hexiseq.errors import InputError

    available = torch.cuda.is_available()
    if not available:
        if device == "cuda":
            raise InputError(
                f"--device cuda: torch {torch.__version__} finds no CUDA device here; use "
                "--device cpu (or auto)"
            )
        return
    count, world = torch.cuda.device_count(), plan.cluster.world_size
    if count < world:
        raise InputError(
            f"the plan has {world} ranks, one per device, but this machine has {count} CUDA "
            "device(s); plan for the devices you run on"
        )
    for rank, assignment in enumerate(plan.assignments):
        name = torch.cuda.get_device_name(rank)
        memory_GiB = torch.cuda.get_device_properties(rank).total_memory / 2**30
        found = catalog_type_for(name, memory_GiB)
        if found != assignment.gpu:
            raise InputError(
                f"rank {rank} is planned on a {assignment.gpu} but cuda:{rank} is a {name} "
                f"({found or 'not in the catalog'}); plan for the devices you run on"
            )


def run_command(args: argparse.Namespace, world_size: int) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line of `hexiseq run` and its environment: the store URL (it may
    hold a password) is in the environment only, since any user can read a command line, with
    a new launch id that the run's row keeps ($HEXISEQ_LAUNCH_ID)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port on this machine
        f"--nproc-per-node={world_size}",
        "-m",
        "hexiseq.runtime.train",
        f"--plan={args.plan}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        f"--device={args.device}",
        f"--state-sharding={args.state_sharding}",
        *(["--no-store"] if args.no_store else []),
    ]
    environment = child_environment(None if args.no_store else args.store)
    environment[LAUNCH_ID_ENV] = uuid.uuid4().hex
    return command, environment


def _checkpointing(args: argparse.Namespace) -> bool | None:
    if args.no_checkpointing:
        return False
    return {"auto": None, "on": True, "off": False}[args.checkpointing]


def _wants_progress(args: argparse.Namespace) -> bool:
    """A progress bar (on stderr) for searches that may run longer than a second."""
    long_search = args.time_budget is not None and args.time_budget > 1 or args.trials is not None
    return bool(long_search and sys.stderr.isatty())


def _open_store(args: argparse.Namespace):
    if args.no_store:
        return None
    from hexiseq.store import Store

    return Store.open(args.store)


def _write_plan(plan, path: str) -> None:
    from hexiseq.errors import InputError

    try:
        plan.to_json(path)
    except OSError as exc:
        raise InputError(f"--out {path}: cannot write ({exc.strerror or exc})") from None


if __name__ == "__main__":
    raise SystemExit(main())
