"""What the supervised-run tests share: the plan they run and how closely they compare."""

from __future__ import annotations

from pathlib import Path

from hexiseq import plan_search

STEPS = 8
THRESHOLD = 2.0  # injected slowdowns are 3x: noise on 2 shared cores stays below
LOSS_RTOL = 1e-5  # fp32: the new layout and shares sum in another order


def write_plan(folder: Path) -> Path:
    """cpu-emulated-2type's best plan of `tiny` at 2K tokens (so emulated compute dominates):
    nodes "fast" (ranks 0-1) and "slow" (ranks 2-3, emulated 2x slower)."""
    path = folder / "plan.json"
    plan_search("cpu-emulated-2type", "tiny", 2048).best.to_json(path)
    return path
