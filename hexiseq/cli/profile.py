"""`hexiseq profile` (compute sweep on one device) and `hexiseq profile links` (link sweep
under torchrun): argument parsing and checks, then a hand-over to `hexiseq.profiler`.

Every input is checked before the store is created or torch starts work, so bad input exits
with code 2 and one line. Importing this module imports neither torch nor the profiler.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from hexiseq.cli.arguments import positive_int
from hexiseq.cli.output import print_json
from hexiseq.errors import InputError
from hexiseq.store import STORE_URL_HELP, child_environment

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_COMPUTE_ONLY = {"emulation_slowdown": "--emulation-slowdown", "threads": "--threads"}


def add_profile_parser(commands) -> None:
    """Add `profile` (and its `links` subcommand) to the CLI's subcommands."""
    profile = commands.add_parser(
        "profile",
        help="microbenchmark a device (GEMM, attention, elementwise) or its links; "
        "results go to the store",
        description="Run the compute sweep of a grid on one device and write one row per point "
        "to the store; points already there are skipped, so an interrupted sweep resumes.",
    )
    _add_shared_options(profile, argparse_defaults=True)
    profile.add_argument(
        "--emulation-slowdown",
        type=_slowdown,
        default=None,
        metavar="K",
        help="CPU only: pad each timed call by sleeping (K-1) x its duration, to profile an "
        "emulated device K times slower (default 1)",
    )
    profile.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch.set_num_threads(N) for the sweep (default: torch's own choice)",
    )
    targets = profile.add_subparsers(
        dest="profile_target", parser_class=type(profile), title="link sweep", metavar="links"
    )
    _add_links_parser(targets)


def _add_links_parser(targets) -> None:
    links = targets.add_parser(
        "links",
        help="measure p2p, all-to-all, all-gather and reduce-scatter between N local ranks",
        description="Start torchrun with N ranks (gloo on CPU, NCCL on CUDA) and time p2p ring "
        "exchanges and collectives over message sizes; rank 0 writes the rows.",
    )
    _add_shared_options(links, argparse_defaults=False)
    links.add_argument(
        "--nproc", type=positive_int, required=True, metavar="N", help="ranks (at least 2)"
    )
    links.add_argument(
        "--link-class",
        metavar="NAME",
        help="what the measured link stands for, e.g. inter when CPU processes on one machine "
        "emulate an inter-node link (default intra:<device_type>)",
    )


