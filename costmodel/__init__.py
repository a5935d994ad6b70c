"""Cost models, the memory model and the step simulator (pure: no torch).

`DatasheetCostModel` is the embedded default until a device type is profiled; every prediction
it makes is labelled "datasheet estimate". `fit_cost_model` fits profile measurements into a
`FittedDocument`, and `FittedCostModel` predicts from it for the profiled types (datasheet
elsewhere). `estimate_memory` is the closed-form per-rank memory model (docs/design.md §6) and
`simulate_step` the event-level step simulator (docs/design.md §7). `costmodel.inspection`
gives what reports and the dashboard read from a fit (each profiled point's fitted time, the
memory calibration points).
"""

from hexiseq.costmodel._fit_document import FittedDocument
from hexiseq.costmodel._heldout_table import format_heldout_table
from hexiseq.costmodel._memory_fit import RuntimeSource
from hexiseq.costmodel.base import CostModel
from hexiseq.costmodel.datasheet import DATASHEET_LABEL, DatasheetCostModel
from hexiseq.costmodel.fit import ProfileSource, fit_cost_model
from hexiseq.costmodel.fitted import FittedCostModel
from hexiseq.costmodel.inspection import (
    MemoryFit,
    MemoryPoint,
    fitted_time_s,
    measurement_size,
    memory_points,
)
from hexiseq.costmodel.memory import (
    MemoryBreakdown,
    MemoryCalibration,
    estimate_memory,
    memory_limit_bytes,
)
from hexiseq.costmodel.simulator import RankTime, StepPrediction, simulate_step

__all__ = [
    "DATASHEET_LABEL",
    "CostModel",
    "DatasheetCostModel",
    "FittedCostModel",
    "FittedDocument",
    "MemoryBreakdown",
    "MemoryCalibration",
    "MemoryFit",
    "MemoryPoint",
    "ProfileSource",
    "RankTime",
    "RuntimeSource",
    "StepPrediction",
    "estimate_memory",
    "fit_cost_model",
    "fitted_time_s",
    "format_heldout_table",
    "measurement_size",
    "memory_limit_bytes",
    "memory_points",
    "simulate_step",
]
