"""Timing one call the way docs/design.md §5 asks: warm-up by time, then timed samples.

CPU: `time.perf_counter` around the call (CPU ops return when done). CUDA: events recorded
on the current stream around the call, read after `synchronize`, so launch overhead on the
host is not counted as kernel time but a queue of earlier work is excluded too.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_SLEEP_S = 1e-3
"""Below this, `time.sleep` overshoots by a large fraction (same value as the runtime)."""


@dataclass(frozen=True)
class TimingStats:
    median_s: float
    p10_s: float
    p90_s: float
    samples: int


def summarize(samples_s: list[float]) -> TimingStats:
    """Median, 10th and 90th percentiles (linear interpolation between order statistics)."""
    ordered = sorted(samples_s)
    return TimingStats(
        median_s=statistics.median(ordered),
        p10_s=_percentile(ordered, 0.10),
        p90_s=_percentile(ordered, 0.90),
        samples=len(ordered),
    )


def _percentile(ordered: list[float], fraction: float) -> float:
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pad_by_sleeping(duration_s: float) -> None:
    """Wait `duration_s`: `time.sleep` for long waits, a spin on `perf_counter` for short ones.

    The runtime carries sub-millisecond padding over to a later phase instead; one timed call
    has no later phase inside its sample, so it spins to keep the sample exact.
    """
    if duration_s <= 0:
        return
    deadline = time.perf_counter() + duration_s
    if duration_s >= MIN_SLEEP_S:
        time.sleep(duration_s)
    while time.perf_counter() < deadline:
        pass


class CpuTimer:
    """Wall time of a call on the CPU, padded to `slowdown` x when emulating a slower device:
    the call is followed by a sleep of (slowdown - 1) x its measured duration, inside the
    sample, as `hexiseq.runtime`'s emulation pads each compute phase."""

    def __init__(self, slowdown: float = 1.0) -> None:
        self.extra = slowdown - 1.0

    def run(self, call: Callable[[], object]) -> None:
        """Run untimed and unpadded (warm-up)."""
        call()

    def time_call(self, call: Callable[[], object]) -> float:
        start = time.perf_counter()
        call()
        if self.extra > 0:
            pad_by_sleeping(self.extra * (time.perf_counter() - start))
        return time.perf_counter() - start


class CudaTimer:
    """Kernel time of a call on the current CUDA stream, from events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def run(self, call: Callable[[], object]) -> None:
        """Run untimed (warm-up), waiting for the kernels to finish."""
        call()
        torch.cuda.synchronize(self.device)

    def time_call(self, call: Callable[[], object]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def make_timer(device: torch.device, slowdown: float = 1.0) -> CpuTimer | CudaTimer:
    if device.type == "cuda":
        return CudaTimer(device)
    return CpuTimer(slowdown)


def timed_visit(
    timer: CpuTimer | CudaTimer,
    calls: list[Callable[[], object]],
    *,
    warmup_s: float | None,
    count: int,
    offset: int = 0,
) -> list[float]:
    """One visit of a point: warm up for `warmup_s` (at least one call; None, on a later
    visit: one untimed call, since other points ran in between), then time `count` calls,
    rotating through `calls` (one per input set) from `offset` so consecutive calls read
    different tensors."""
    index = offset
    warmup_end = time.perf_counter() + (warmup_s or 0.0)
    while True:
        timer.run(calls[index % len(calls)])
        index += 1
        if time.perf_counter() >= warmup_end:
            break
    return [timer.time_call(calls[(index + i) % len(calls)]) for i in range(count)]
