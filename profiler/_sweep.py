"""The compute sweep: measure every point of a grid on one device and write each to the store.

The points of one op family (and dtype) are measured together, in interleaved rounds
(`TimingSpec.rounds`): each round visits every point once in a shuffled order and takes its
share of the samples, so a slow or fast spell of the machine spreads over all sizes instead
of tilting the few measured during it. A point's inputs are kept between rounds while the
family's kept inputs stay within a quarter of the free memory, and rebuilt otherwise.

Resumable: points whose identity the store already holds are skipped, and a family's rows
are committed when its rounds are done, so an interrupted sweep loses at most the family it
was timing. A point that runs out of memory or fails is written as `oom` / `error` with one
line, and the sweep goes on (Ctrl-C is not a failure: it stops the sweep).
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable
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
from ._rounds import samples_in_round, visiting_order
from ._timing import make_timer, summarize, timed_visit

_ERROR_LINE_CHARS = 300
CPU_MEMORY_FRACTION = 0.8  # of MemAvailable a point's tensors may take before it is refused
_KEEP_FRACTION = 0.25  # of the free memory a family's inputs kept between rounds may take


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
    visits = len(todo) * sweep.grid.timing.rounds
    with Progress(visits, "profile " + sweep.identity.device_type, enabled=show) as bar:
        for family in _families(todo):
            for measurement in measure_family(family, sweep, on_visit=bar.advance):
                store.add_profile_measurement(summary.run_id, measurement)
                summary.statuses[measurement.status] += 1
    return summary


def _families(points: list[Point]) -> list[list[Point]]:
    """The points grouped by (op, dtype), in first-seen order, each keeping its order."""
    families: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        families.setdefault((point.op, point.dtype), []).append(point)
    return list(families.values())


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


@dataclass
class _PointState:
    """What the visits of one point have gathered."""

    point: Point
    samples_s: list[float] = field(default_factory=list)
    visited: bool = False
    status: str = "ok"
    error: str = ""
    kernel: str | None = None

    def outcome(self) -> dict:
        if self.status != "ok":
            return {"status": self.status, "error": self.error}
        return {"status": "ok", **vars(summarize(self.samples_s))}


@dataclass
class _KeptCalls:
    """Points' calls (and so their inputs) kept between rounds, within `budget_bytes`."""

    budget_bytes: float
    calls: dict[int, list[Callable[[], object]]] = field(default_factory=dict)
    held_bytes: float = 0.0

    def offer(self, index: int, calls: list[Callable[[], object]], nbytes: float) -> None:
        if index not in self.calls and self.held_bytes + nbytes <= self.budget_bytes:
            self.calls[index], self.held_bytes = calls, self.held_bytes + nbytes


def measure_family(
    points: list[Point],
    sweep: ComputeSweep,
    on_visit: Callable[[str], None] = lambda note: None,
) -> list[ProfileMeasurement]:
    """Time `points` (one op family) in the grid's rounds; one measurement each, `oom` /
    `error` with one line for a point that failed."""
    timing = sweep.grid.timing
    states = [_PointState(point) for point in points]
    kept = _KeptCalls(_keep_budget_bytes(sweep.device))
    timer = make_timer(sweep.device, sweep.emulation_slowdown)
    for round_index in range(timing.rounds):
        count = samples_in_round(timing.samples, timing.rounds, round_index)
        for index in visiting_order(len(points), round_index):
            state = states[index]
            if state.status == "ok":
                _visit(state, index, kept, sweep, timer, count)
            on_visit(f"{state.point.op} {state.status}")
    kept.calls.clear()
    _release_memory(sweep.device)
    return [_measurement(state, sweep) for state in states]


def _visit(
    state: _PointState, index: int, kept: _KeptCalls, sweep: ComputeSweep, timer, count: int
) -> None:
    """One round's `count` samples of a point; a failure ends the point with one line."""
    timing = sweep.grid.timing
    try:
        calls = kept.calls.get(index) or _build(state, sweep)
        warmup_s = None if state.visited else timing.warmup_s
        state.samples_s += timed_visit(timer, calls, warmup_s=warmup_s, count=count,
                                       offset=len(state.samples_s))  # fmt: skip
        state.visited = True
        kept.offer(index, calls, _inputs_bytes(state.point, timing))
    except Exception as error:  # noqa: BLE001 - any failing size is recorded, the sweep goes on
        state.status, state.error = classify_failure(error)
        state.samples_s = []
    if index not in kept.calls:
        calls = None
        _release_memory(sweep.device)  # the inputs (and a failure's traceback) are gone now


def _build(state: _PointState, sweep: ComputeSweep) -> list[Callable[[], object]]:
    _check_cpu_memory(state.point, sweep.device, sweep.grid.timing)
    calls, state.kernel = build_calls(state.point, sweep.device, sweep.grid.timing.input_sets)
    return calls


def _inputs_bytes(point: Point, timing: TimingSpec) -> float:
    """About what a point's calls hold: every input set and the output."""
    return point.bytes_moved * (timing.input_sets + 1)


def _keep_budget_bytes(device: torch.device) -> float:
    """A quarter of the memory free now (CPU: MemAvailable; CUDA: the device's free bytes)."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return _KEEP_FRACTION * free_bytes
    available_bytes = available_memory_bytes()
    return _KEEP_FRACTION * available_bytes if available_bytes is not None else 0.0


def _measurement(state: _PointState, sweep: ComputeSweep) -> ProfileMeasurement:
    ident, timing, point = sweep.identity, sweep.grid.timing, state.point
    extra = {"threads": torch.get_num_threads(), "input_sets": timing.input_sets}
    extra |= {"warmup_s": timing.warmup_s, "rounds": timing.rounds, "grid": sweep.grid_name}
    extra |= sweep.identity.cache_bytes  # l2_bytes, llc_bytes: the fit's cache terms
    if state.kernel is not None:
        extra["kernel"] = state.kernel
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
        **(timings | state.outcome()),
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
    if available_bytes is not None and needed_bytes > CPU_MEMORY_FRACTION * available_bytes:
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
