"""Timing link points on every rank of the default process group (torch.distributed).

A sample is one op on all ranks at once, started together after a barrier; its time is the
slowest rank's (an all-reduce MAX of the elapsed times), since a collective or a ring
exchange is only done when every rank is.

The points of one op are measured together (`measure_link_group`): their samples are taken
in rounds, each round visiting every point once in a shuffled order (the same on every
rank), so a slow or fast spell of a shared host lands on all sizes alike instead of biasing
the few measured during it. All points of the group share one pair of buffers, sized for
the largest: views of it are the messages, and the rotated input sets are disjoint slices.

Ranks agree on failures: if any rank runs out of memory or the backend refuses the op
(gloo lacks some collectives in some versions), every rank records the same status for that
point and moves on instead of waiting forever in a collective the others skipped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._grid import Grid
from ._points import DTYPE_BYTES, Point
from ._rounds import samples_in_round, visiting_order
from ._sweep import CPU_MEMORY_FRACTION, available_memory_bytes, classify_failure
from ._timing import CpuTimer, CudaTimer, TimingStats, make_timer, summarize

_STATUS_CODES = {"ok": 0, "oom": 1, "error": 2}
_MAX_WARMUP_CALLS = 100
_MAX_ROTATED_BYTES = 256 * 1024**2  # input sets are rotated only while they stay this small
_SEED = 4321

# Newer torch names the tensor collectives *_single; the old names warn but still work.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class LinkOutcome:
    """What one point got: its status, one error line, and its samples (slowest rank's)."""

    status: str = "ok"
    error: str = ""
    samples_s: list[float] = field(default_factory=list)

    def stats(self) -> TimingStats | None:
        return summarize(self.samples_s) if self.status == "ok" and self.samples_s else None


@dataclass(frozen=True)
class _Shape:
    send_numel: int
    receive_numel: int
    input_sets: int


@dataclass(frozen=True)
class LinkBuffers:
    """One send and one receive buffer, large enough for every point of a group."""

    send: torch.Tensor
    receive: torch.Tensor


def _shape(point: Point, world: int, input_sets: int) -> _Shape:
    """Elements one rank sends and receives per call, and how many input sets rotate."""
    numel = int(point.params["message_bytes"]) // DTYPE_BYTES[point.dtype]
    send_numel = numel * (1 if point.op in ("p2p", "all_gather") else world)
    receive_numel = numel * (world if point.op in ("all_to_all", "all_gather") else 1)
    send_bytes = send_numel * DTYPE_BYTES[point.dtype]
    sets = max(1, min(input_sets, _MAX_ROTATED_BYTES // send_bytes))
    return _Shape(send_numel, receive_numel, sets)


def _buffer_numels(points: Sequence[Point], world: int, input_sets: int) -> tuple[int, int]:
    shapes = [_shape(point, world, input_sets) for point in points]
    send = max(shape.send_numel * shape.input_sets for shape in shapes)
    return send, max(shape.receive_numel for shape in shapes)


def allocate_buffers(
    points: Sequence[Point], device: torch.device, input_sets: int
) -> LinkBuffers:
    """Random buffers for `points` (one dtype), seeded per rank."""
    send_numel, receive_numel = _buffer_numels(points, dist.get_world_size(), input_sets)
    dtype = getattr(torch, points[0].dtype)
    generator = torch.Generator(device=device).manual_seed(_SEED + dist.get_rank())
    send = torch.randn(send_numel, dtype=dtype, device=device, generator=generator)
    return LinkBuffers(send, torch.empty(receive_numel, dtype=dtype, device=device))


def build_link_calls(
    point: Point, buffers: LinkBuffers, input_sets: int
) -> list[Callable[[], object]]:
    """One zero-argument call per input set running `point`'s op on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = _shape(point, world, input_sets)
    out = buffers.receive[: shape.receive_numel]
    sends = [
        buffers.send[index * shape.send_numel : (index + 1) * shape.send_numel]
        for index in range(shape.input_sets)
    ]
    op = _link_op(point, rank, world)
    return [lambda send=send: op(send, out) for send in sends]


def _link_op(point: Point, rank: int, world: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if point.op == "p2p":
        step = 1 if point.params["direction"] == "next" else -1
        to_rank, from_rank = (rank + step) % world, (rank - step) % world
        return lambda send, out: _ring_exchange(send, out, to_rank, from_rank)
    if point.op == "all_to_all":
        return lambda send, out: dist.all_to_all_single(out, send)
    if point.op == "all_gather":
        return lambda send, out: _all_gather(out, send)
    return lambda send, out: _reduce_scatter(out, send)


def _ring_exchange(send: torch.Tensor, out: torch.Tensor, to_rank: int, from_rank: int) -> None:
    """Every rank sends to `to_rank` and receives from `from_rank` at once (all ring pairs)."""
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to_rank), dist.P2POp(dist.irecv, out, from_rank)]
    )
    for work in works:
        work.wait()


def agree_on_status(status: str, device: torch.device) -> str:
    """The worst status over all ranks (error > oom > ok)."""
    code = torch.tensor([_STATUS_CODES[status]], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    return {v: k for k, v in _STATUS_CODES.items()}[int(code.item())]


def slowest(value_s: float, device: torch.device) -> float:
    """The largest `value_s` over all ranks."""
    value = torch.tensor([value_s], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _fewest(count: int, device: torch.device) -> int:
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def first_error_line(own_line: str) -> str:
    """This rank's error line if it has one, else the first other rank's, named."""
    lines: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(lines, own_line)
    if own_line:
        return own_line
    rank, line = next(((r, text) for r, text in enumerate(lines) if text), (None, ""))
    return f"rank {rank}: {line}" if line else "failed on another rank"


def measure_link_group(
    points: Sequence[Point],
    grid: Grid,
    device: torch.device,
    on_visit: Callable[[Point], None] = lambda point: None,
) -> list[LinkOutcome]:
    """Time `points` (one op, one dtype, ascending size) in the grid's rounds; one outcome
    each. Points whose buffers do not fit are recorded as `oom` and not attempted."""
    timing = grid.links.timing(grid.timing)
    outcomes = [LinkOutcome() for _ in points]
    buffers, kept = _buffers_for_most(points, device, grid.timing.input_sets, outcomes)
    group = _GroupRun(buffers, grid.timing.input_sets, make_timer(device), device)
    for round_index in range(timing.rounds):
        count = samples_in_round(timing.samples, timing.rounds, round_index)
        for index in visiting_order(len(points), round_index):
            if index < kept and outcomes[index].status == "ok":
                group.visit(index, points[index], outcomes[index], timing.warmup_s, count)
            on_visit(points[index])
    return outcomes


def _buffers_for_most(
    points: Sequence[Point], device: torch.device, input_sets: int, outcomes: list[LinkOutcome]
) -> tuple[LinkBuffers | None, int]:
    """Buffers for the most points (smallest first) that fit on every rank, and how many."""
    kept = _fewest(_fitting_count(points, device, input_sets), device)
    while kept > 0:
        buffers, status, line = None, "ok", ""
        try:
            buffers = allocate_buffers(points[:kept], device, input_sets)
        except Exception as error:  # noqa: BLE001 - an OOM on any rank drops the largest
            status, line = classify_failure(error)
        if agree_on_status(status, device) == "ok":
            break
        kept -= 1
        outcomes[kept] = LinkOutcome("oom", first_error_line(line))
    for index in range(kept, len(points)):
        if outcomes[index].status == "ok":
            outcomes[index] = LinkOutcome("oom", _not_attempted(points[index], input_sets))
    return (buffers if kept else None), kept


def _fitting_count(points: Sequence[Point], device: torch.device, input_sets: int) -> int:
    """How many of `points` (smallest first) the ranks on this host can hold together
    (CPU: Linux overcommits, so a too-large allocation may kill instead of raising)."""
    available_bytes = available_memory_bytes() if device.type == "cpu" else None
    if available_bytes is None:
        return len(points)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    for count in range(len(points), 0, -1):
        if _host_bytes(points[:count], local_ranks, input_sets) <= (
            CPU_MEMORY_FRACTION * available_bytes
        ):
            return count
    return 0


def _host_bytes(points: Sequence[Point], local_ranks: int, input_sets: int) -> int:
    send, receive = _buffer_numels(points, dist.get_world_size(), input_sets)
    return local_ranks * (send + receive) * DTYPE_BYTES[points[0].dtype]


def _not_attempted(point: Point, input_sets: int) -> str:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    needed_gib = _host_bytes([point], local_ranks, input_sets) / 1024**3
    return f"MemoryError: needs about {needed_gib:.1f} GiB of buffers on this host; not attempted"


@dataclass
class _GroupRun:
    """The state shared by the visits of one group: buffers, timer and each point's calls."""

    buffers: LinkBuffers | None
    input_sets: int
    timer: CpuTimer | CudaTimer
    device: torch.device
    calls: dict[int, list[Callable[[], object]]] = field(default_factory=dict)

    def visit(
        self, index: int, point: Point, outcome: LinkOutcome, warmup_s: float, count: int
    ) -> None:
        """One round's `count` samples of one point: the first visit builds its calls and
        warms up for `warmup_s`, a later one runs a call untimed (other sizes ran between)."""
        first, line, samples_s = index not in self.calls, "", []
        try:
            if first:
                self.calls[index] = build_link_calls(point, self.buffers, self.input_sets)
            status = "ok"
        except Exception as error:  # noqa: BLE001 - recorded; every rank learns of it below
            status, line = classify_failure(error)
        status = agree_on_status(status, self.device)
        if status == "ok":
            try:
                samples_s = _timed_samples(self.calls[index], self.timer, self.device,
                                           warmup_s if first else None, count,
                                           offset=len(outcome.samples_s))  # fmt: skip
            except Exception as error:  # noqa: BLE001 - e.g. the backend lacks the op
                status, line = classify_failure(error)
            status = agree_on_status(status, self.device)
        if status == "ok":
            outcome.samples_s += samples_s
        else:
            outcome.status, outcome.error = status, first_error_line(line)
            outcome.samples_s = []


def _timed_samples(
    calls: list[Callable[[], object]],
    timer: CpuTimer | CudaTimer,
    device: torch.device,
    warmup_s: float | None,
    count: int,
    offset: int,
) -> list[float]:
    """Warm up (for about `warmup_s`, the same number of calls on every rank, from the
    slowest rank's first call; None: one call), then time `count` calls."""
    if warmup_s is None:
        timer.run(calls[offset % len(calls)])
    else:
        first_s = slowest(timer.time_call(calls[0]), device)
        warmup_calls = min(_MAX_WARMUP_CALLS, math.ceil(warmup_s / max(first_s, 1e-9)))
        for index in range(warmup_calls):
            timer.run(calls[(index + 1) % len(calls)])
    samples_s = []
    for index in range(count):
        dist.barrier()
        elapsed_s = timer.time_call(calls[(offset + index) % len(calls)])
        samples_s.append(slowest(elapsed_s, device))
    return samples_s