def _add_shared_options(parser: argparse.ArgumentParser, *, argparse_defaults: bool) -> None:
    """Options both sweeps take. On `links` they default to SUPPRESS, so that an option given
    before `links` (`profile --quick links ...`) is not overwritten by the subparser."""

    def default(value):
        return value if argparse_defaults else argparse.SUPPRESS

    parser.add_argument(
        "--device",
        type=_device,
        default=default("cpu"),
        metavar="cpu|cuda[:I]",
        help="device to profile (links: cpu or cuda; default cpu)",
    )
    parser.add_argument(
        "--quick", action="store_true", default=default(False), help="the small quick grid"
    )
    parser.add_argument(
        "--grid",
        default=default(None),
        metavar="PATH",
        help="grid YAML file (default: the shipped full grid, or quick with --quick)",
    )
    parser.add_argument(
        "--store",
        default=default(None),
        metavar="URL",
        help=f"SQLAlchemy URL of the store {STORE_URL_HELP}",
    )
    parser.add_argument(
        "--device-type",
        default=default(None),
        metavar="GPU",
        help="catalog GPU type of a CUDA device whose name the catalog does not match",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print one JSON document on stdout (what was measured, by status, and what was "
        "skipped) and no human text",
    )


def run_profile(args: argparse.Namespace) -> int:
    """Run the sweep `args` ask for; raises InputError (exit 2) for bad input."""
    if args.profile_target == "links":
        return _run_links(args)
    return _run_compute(args)


def _run_compute(args: argparse.Namespace) -> int:
    from hexiseq.profiler import load_grid

    slowdown = 1.0 if args.emulation_slowdown is None else args.emulation_slowdown
    if slowdown > 1.0 and args.device != "cpu":
        raise InputError(
            f"--emulation-slowdown {slowdown:g} pads CPU compute by sleeping; it is for "
            f"--device cpu only (a GPU is profiled as it is)"
        )
    grid_path, grid_label = _grid_source(args)
    grid = load_grid(grid_path)
    return _sweep_compute(args, grid, grid_label, slowdown)


def _sweep_compute(args: argparse.Namespace, grid, grid_label: str, slowdown: float) -> int:
    from hexiseq.profiler import (
        ComputeSweep,
        check_device_available,
        describe_device,
        parse_device,
        run_compute_sweep,
        set_threads,
    )
    from hexiseq.store import Store

    device = parse_device(args.device)
    check_device_available(device)
    set_threads(args.threads)
    identity = describe_device(device, args.device_type)
    sweep = ComputeSweep(
        grid=grid,
        grid_name=grid_label,
        device=device,
        identity=identity,
        quick=args.quick,
        emulation_slowdown=slowdown,
        command=_command_line(args, grid_label),
    )
    with Store.open(args.store) as store:
        summary = run_compute_sweep(store, sweep)
        url = store.url
    if args.json:
        print_json(compute_document(args, identity, grid_label, summary, url))
        return 0
    print(
        f"profile {identity.device_type} ({identity.device_name}), grid {grid_label}: "
        f"{summary.describe()}; store {url}"
    )
    return 0


def compute_document(args: argparse.Namespace, identity, grid_label: str, summary, url: str):
    """What `hexiseq profile --json` prints: the device, the grid, the points measured by
    status, and those skipped (already in the store, or over the grid's size limit)."""
    return {
        "target": "compute",
        "device": args.device,
        "device_type": identity.device_type,
        "device_name": identity.device_name,
        "grid": grid_label,
        "store": url,
        "run_id": summary.run_id,
        "measured": dict(sorted(summary.statuses.items())),
        "measured_total": sum(summary.statuses.values()),
        "skipped": {"already_stored": summary.already_stored, "over_limit": summary.over_limit},
    }


def _run_links(args: argparse.Namespace) -> int:
    """Check everything here (one clear line), then hand over to torchrun."""
    from hexiseq.profiler import load_grid
    from hexiseq.store import Store

    for name, flag in _COMPUTE_ONLY.items():
        if getattr(args, name) is not None:
            raise InputError(f"{flag} is for compute sweeps, not `profile links`")
    if args.nproc < 2:
        raise InputError(f"--nproc {args.nproc}: a link needs at least 2 ranks")
    if args.device not in ("cpu", "cuda"):
        raise InputError(f"--device {args.device}: links run on cpu or cuda (rank i on cuda:i)")
    if args.link_class is not None and not args.link_class.strip():
        raise InputError("--link-class must not be empty")
    grid_path, grid_label = _grid_source(args)
    grid = load_grid(grid_path)
    if grid.links is None:
        raise InputError(f"grid file {grid_path}: has no links section to sweep")
    if args.device == "cuda":
        from hexiseq.profiler import check_cuda_ranks

        check_cuda_ranks(args.nproc)
    with Store.open(args.store) as store:  # a bad URL fails here, in one line, not on rank 0
        runs_before = _profile_run_ids(store) if args.json else set()
    command, environment = links_command(args, grid_path, grid_label)
    # With --json the ranks' human line goes to stderr: stdout holds the document alone.
    output = {"stdout": sys.stderr} if args.json else {}
    code = subprocess.run(command, env=environment, check=False, **output).returncode
    if args.json:
        print_json(_links_document(args, grid, grid_label, runs_before, code))
    return code


def _profile_run_ids(store) -> set[int]:
    return {run_id for run_id, _, _ in store.profile_measurements_by_run()}


def _links_document(
    args: argparse.Namespace, grid, grid_label: str, runs_before: set[int], code: int
) -> dict:
    """What `hexiseq profile links --json` prints, read back from the store after torchrun:
    the points this sweep measured, by status, and those it skipped (already stored)."""
    from collections import Counter

    from hexiseq.profiler._points import link_points
    from hexiseq.store import Store

    with Store.open(args.store) as store:
        new_runs = [
            run for run in store.profile_measurements_by_run() if run[0] not in runs_before
        ]
        url = store.url
    measurements = [m for _, _, rows in new_runs for m in rows]
    measured = Counter(m.status for m in measurements)
    total = len(link_points(grid, args.nproc))
    return {
        "target": "links",
        "device": args.device,
        "nproc": args.nproc,
        "grid": grid_label,
        "store": url,
        "exit_code": code,
        "run_ids": [run_id for run_id, _, _ in new_runs],
        "link_classes": sorted({m.link_class for m in measurements if m.link_class}),
        "measured": dict(sorted(measured.items())),
        "measured_total": len(measurements),
        "skipped": {"already_stored": total - len(measurements) if code == 0 else None},
    }


def links_command(
    args: argparse.Namespace, grid_path: Path, grid_label: str
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line of the link sweep and its environment: the store URL (it may
    hold a password) goes in $HEXISEQ_STORE_URL, never the command line any user can read."""
    # One thread per rank (the ranks share the machine); set here, torchrun prints no banner.
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    environment = child_environment(args.store, **threads)
    return _torchrun_command(args, grid_path, grid_label), environment


def _torchrun_command(args: argparse.Namespace, grid_path: Path, grid_label: str) -> list[str]:
    optional = {"--device-type": args.device_type, "--link-class": args.link_class}
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port on this machine
        f"--nproc-per-node={args.nproc}",
        "-m",
        "hexiseq.profiler.links",
        f"--grid={grid_path}",
        f"--grid-name={grid_label}",
        f"--device={args.device}",
        f"--command={_command_line(args, grid_label)}",
        *[f"{flag}={value}" for flag, value in optional.items() if value is not None],
        *(["--quick"] if args.quick else []),
        *(["--progress"] if sys.stderr.isatty() else []),
    ]


def _grid_source(args: argparse.Namespace) -> tuple[Path, str]:
    """(grid file, label recorded in the store): the user's file or a shipped grid."""
    from hexiseq.profiler import builtin_grid_path

    if args.grid is not None:
        return Path(args.grid), str(args.grid)
    path = builtin_grid_path(args.quick)
    return path, path.stem


def _command_line(args: argparse.Namespace, grid_label: str) -> str:
    """The sweep as a command, recorded with its run (the store URL left out)."""
    words = ["hexiseq profile"]
    if args.profile_target == "links":
        words += ["links", f"--nproc {args.nproc}"]
        words += [f"--link-class {args.link_class}"] if args.link_class else []
    words += [f"--device {args.device}", f"--grid {grid_label}"]
    words += ["--quick"] if args.quick else []
    if getattr(args, "emulation_slowdown", None):
        words.append(f"--emulation-slowdown {args.emulation_slowdown:g}")
    if getattr(args, "threads", None):
        words.append(f"--threads {args.threads}")
    return " ".join(words)


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not cpu, cuda or cuda:INDEX")
    return text


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1 (got {text})")
    return value
