"""Timing one link point on every rank of the default process group (torch.distributed).

A sample is one op on all ranks at once, started together after a barrier; its time is the
slowest rank's (an all-reduce MAX of the elapsed times), since a collective or a ring
exchange is only done when every rank is. Ranks agree on failures the same way: if any rank
runs out of memory or the backend refuses the op (gloo lacks some collectives in some
versions), every rank records the same status and moves on instead of waiting forever in a
collective the others skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ._grid import TimingSpec
from ._points import DTYPE_BYTES, Point
from ._timing import TimingStats, make_timer, summarize

_STATUS_CODES = {"ok": 0, "oom": 1, "error": 2}
_MAX_WARMUP_CALLS = 100
_MAX_ROTATED_BYTES = 256 * 1024**2  # input sets are rotated only while they stay this small
_SEED = 4321

# Newer torch names the tensor collectives *_single; the old names warn but still work.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def build_link_calls(
    point: Point, device: torch.device, input_sets: int
) -> list[Callable[[], object]]:
    """One zero-argument call per input set running `point`'s op on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, point.dtype)
    numel = int(point.params["message_bytes"]) // DTYPE_BYTES[point.dtype]
    send_numel = numel * (1 if point.op in ("p2p", "all_gather") else world)
    send_bytes = send_numel * DTYPE_BYTES[point.dtype]
    sets = max(1, min(input_sets, _MAX_ROTATED_BYTES // send_bytes))
    generator = torch.Generator(device=device).manual_seed(_SEED + rank)
    sends = [
        torch.randn(send_numel, dtype=dtype, device=device, generator=generator)
        for _ in range(sets)
    ]
    receive_numel = numel * (world if point.op in ("all_to_all", "all_gather") else 1)
    out = torch.empty(receive_numel, dtype=dtype, device=device)
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


def measure_link(
    calls: list[Callable[[], object]], device: torch.device, timing: TimingSpec
) -> TimingStats:
    """Warm up for about `timing.warmup_s` (the same number of calls on every rank, from the
    slowest rank's first call), then time `timing.samples` calls, each the slowest rank's."""
    timer = make_timer(device)
    first_s = slowest(timer.time_call(calls[0]), device)
    warmup_calls = min(_MAX_WARMUP_CALLS, math.ceil(timing.warmup_s / max(first_s, 1e-9)))
    for index in range(warmup_calls):
        timer.run(calls[(index + 1) % len(calls)])
    samples_s = []
    for index in range(timing.samples):
        dist.barrier()
        elapsed_s = timer.time_call(calls[index % len(calls)])
        samples_s.append(slowest(elapsed_s, device))
    return summarize(samples_s)
