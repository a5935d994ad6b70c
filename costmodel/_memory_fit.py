"""Calibrating the memory model against measured peaks (`hexiseq run` records each rank's).

A point is one rank of one runtime run: the memory model's peak for that rank without its
reserve (`dynamic`: states, buffers, checkpoints and the working set), and the peak the runtime
measured (the largest over the run's steps). The modelled peak is recomputed from the plan's
cluster, model, training spec, layout and the state shares the run held (the plan's, for runs
of the sharded runtime; even for the FSDP2 runs before it), uncalibrated, not read from the
plan's prediction: a plan made with a calibrated model carries calibrated peaks, which must not
be calibrated again. Per (device type, memory measure):

    measured ≈ reserve + scale x dynamic,   reserve, scale >= 0,

fitted for relative error like the op times (`fit_relative_nnls`), with the same held-out
extrapolation: fit on the two thirds of smallest modelled peaks, predict the largest third.
The measure is what the runtime could read: `cuda_max_allocated` on a GPU (the caching
allocator's peak), `cpu_max_rss` on a CPU (the process's resident peak, the interpreter and
libraries included, which the fitted reserve absorbs). Runs of emulated devices count: the
emulation pads time, not memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hexiseq.costmodel._fit_document import HeldOut, MemoryFit, Skipped
from hexiseq.costmodel._regression import extrapolation_split, fit_relative_nnls, relative_errors
from hexiseq.costmodel.memory import estimate_memory

MIN_MEMORY_POINTS = 4
"""Fewest distinct modelled sizes a calibration needs: 2 coefficients, and a held-out split."""


@dataclass(frozen=True)
class RuntimeSource:
    """One runtime run: its id, the plan JSON it ran, and each rank's (measure, peak bytes)."""

    run_id: int
    plan_json: str
    peaks: Sequence[tuple[int, str, int]]
    """(rank, memory measure, peak bytes over the run's steps)."""


@dataclass(frozen=True)
class MemoryPoint:
    device_type: str
    memory_measure: str
    dynamic_bytes: float
    """The memory model's allocated peak (no context reserve, no fragmentation)."""
    measured_bytes: float
    run_id: int
    modelled_reserve_bytes: float = 0.0
    """The part of the model's own reserve the measure counts (replaced by the fitted one
    once calibrated)."""

    @property
    def modelled_bytes(self) -> float:
        """The uncalibrated memory model's peak as the measure counts it."""
        return self.dynamic_bytes + self.modelled_reserve_bytes


def _run_state_fractions(plan, source: RuntimeSource) -> list[float] | None:
    """The model-state shares a run held: the plan's own where the run recorded the sharded
    recipe (the runtime has sharded in the plan's fractions since it records its recipe);
    None (even) for runs from before, whose FSDP2 split the states evenly."""
    import json

    recorded = json.loads(source.plan_json).get("train", {}).get("runtime_recipe")
    if recorded != "sharded":
        return None
    return [assignment.state_fraction for assignment in plan.assignments]


def _modelled_memory(plan, source: RuntimeSource) -> list:
    """The memory model of every rank of a run's plan: each replica's ranks by their
    replica's own mesh (a plan of several data-parallel replicas)."""
    if not plan.data_parallel:
        fractions = _run_state_fractions(plan, source)
        return list(
            estimate_memory(plan.cluster, plan.model, plan.train, plan.layout(), fractions)
        )
    modelled = [None] * plan.cluster.world_size
    for index, replica in enumerate(plan.replicas):
        for rank, memory in zip(replica.ranks, _modelled_memory(plan.replica_plan(index), source)):
            modelled[rank] = memory
    return modelled


def memory_points(sources: Sequence[RuntimeSource]) -> list[MemoryPoint]:
    """One point per measured rank of every run whose plan this version can read."""
    from hexiseq.errors import HexiseqError
    from hexiseq.plan import Plan

    points = []
    for source in sources:
        try:
            plan = Plan.from_run_json_text(source.plan_json, f"runtime run {source.run_id}")
        except HexiseqError:
            continue  # a plan this version cannot read: its run calibrates nothing
        modelled = _modelled_memory(plan, source)
        for rank, measure, peak_bytes in source.peaks:
            if rank >= len(modelled) or peak_bytes <= 0:
                continue
            memory = modelled[rank]
            points.append(MemoryPoint(
                device_type=plan.cluster.devices[rank].gpu, memory_measure=measure,
                # What `cuda_max_allocated` counts; on CPU the RSS's interpreter and
                # libraries are what the fitted reserve takes up.
                dynamic_bytes=float(memory.allocated_bytes),
                measured_bytes=float(peak_bytes), run_id=source.run_id,
                modelled_reserve_bytes=_reserve_counted(memory.reserve, measure),
            ))  # fmt: skip
    return points


def _reserve_counted(reserve_bytes: int, memory_measure: str) -> float:
    """The part of the model's reserve a measure counts: a process's resident set holds the
    interpreter and libraries; CUDA's allocated bytes hold none of the context."""
    return 0.0 if memory_measure == "cuda_max_allocated" else float(reserve_bytes)


def fit_memory(points: Sequence[MemoryPoint]) -> tuple[list[MemoryFit], list[Skipped]]:
    """One calibration per (device type, memory measure) with enough distinct sizes."""
    families: dict[tuple[str, str], list[MemoryPoint]] = {}
    for point in points:
        families.setdefault((point.device_type, point.memory_measure), []).append(point)
    fits, skipped = [], []
    for (device_type, measure), members in sorted(families.items()):
        dynamic = np.array([p.dynamic_bytes for p in members])
        measured = np.array([p.measured_bytes for p in members])
        if len(np.unique(dynamic)) < MIN_MEMORY_POINTS:
            skipped.append(Skipped(
                what=f"memory {device_type} {measure}",
                reason=f"{len(np.unique(dynamic))} distinct modelled peaks; "
                       f"{MIN_MEMORY_POINTS} needed",
            ))  # fmt: skip
            continue
        reserve, scale = _fit(dynamic, measured)
        fit_error = relative_errors(reserve + scale * dynamic, measured)
        fits.append(MemoryFit(
            device_type=device_type,
            memory_measure=measure,
            reserve_bytes=float(reserve),
            scale=float(scale),
            points=len(members),
            fit_mape=float(np.mean(fit_error)),
            size_range=(float(dynamic.min()), float(dynamic.max())),
            source_runs=tuple(sorted({p.run_id for p in members})),
            heldout=_heldout(dynamic, measured),
        ))  # fmt: skip
    return fits, skipped


def _fit(dynamic: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    reserve, scale = fit_relative_nnls(np.column_stack([np.ones_like(dynamic), dynamic]), measured)
    return float(reserve), float(scale)


def _heldout(dynamic: np.ndarray, measured: np.ndarray) -> HeldOut:
    train, test = extrapolation_split(dynamic)
    if len(np.unique(dynamic[train])) < 2:
        return HeldOut(train_points=len(train), test_points=len(test))
    reserve, scale = _fit(dynamic[train], measured[train])
    signed = (reserve + scale * dynamic[test] - measured[test]) / measured[test]
    return HeldOut(
        train_points=len(train),
        test_points=len(test),
        extrapolation_mape=float(np.mean(np.abs(signed))),
        extrapolation_max_error=float(np.max(np.abs(signed))),
        extrapolation_bias=float(np.mean(signed)),
        lodo_note="n/a (memory)",
    )
