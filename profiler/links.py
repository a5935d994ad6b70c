"""The link sweep, run by torchrun on every rank: `python -m hexiseq.profiler.links ...`.

`hexiseq profile links --nproc N` starts it (`hexiseq.cli.profile`); gloo on CPU, NCCL on
CUDA (rank i on cuda:LOCAL_RANK). Rank 0 reads which points the store already holds, tells
the others which to measure, and alone writes the rows, each in its own transaction: an
interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hexiseq.errors import HexiseqError
from hexiseq.profiles import ProfileMeasurement
from hexiseq.store import STORE_URL_HELP, Store, store_url_from

from ._device import DeviceIdentity, describe_device
from ._grid import Grid, load_grid
from ._link_ops import LinkOutcome, agree_on_status, measure_link_group
from ._points import Point, link_points
from ._progress import Progress

EXIT_BAD_INPUT = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hexiseq.profiler.links", description=__doc__)
    parser.add_argument("--grid", required=True, help="grid YAML file")
    parser.add_argument("--grid-name", default=None, help="name recorded for the grid")
    parser.add_argument(
        "--store",
        default=None,
        help=f"SQLAlchemy URL of the store {STORE_URL_HELP} (`hexiseq profile links` sets "
        "the environment, so no password shows in a command line)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--device-type", default=None, help="catalog GPU type (CUDA only)")
    parser.add_argument("--link-class", default=None, help="default intra:<device_type>")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--command", default="hexiseq profile links")
    parser.add_argument("--progress", action="store_true", help="progress bar on stderr")
    args = parser.parse_args(argv)
    args.store = store_url_from(args.store)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun; returns the exit code (2 for bad input, on every rank)."""
    args = parse_args(argv)
    device = _init_rank(args.device)
    try:
        return run_link_sweep(args, device)
    except HexiseqError as error:
        if not isinstance(error, _FailedElsewhereError):
            print(f"hexiseq profile links: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        dist.destroy_process_group()


def _init_rank(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo")
    return torch.device("cpu")


def run_link_sweep(args: argparse.Namespace, device: torch.device) -> int:
    """Measure the grid's link points not yet stored, one op at a time (its sizes in
    interleaved rounds); rank 0 writes each op's rows when its rounds are done."""
    grid = load_grid(args.grid)
    identity = describe_device(device, args.device_type)
    link_class = args.link_class or f"intra:{identity.device_type}"
    points = link_points(grid, dist.get_world_size())
    store = _open_store_on_rank_0(args.store, device)
    todo = _points_to_measure(store, points, identity, link_class, device)
    counts: Counter[str] = Counter()
    run_id = _save_run(store, args, grid, identity) if store and todo else None
    show = args.progress and dist.get_rank() == 0
    rounds = grid.links.timing(grid.timing).rounds
    with Progress(len(todo) * rounds, f"links {link_class}", enabled=show) as bar:
        for group in _by_op(todo):
            outcomes = measure_link_group(group, grid, device, on_visit=_advancer(bar))
            for point, outcome in zip(group, outcomes):
                measurement = _measurement(point, identity, link_class, outcome, grid)
                counts[measurement.status] += 1
                if store is not None:
                    store.add_profile_measurement(run_id, measurement)
    if store is not None:
        print(_describe(counts, len(points) - len(todo), link_class, store.url), flush=True)
        store.close()
    return 0


def _by_op(points: list[Point]) -> list[list[Point]]:
    """The points grouped by op (first-seen order), each group by ascending message size."""
    groups: dict[str, list[Point]] = {}
    for point in points:
        groups.setdefault(point.op, []).append(point)
    return [sorted(group, key=_message_bytes) for group in groups.values()]


def _message_bytes(point: Point) -> int:
    return int(point.params["message_bytes"])


def _advancer(bar: Progress):
    return lambda point: bar.advance(f"{point.op} {_message_bytes(point)} B")


def _open_store_on_rank_0(url: str, device: torch.device) -> Store | None:
    """Rank 0 opens the store; if it cannot, every rank raises (none waits for the others)."""
    store, failure = None, None
    if dist.get_rank() == 0:
        try:
            store = Store.open(url)
        except HexiseqError as error:
            failure = error
    status = "error" if failure is not None else "ok"
    if agree_on_status(status, device) != "ok":
        raise failure or _FailedElsewhereError()
    return store


class _FailedElsewhereError(HexiseqError):
    """Another rank failed and said why; this one exits with the same code, silently."""


def _points_to_measure(
    store: Store | None,
    points: list[Point],
    identity: DeviceIdentity,
    link_class: str,
    device: torch.device,
) -> list[Point]:
    """Rank 0 marks the points the store lacks; every rank gets the same list."""
    wanted = torch.ones(len(points), dtype=torch.int64, device=device)
    if store is not None:
        stored = store.profiled_keys(device_type=identity.device_type, link_class=link_class)
        for index, point in enumerate(points):
            wanted[index] = int(point.key(identity.device_type, link_class) not in stored)
    dist.broadcast(wanted, src=0)
    return [point for point, flag in zip(points, wanted.tolist()) if flag]


def _measurement(
    point: Point, identity: DeviceIdentity, link_class: str, outcome: LinkOutcome, grid: Grid
) -> ProfileMeasurement:
    stats = outcome.stats()
    timings = vars(stats) if stats is not None else {}
    return ProfileMeasurement(
        device_type=identity.device_type,
        op=point.op,
        params=dict(point.params),
        dtype=point.dtype,
        flops=0.0,
        bytes_moved=point.bytes_moved,
        status=outcome.status,
        median_s=timings.get("median_s"),
        p10_s=timings.get("p10_s"),
        p90_s=timings.get("p90_s"),
        samples=timings.get("samples", 0),
        device_name=identity.device_name,
        torch_version=identity.torch_version,
        cuda_version=identity.cuda_version,
        clocks=identity.clocks,
        link_class=link_class,
        error=outcome.error or None,
        host=identity.host,
        extra={
            "backend": dist.get_backend(),
            "world": dist.get_world_size(),
            "rounds": grid.links.timing(grid.timing).rounds,
        },
    )


def _save_run(store: Store, args: argparse.Namespace, grid: Grid, identity) -> int:
    return store.save_profile_run(
        kind="links",
        device_type=identity.device_type,
        device_name=identity.device_name,
        torch_version=identity.torch_version,
        cuda_version=identity.cuda_version,
        host=identity.host,
        command=args.command,
        grid_name=args.grid_name or grid.name,
        quick=args.quick,
    )


def _describe(counts: Counter[str], already: int, link_class: str, url: str) -> str:
    done = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "nothing new"
    return (
        f"links {link_class}: {sum(counts.values())} points measured ({done}); "
        f"{already} already in the store; written to {url}"
    )


if __name__ == "__main__":
    sys.exit(main())
