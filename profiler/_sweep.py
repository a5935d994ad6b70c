"""The compute sweep: measure every point of a grid on one device and write each to the store.

Resumable: points whose identity the store already holds are skipped, and every point is
committed on its own, so an interrupted sweep loses at most the point it was timing. A point
that runs out of memory or fails is written as `oom` / `error` with one line, and the sweep
goes on (Ctrl-C is not a failure: it stops the sweep).
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hexiseq.profiles import ProfileMeasurement
from hexiseq.store import Store

from ._compute_ops import build_calls
from ._device import DeviceIdentity
from ._grid import Grid, TimingSpec
from ._points import Point, compute_points
from ._progress import Progress
from ._timing import TimingStats, make_timer, measure

_ERROR_LINE_CHARS = 300
_CPU_MEMORY_FRACTION = 0.8  # of MemAvailable a point's tensors may take before it is refused


@dataclass(frozen=True)
class ComputeSweep:
    """What to sweep, where, and how it is labelled in the store."""

    grid: Grid
    grid_name: str
    device: torch.device
    identity: DeviceIdentity
    quick: bool = False
    emulation_slowdown: float = 1.0
    command: str = "hexiseq profile"


@dataclass
class SweepSummary:
    """Counts of a finished (or stopped) sweep."""

    run_id: int | None = None
    statuses: Counter[str] = field(default_factory=Counter)
    already_stored: int = 0
    over_limit: int = 0

    def describe(self) -> str:
        done = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items())) or "nothing new"
        return (
            f"{sum(self.statuses.values())} points measured ({done}); {self.already_stored} "
            f"already in the store; {self.over_limit} above the grid's max_gflop_per_call"
        )


def run_compute_sweep(
    store: Store,
    sweep: ComputeSweep,
    *,
    max_points: int | None = None,
    show_progress: bool | None = None,
) -> SweepSummary:
    """Measure the grid's compute points not yet in `store`; at most `max_points` of them.

    `show_progress` None: a progress bar when stderr is a terminal.
    """
    device_kind = sweep.device.type
    points, over_limit = compute_points(sweep.grid, device_kind)  # type: ignore[arg-type]
    stored = store.profiled_keys(device_type=sweep.identity.device_type)
    todo = [p for p in points if _key(p, sweep) not in stored]
    summary = SweepSummary(already_stored=len(points) - len(todo), over_limit=over_limit)
    todo = todo[:max_points] if max_points is not None else todo
    if not todo:
        return summary
    summary.run_id = _save_run(store, sweep)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    with Progress(len(todo), "profile " + sweep.identity.device_type, enabled=show) as bar:
        for point in todo:
            measurement = measure_point(point, sweep)
            store.add_profile_measurement(summary.run_id, measurement)
            summary.statuses[measurement.status] += 1
            bar.advance(f"{point.op} {measurement.status}")
    return summary


def _key(point: Point, sweep: ComputeSweep):
    return point.key(sweep.identity.device_type, None, sweep.emulation_slowdown)


def _save_run(store: Store, sweep: ComputeSweep) -> int:
    ident = sweep.identity
    return store.save_profile_run(
        kind="compute",
        device_type=ident.device_type,
        device_name=ident.device_name,
        torch_version=ident.torch_version,
        cuda_version=ident.cuda_version,
        host=ident.host,
        command=sweep.command,
        grid_name=sweep.grid_name,
        quick=sweep.quick,
    )


def measure_point(point: Point, sweep: ComputeSweep) -> ProfileMeasurement:
    """Time one point; an out-of-memory or failing point comes back as `oom` / `error`."""
    timing = sweep.grid.timing
    extra = {"threads": torch.get_num_threads(), "input_sets": timing.input_sets}
    extra |= {"warmup_s": timing.warmup_s, "grid": sweep.grid_name}
    extra |= sweep.identity.cache_bytes  # l2_bytes, llc_bytes: the fit's cache terms
    try:
        stats = _time_point(point, sweep, extra)
    except Exception as error:  # noqa: BLE001 - any failing size is recorded, the sweep goes on
        status, line = classify_failure(error)
        outcome = {"status": status, "error": line}
    else:
        outcome = {"status": "ok", **vars(stats)}
    _release_memory(sweep.device)  # the inputs (and a failure's traceback) are gone by now
    return _measurement(point, sweep, extra, **outcome)


def _time_point(point: Point, sweep: ComputeSweep, extra: dict) -> TimingStats:
    timing = sweep.grid.timing
    _check_cpu_memory(point, sweep.device, timing)
    calls, extra["kernel"] = build_calls(point, sweep.device, timing.input_sets)
    timer = make_timer(sweep.device, sweep.emulation_slowdown)
    return measure(timer, calls, warmup_s=timing.warmup_s, samples=timing.samples)


def _measurement(point: Point, sweep: ComputeSweep, extra, **outcome) -> ProfileMeasurement:
    ident = sweep.identity
    timings = {"median_s": None, "p10_s": None, "p90_s": None, "samples": 0}
    return ProfileMeasurement(
        device_type=ident.device_type,
        op=point.op,
        params=dict(point.params),
        dtype=point.dtype,
        flops=point.flops,
        bytes_moved=point.bytes_moved,
        device_name=ident.device_name,
        torch_version=ident.torch_version,
        cuda_version=ident.cuda_version,
        clocks=ident.clocks,
        emulation_slowdown=sweep.emulation_slowdown,
        host=ident.host,
        extra=extra,
        **(timings | outcome),
    )


def classify_failure(error: BaseException) -> tuple[str, str]:
    """(`oom` or `error`, one line naming the exception) for a failed point."""
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    line = f"{type(error).__name__}: {first_line}"[:_ERROR_LINE_CHARS]
    out_of_memory = isinstance(error, (torch.OutOfMemoryError, MemoryError)) or any(
        phrase in text.lower() for phrase in ("out of memory", "can't allocate memory")
    )
    return ("oom" if out_of_memory else "error"), line


def _check_cpu_memory(point: Point, device: torch.device, timing: TimingSpec) -> None:
    """Refuse a CPU point whose tensors would not fit in the memory available now: Linux
    overcommits, so a too-large allocation may get the process killed instead of raising."""
    if device.type != "cpu":
        return
    needed_bytes = point.bytes_moved * (timing.input_sets + 1)
    available_bytes = available_memory_bytes()
    if available_bytes is not None and needed_bytes > _CPU_MEMORY_FRACTION * available_bytes:
        raise MemoryError(
            f"needs about {needed_bytes / 1024**3:.1f} GiB of tensors, "
            f"{available_bytes / 1024**3:.1f} GiB available; not attempted"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        lines = Path("/proc/meminfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
