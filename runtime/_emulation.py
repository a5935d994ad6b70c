"""Emulated heterogeneity: a rank made k times slower by sleeping after its compute.

A CPU test cluster gives a device `emulation_slowdown` k (docs/design.md §2, cluster YAML). The
rank then sleeps (k - 1) x the measured duration of each compute phase, right after it, instead of
computing more: ranks that share a machine's cores do not compete for them, and the waiting peers
see exactly the delay a slower device would cause. A compute phase is the forward or the backward
of one parametrized leaf module (linear projections, norms, LM head), and each ring step's
attention kernels inside `CPHPAttention` (`compute_phase`, around the block compute only: the hop
posted before it keeps travelling while the rank sleeps, as it would while a slower device
computes). Elementwise work in between (RoPE, SiLU, residuals) is not padded. Sleeps shorter than
`MIN_SLEEP_S` are carried over, since `time.sleep` overshoots tiny requests; `flush()` pays what is
left."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

MIN_SLEEP_S = 1e-3

_active: ComputePadding | None = None
"""The padding of this process's model, which `compute_phase` adds to (one model per rank)."""


@contextmanager
def compute_phase() -> Iterator[None]:
    """Time the block inside as compute of the active padding (if any) and pad it."""
    padding = _active
    if padding is None:
        yield
        return
    padding._start()
    try:
        yield
    finally:
        padding._end()


@contextmanager
def communication_phase() -> Iterator[None]:
    """Time inside is not compute, even inside a compute phase: a collective a layer waits on
    (the sharded states' all-gather that a layer's backward triggers, `sharding`) is what a
    slower device would wait for too, not compute to pad."""
    padding = _active
    if padding is None or padding._open == 0:
        yield
        return
    began, began_cpu = time.perf_counter(), time.thread_time()
    began_gpu = padding._gpu.start() if padding._gpu is not None else None
    try:
        yield
    finally:
        padding._opened_at += time.perf_counter() - began
        padding._opened_cpu += time.thread_time() - began_cpu
        if began_gpu is not None:
            padding._gpu.stop(began_gpu, sign=-1)  # the stream waited on it: not compute


class ComputePadding:
    """Forward and backward hooks that pad every phase of `model` by (slowdown - 1) x, and
    time the phases (`device_s`) when `timed` or padding."""

    def __init__(
        self, model: nn.Module, slowdown: float, timed: bool = False, gpu: GpuPhases | None = None
    ) -> None:
        _check_slowdown(slowdown)
        self.extra = slowdown - 1.0
        self.debt_s = 0.0
        self.padded_s = 0.0  # total slept, for reporting
        self.device_s = 0.0
        """The emulated device's compute so far: each phase's CPU time on this rank's thread
        (`time.thread_time`: not the time the OS gave the cores to other ranks), times the
        slowdown in force then. What a GPU's kernel timer would read on the slower device;
        the drift monitor (`_drift`) compares it with the plan's prediction. On a GPU
        (`gpu` given): the phases' time on the GPU's stream, added by `settle`."""
        self._gpu = gpu
        self._gpu_opened = None
        self._open = 0
        self._opened_at = 0.0
        self._opened_cpu = 0.0
        self._handles = []
        self._model = model
        if self.extra > 0 or timed:
            self._install()

    def set_slowdown(self, slowdown: float) -> None:
        """Pad by (slowdown - 1) x from now on (an injected slowdown, `train`)."""
        _check_slowdown(slowdown)
        self.extra = slowdown - 1.0
        if self.extra > 0 and not self._handles:
            self._install()

    def _install(self) -> None:
        for module in self._model.modules():
            if _is_padded(module):
                self._hook(module)
        global _active
        _active = self

    def _hook(self, module: nn.Module) -> None:
        self._handles += [
            module.register_forward_pre_hook(self._start),
            module.register_forward_hook(self._end),
            module.register_full_backward_pre_hook(self._start),
            module.register_full_backward_hook(self._end),
        ]

    def _start(self, *_args) -> None:
        """Phases may overlap (the backward of q/k/v projections sharing one input): time the
        union of open phases, and sleep only when none is open, so no sleep is timed."""
        if self._open == 0:
            self._opened_at = time.perf_counter()
            self._opened_cpu = time.thread_time()
            if self._gpu is not None:
                self._gpu_opened = self._gpu.start()
        self._open += 1

    def _end(self, *_args) -> None:
        self._open -= 1
        if self._open == 0:
            phase_s = time.perf_counter() - self._opened_at
            if self._gpu is not None:
                self._gpu.stop(self._gpu_opened)
            else:
                self.device_s += (1 + self.extra) * (time.thread_time() - self._opened_cpu)
            self.debt_s += self.extra * phase_s
            if self.debt_s >= MIN_SLEEP_S:
                self.flush()

    def settle(self) -> None:
        """Add the GPU time of the phases timed so far to `device_s` (call after the step's
        work has finished: `torch.cuda.synchronize`); nothing to do on a CPU."""
        if self._gpu is not None:
            self.device_s += self._gpu.settle_s()

    def flush(self) -> None:
        """Sleep off the padding still owed."""
        if self.debt_s <= 0:
            return
        began = time.perf_counter()
        time.sleep(self.debt_s)
        slept = time.perf_counter() - began
        self.padded_s += slept
        self.debt_s -= slept

    def remove(self) -> None:
        global _active
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if _active is self:
            _active = None


class GpuPhases:
    """Compute phases timed on a GPU: a CUDA event pair on the current stream per phase (the
    union of open phases, as on the CPU), minus a pair around each collective the stream
    waited on inside one (`communication_phase`). Recording costs no synchronization; the
    times are read once the step has finished (`settle_s`). `event` makes an event (tests
    give a stand-in)."""

    def __init__(self, event: Callable[[], object] | None = None) -> None:
        self._event = event or _cuda_event
        self._pairs: list[tuple[object, object, int]] = []

    def start(self) -> object:
        began = self._event()
        began.record()
        return began

    def stop(self, began: object, sign: int = 1) -> None:
        ended = self._event()
        ended.record()
        self._pairs.append((began, ended, sign))

    def settle_s(self) -> float:
        """Seconds of compute recorded since the last call (the events must have happened)."""
        total_ms = sum(sign * began.elapsed_time(ended) for began, ended, sign in self._pairs)
        self._pairs.clear()
        return max(total_ms, 0.0) / 1e3


def _cuda_event() -> object:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _check_slowdown(slowdown: float) -> None:
    if not slowdown >= 1.0:
        raise ValueError(f"emulation slowdown must be >= 1 (got {slowdown})")


def _is_padded(module: nn.Module) -> bool:
    """Leaf modules with weights (linears, RMSNorm); not the embedding lookup. Under sharded
    states (`sharding`) a module's weight is no parameter of its own but a view bound for
    each forward: a `weight` attribute all the same."""
    if isinstance(module, nn.Embedding):
        return False
    has_children = any(True for _ in module.children())
    owns = any(True for _ in module.parameters(recurse=False)) or hasattr(module, "weight")
    return not has_children and owns
