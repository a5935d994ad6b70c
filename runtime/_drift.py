"""Every rank's compute measured against the plan's prediction, step by step: which ranks
drifted (a slower device: thermal throttling, a noisy neighbour, an injected slowdown) and by
how much, for `hexiseq run --replan` to plan again from measured rates.

A rank's *rate ratio* at a step is its measured compute (`_emulation.ComputePadding.device_s`:
on a CPU rank the CPU time of its compute phases times its emulated slowdown, on a GPU the
phases' time on the stream by CUDA events) over the compute the plan predicts for it
(`RankPrediction.linear_s + attention_s`). The ratio is not 1 even on a healthy rank (the
model's error, the host), so a rank's *drift* is its ratio over its own ratio at the start
of the run (the median of the `BASELINE_STEPS` steps after the first, which warms caches and
allocators), over the same of the typical rank (the lower median of all ranks' drifts): a
change that slows every rank alike (the host, a shared network, a CPU's frequency) moves no
work, so only a rank's speed *relative to the others* counts. A rank whose relative drift
stays at or above the threshold for `PATIENCE` steps in a row has slowed down by that
factor; one that was measured slow before (its device's `measured_slowdown` in the plan) and
whose drift falls to 1 / threshold has recovered. Ranks inside the band keep their factor:
noise never moves a plan. A slowdown already in force in the baseline steps is part of the
start. Pure: no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from hexiseq.supervision import DEFAULT_DRIFT_THRESHOLD

BASELINE_STEPS = 3
PATIENCE = 2


@dataclass(frozen=True)
class Drift:
    """What the monitor saw at `step`: per rank, the measured compute, the predicted one,
    their ratio and the drift; `factors`: the ranks that changed speed and by how much."""

    step: int
    measured_s: tuple[float, ...]
    predicted_s: tuple[float, ...]
    drift: tuple[float, ...]
    factors: dict[int, float]

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "measured_compute_s": list(self.measured_s),
            "predicted_compute_s": list(self.predicted_s),
            "drift": list(self.drift),
            "factors": {str(rank): factor for rank, factor in self.factors.items()},
        }

    def describe(self) -> str:
        """One line: each rank that changed speed, by how much."""
        parts = [
            f"rank {rank} {factor:.2f}x {'slower' if factor > 1 else 'faster'}"
            for rank, factor in sorted(self.factors.items())
        ]
        return f"step {self.step}: " + ", ".join(parts) + " than at the start of the run"


@dataclass
class DriftMonitor:
    """Feed it each step's measured compute per rank (`observe`); it answers a `Drift` when
    some rank has changed speed for `PATIENCE` steps, else None."""

    predicted_s: Sequence[float]
    slowed: Sequence[bool]
    """Per rank: already measured slow (its plan's device has a measured slowdown > 1)."""
    threshold: float = DEFAULT_DRIFT_THRESHOLD
    last_drift: tuple[float, ...] | None = None
    """Each rank's relative drift at the last step observed (None before the baseline)."""
    _ratios: list[tuple[float, ...]] = field(default_factory=list)
    _baseline: tuple[float, ...] | None = None
    _streak: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.predicted_s) != len(self.slowed):
            raise ValueError("DriftMonitor: one prediction and one slowed flag per rank")
        if not self.threshold > 1:
            raise ValueError(f"drift threshold must be > 1 (got {self.threshold})")
        if any(not p > 0 for p in self.predicted_s):
            raise ValueError(f"predicted compute must be > 0 on every rank: {self.predicted_s}")

    def observe(self, step: int, measured_s: Sequence[float]) -> Drift | None:
        ratios = tuple(m / p for m, p in zip(measured_s, self.predicted_s, strict=True))
        self._ratios.append(ratios)
        if self._baseline is None:
            if len(self._ratios) < 1 + BASELINE_STEPS:
                return None
            window = self._ratios[1:]  # the first step warms up
            self._baseline = tuple(statistics.median(col) for col in zip(*window, strict=True))
            return None
        own = [r / b if b > 0 else 1.0 for r, b in zip(ratios, self._baseline, strict=True)]
        typical = statistics.median_low(own) or 1.0  # no rank timed anything: no drift
        drift = tuple(value / typical for value in own)
        self.last_drift = drift
        changed = {}
        for rank, value in enumerate(drift):
            moved = value >= self.threshold or (self.slowed[rank] and value <= 1 / self.threshold)
            self._streak[rank] = self._streak.get(rank, 0) + 1 if moved else 0
            if self._streak[rank] >= PATIENCE:
                changed[rank] = value
        if not changed:
            return None
        return Drift(step, tuple(measured_s), tuple(self.predicted_s), drift, changed)

    def rebase(self) -> None:
        """Take the present speeds as the new start (a re-plan was declined)."""
        self._baseline = self._ratios[-1] if self._ratios else None
        self._streak.clear()
        self.last_drift = None
