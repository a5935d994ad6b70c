"""What a report or the dashboard reads from a fit without the fitting internals: each
profiled point's size and the time its family's fit gives it, and the memory model's
calibration points (a measured rank's peak beside the model's).

Every fit of the document counts here, those the cost model refuses too (a fit that missed its
goal is drawn so that one can see how far off it is).
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel._features import measurement_features, size_key
from hexiseq.costmodel._fit_document import FittedDocument, MemoryFit
from hexiseq.costmodel._memory_fit import MemoryPoint, memory_points
from hexiseq.costmodel._regression import predict_link
from hexiseq.profiles import COMPUTE_OPS, ProfileMeasurement

__all__ = ["MemoryFit", "MemoryPoint", "fitted_time_s", "measurement_size", "memory_points"]


def measurement_size(measurement: ProfileMeasurement) -> tuple[float, str]:
    """The size a profiled point is plotted and split by, and its unit: FLOPs for matmul-like
    ops, else bytes (moved by the op or over the link)."""
    if measurement.op not in COMPUTE_OPS:
        return float(measurement.bytes_moved), "bytes"
    size = size_key(measurement.op, measurement)
    unit = "FLOPs" if measurement.flops and size == measurement.flops else "bytes"
    return float(size), unit


def fitted_time_s(document: FittedDocument, measurement: ProfileMeasurement) -> float | None:
    """The time (s) the document's fit of the measurement's family gives it; None where the
    document has no fit of that family."""
    if measurement.op in COMPUTE_OPS:
        key = (measurement.device_type, measurement.op, measurement.dtype,
               measurement.emulation_slowdown)  # fmt: skip
        for fit in document.ops:
            if (fit.device_type, fit.op, fit.dtype, fit.emulation_slowdown) == key:
                features = measurement_features(measurement, fit.cache_bytes)
                return float(np.dot(fit.coefficients, features))
        return None
    for fit in document.links:
        if (fit.link_class, fit.op) == (measurement.link_class, measurement.op):
            return float(predict_link(fit.regimes, np.array(measurement.bytes_moved)))
    return None
