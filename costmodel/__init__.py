"""Cost models, the memory model and the step simulator (pure: no torch).

`DatasheetCostModel` is the embedded default until a device type is profiled; every prediction
it makes is labelled "datasheet estimate". `estimate_memory` is the closed-form per-rank memory
model (DESIGN.md §6) and `simulate_step` the event-level step simulator (DESIGN.md §7).
"""

from hexiseq.costmodel.base import CostModel
from hexiseq.costmodel.datasheet import DATASHEET_LABEL, DatasheetCostModel
from hexiseq.costmodel.memory import MemoryBreakdown, estimate_memory, memory_limit_bytes
from hexiseq.costmodel.simulator import RankTime, StepPrediction, simulate_step

__all__ = [
    "DATASHEET_LABEL",
    "CostModel",
    "DatasheetCostModel",
    "MemoryBreakdown",
    "RankTime",
    "StepPrediction",
    "estimate_memory",
    "memory_limit_bytes",
    "simulate_step",
]
