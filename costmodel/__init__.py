"""Cost models, the memory model and the step simulator (pure: no torch).

`DatasheetCostModel` is the embedded default until a device type is profiled; every prediction
it makes is labelled "datasheet estimate". `fit_cost_model` fits profile measurements into a
`FittedDocument`, and `FittedCostModel` predicts from it for the profiled types (datasheet
elsewhere). `estimate_memory` is the closed-form per-rank memory model (docs/design.md §6) and
`simulate_step` the event-level step simulator (docs/design.md §7). `costmodel.inspection`
gives what reports and the dashboard read from a fit (each profiled point's fitted time, the
memory calibration points).
"""

import importlib
from typing import Any

from hexiseq.costmodel.base import CostModel
from hexiseq.costmodel.datasheet import DATASHEET_LABEL, DatasheetCostModel
from hexiseq.costmodel.memory import (
    MemoryBreakdown,
    MemoryCalibration,
    estimate_memory,
    memory_limit_bytes,
)
from hexiseq.costmodel.simulator import RankTime, StepPrediction, simulate_step

_FITTING = {
    "FittedDocument": "_fit_document",
    "format_heldout_table": "_heldout_table",
    "RuntimeSource": "_memory_fit",
    "ProfileSource": "fit",
    "fit_cost_model": "fit",
    "FittedCostModel": "fitted",
    "MemoryFit": "inspection",
    "MemoryPoint": "inspection",
    "fitted_time_s": "inspection",
    "measurement_size": "inspection",
    "memory_points": "inspection",
}
"""What fitting and fitted models need, by the module that defines it: imported when first
asked for (`__getattr__`), not with the package. Planning on the datasheet model never asks,
and importing these modules (their pydantic documents) took about 0.12 s of each cold
`hexiseq plan` (`benchmarks/cli_latency.py`)."""


def __getattr__(name: str) -> Any:
    module = _FITTING.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
