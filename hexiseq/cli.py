"""The `hexiseq` command line: a thin shell over the library.

Bad input exits with code 2 and one line on stderr, never a traceback; "no plan fits" exits
with 3; the other codes are in `EXIT_CODES_EPILOG` (`hexiseq --help`). Every command takes the
store URL from `--store`, else $HEXISEQ_STORE_URL, else sqlite:///hexiseq.db; a URL with a
password belongs in the environment (argv is public), and no output shows the password.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import uuid
from collections.abc import Sequence

from hexiseq._cli_dashboard import add_dashboard_parser, run_dashboard
from hexiseq._cli_fit import add_fit_parser, run_fit
from hexiseq._cli_output import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_CODES_EPILOG,
    EXIT_NO_PLAN_FITS,
)
from hexiseq._cli_plan import add_plan_parser, run_plan
from hexiseq._cli_plans import add_plans_parser, run_plans
from hexiseq._cli_predict import add_predict_parser, run_predict
from hexiseq._cli_profile import add_profile_parser, run_profile
from hexiseq._cli_torch import require_torch
from hexiseq._cli_types import positive_int, seed
from hexiseq.errors import HexiseqError, InfeasibleError
from hexiseq.store import (
    DEFAULT_STORE_URL,
    LAUNCH_ID_ENV,
    STORE_URL_ENV,
    STORE_URL_HELP,
    child_environment,
    store_url_from,
)

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


def package_version() -> str:
    """hexiseq's version from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hexiseq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    epilog = textwrap.fill(STORE_EPILOG, 79) + "\n\n" + EXIT_CODES_EPILOG
    parser = _Parser(
        prog="hexiseq",
        description=__doc__.splitlines()[0],
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hexiseq {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_plan_parser(commands)
    add_plans_parser(commands)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hexiseq` console script; returns the exit code.

    A reader that closes stdout early (`hexiseq plans list | head -1`) ends the command
    quietly with EXIT_BROKEN_PIPE: no traceback, nothing more written."""
    try:
        code = _dispatch(build_parser().parse_args(argv))
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be caught
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _dispatch(args: argparse.Namespace) -> int:
    if args.command != "predict":  # predict reads no store unless one is named
        args.store = store_url_from(args.store)
    try:
        if args.command == "plan":
            return run_plan(args)
        if args.command == "plans":
            return run_plans(args)
        if args.command == "run":
            require_torch("hexiseq run")
            return _run(args)
        if args.command == "dashboard":
            return run_dashboard(args)
        if args.command == "fit":
            return run_fit(args)
        if args.command == "predict":
            return run_predict(args)
        if args.command == "profile":
            require_torch("hexiseq profile")
            return run_profile(args)
    except InfeasibleError as exc:
        print(f"hexiseq: error: {exc}", file=sys.stderr)
        return EXIT_NO_PLAN_FITS
    except HexiseqError as exc:
        print(f"hexiseq: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not raise
    BrokenPipeError again (Python's documented pattern for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (an in-process test's buffer)
        pass


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


def _open_store(args: argparse.Namespace):
    if args.no_store:
        return None
    from hexiseq.store import Store

    return Store.open(args.store)


if __name__ == "__main__":
    raise SystemExit(main())
