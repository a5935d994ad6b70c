"""Count the bytes the runtime really allocates, by phase of the step (for the memory model).

`AllocationTracker` is a `TorchDispatchMode`: every tensor an operator returns whose storage it
has not seen is counted (its storage's bytes) until the storage is freed (a weak reference's
callback); storages resized in place (FSDP2 frees and refills its gathered parameters that
way) are re-counted, and a wrapper tensor (FSDP2's DTensor) is counted by its local shard.
Tensors made before the tracker started (the parameters) are registered with `track`. The
count is the exact sum of live storage bytes after every operator, on any device: on a GPU,
what `torch.cuda.max_memory_allocated` reports less the caching allocator's rounding.

The caller names the phase of the step (`phase("forward")` …); each phase records the bytes
live when it began and its peak, and every live storage is labelled with the phase that made
it (or the kind given to `track`), so what a phase left behind can be read by label.
`measure_step_allocations` runs the runtime's real step under it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from hexiseq.plan import Plan
from hexiseq.runtime import train as training
from hexiseq.runtime._emulation import ComputePadding
from hexiseq.runtime.model import token_positions


@dataclass
class PhasePeak:
    """One phase of the step: bytes live when it began and at its peak."""

    start_bytes: int
    peak_bytes: int

    @property
    def growth_bytes(self) -> int:
        """How far the phase rose above what was live when it began."""
        return self.peak_bytes - self.start_bytes


class AllocationTracker(TorchDispatchMode):
    """Live storage bytes of every tensor made inside it (and of those given to `track`)."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # storage key -> bytes
        self._labels: dict[int, str] = {}  # storage key -> the phase that made it, or a kind
        self._refs: dict[int, weakref.ref] = {}
        self._original_resize = None
        self.live_bytes = 0
        self.current_phase = "setup"
        self.phases: dict[str, PhasePeak] = {}

    def track(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Count `tensors` made outside the tracker (parameters, inputs) as `kind`."""
        for tensor in tensors:
            self._add(tensor.untyped_storage(), kind)

    def live_by_kind(self) -> dict[str, int]:
        """Bytes live now, by label."""
        totals: dict[str, int] = {}
        for key, size in self._sizes.items():
            totals[self._labels[key]] = totals.get(self._labels[key], 0) + size
        return totals

    @contextmanager
    def phase(self, name: str) -> Iterator[PhasePeak]:
        """Label what is allocated inside `name` and record the phase's peak (a phase met
        again, as with micro-batches, keeps its worst)."""
        previous, earlier = self.current_phase, self.phases.get(name)
        self.current_phase = name
        record = PhasePeak(self.live_bytes, self.live_bytes)
        self.phases[name] = record
        try:
            yield record
        finally:
            self.current_phase = previous
            if earlier is not None and earlier.peak_bytes >= record.peak_bytes:
                self.phases[name] = earlier

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=self.live_bytes)

    def _add(self, storage: torch.UntypedStorage, label: str) -> None:
        key = storage._cdata  # the StorageImpl: one per storage, however many views
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self._labels[key] = label
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._grow(self._sizes[key])

    def _add_tensor(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage; a wrapper (FSDP2's DTensor) owns none of its own, so its
        inner tensors (the local shard) are counted instead: an operator on a wrapper runs
        its inner operators while this mode is off, unseen."""
        if tensor.device.type == "meta":
            return
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._add_tensor(inner)
            return
        self._add(tensor.untyped_storage(), self.current_phase)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._labels.pop(key, None)
        self._refs.pop(key, None)

    def _grow(self, size: int) -> None:
        self.live_bytes += size
        record = self.phases.get(self.current_phase)
        if record is not None:
            record.peak_bytes = max(record.peak_bytes, self.live_bytes)

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        key = storage._cdata
        if key not in self._sizes:
            return
        change, self._sizes[key] = size - self._sizes[key], size
        if change > 0:
            self._grow(change)
        else:
            self.live_bytes += change

    def __enter__(self) -> AllocationTracker:
        original, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            tracker._resized(storage, size)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor):
                self._add_tensor(leaf)
        return outputs


@dataclass(frozen=True)
class StepAllocations:
    """What one rank allocated in a steady training step (the second), by phase, in bytes."""

    phases: dict[str, PhasePeak]
    peak_bytes: int
    retained_after_forward_bytes: int
    by_kind_after_forward: dict[str, int]


def measure_step_allocations(
    plan: Plan, rank: int, dtype: torch.dtype, sharded: bool
) -> StepAllocations:
    """Run `plan`'s real training step (`runtime.train.run_step`) twice on this rank of an
    initialized process group, on the CPU, and count the second step's allocations by phase.

    Model, sharding and optimizer are built as `runtime.train.train` builds them; the first
    step creates the AdamW states, the second is the steady one a run's peak comes from."""
    context = training.RankContext.cpu(rank, plan.cluster.world_size, dtype)
    model = training.build_plan_model(plan, context, 0, sharded)
    optimizer = training.build_optimizer(model, 1e-3, fused=sharded)
    mesh = context.mesh_of(plan)  # one mesh: the memory probe runs no replicas
    positions = token_positions(mesh.layout, mesh.local_rank)
    tracker = AllocationTracker()
    tracker.track(model.parameters(), "parameters")
    after_forward: dict[str, int] = {}

    def phase(name: str):
        if name == "optimizer" and dist.is_initialized():
            # gloo runs collectives on worker threads, whose temporaries (a copy of a unit's
            # gradients) go whenever the worker lets go: settle them before the optimizer
            # phase, so it counts the runtime's tensors, not gloo's timing.
            dist.barrier()
            time.sleep(0.05)
        if name == "loss":
            after_forward.clear()
            after_forward.update(tracker.live_by_kind())
        return tracker.phase(name)

    with tracker:
        for step in range(2):
            tracker.phases.clear()
            tokens = training.step_tokens(plan, 0, step)
            training.collect_garbage()
            with training.collector_paused():  # as `train` runs its steps
                training.run_step(
                    plan, context, model, optimizer, ComputePadding(model, 1.0), tokens,
                    positions, sharded, phase=phase,
                )  # fmt: skip
    return StepAllocations(
        phases=dict(tracker.phases),
        peak_bytes=tracker.peak_bytes,
        retained_after_forward_bytes=sum(after_forward.values()),
        by_kind_after_forward=after_forward,
    )
