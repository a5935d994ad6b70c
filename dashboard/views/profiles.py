"""Profile views: microbenchmark measurements against the fitted cost model's curves, their
residuals, and each fit's held-out error (docs/design.md §6)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from hexiseq.catalog import GiB
from hexiseq.costmodel import (
    FittedDocument,
    MemoryFit,
    MemoryPoint,
    fitted_time_s,
    measurement_size,
)
from hexiseq.profiles import COMPUTE_OPS, ProfileMeasurement

PROFILE_COLUMNS = [
    "family",
    "device_type",
    "op",
    "dtype",
    "link_class",
    "emulation_slowdown",
    "size",
    "size_unit",
    "measured_s",
    "p10_s",
    "p90_s",
    "status",
    "predicted_s",
    "relative_error",
]


def family_name(m: ProfileMeasurement) -> str:
    """`cpu gemm float32` / `cpu gemm float32 2x` (emulated) / `inter p2p` for links."""
    if m.op in COMPUTE_OPS:
        slow = f" {m.emulation_slowdown:g}x" if m.emulation_slowdown != 1.0 else ""
        return f"{m.device_type} {m.op} {m.dtype}{slow}"
    return f"{m.link_class} {m.op}"


def profile_frame(
    measurements: Sequence[ProfileMeasurement], document: FittedDocument | None
) -> pd.DataFrame:
    """One row per measured point: its family, size (FLOPs or bytes), measured median and
    p10/p90, and the fitted prediction with its relative error (predicted / measured - 1)
    where a fit of that family exists."""
    rows = [_profile_row(m, document) for m in measurements]
    return pd.DataFrame(rows, columns=PROFILE_COLUMNS)


def _profile_row(m: ProfileMeasurement, document: FittedDocument | None) -> dict:
    size, unit = measurement_size(m)
    predicted = None
    if m.status == "ok" and document is not None:
        predicted = fitted_time_s(document, m)
    return {
        "family": family_name(m),
        "device_type": m.device_type,
        "op": m.op,
        "dtype": m.dtype,
        "link_class": m.link_class,
        "emulation_slowdown": m.emulation_slowdown,
        "size": size,
        "size_unit": unit,
        "measured_s": m.median_s,
        "p10_s": m.p10_s,
        "p90_s": m.p90_s,
        "status": m.status,
        "predicted_s": predicted,
        "relative_error": predicted / m.median_s - 1 if predicted and m.median_s else None,
    }


def profile_figure(frame: pd.DataFrame, family: str) -> go.Figure:
    """One family: measured medians with p10-p90 bars and the fitted curve, log-log."""
    part = frame[(frame["family"] == family) & (frame["status"] == "ok")].sort_values("size")
    measured = go.Scatter(
        x=part["size"],
        y=part["measured_s"],
        mode="markers",
        name="measured (median, p10-p90)",
        error_y={
            "type": "data",
            "symmetric": False,
            "array": part["p90_s"] - part["measured_s"],
            "arrayminus": part["measured_s"] - part["p10_s"],
        },
    )
    traces = [measured]
    fitted = part.dropna(subset=["predicted_s"])
    if len(fitted):
        # Markers, not a line: an op's time depends on more than the size on the x axis.
        traces.append(
            go.Scatter(
                x=fitted["size"],
                y=fitted["predicted_s"],
                mode="markers",
                marker={"symbol": "x", "color": "#ff7f0e"},
                name="fitted model at each point",
            )
        )
    unit = part["size_unit"].iloc[0] if len(part) else "size"
    figure = go.Figure(traces)
    figure.update_layout(
        title=f"{family}: measured vs fitted",
        xaxis_title=unit,
        yaxis_title="seconds per call",
        xaxis_type="log",
        yaxis_type="log",
    )
    return figure


def residuals_figure(frame: pd.DataFrame, family: str) -> go.Figure:
    """One family's relative errors of the fit (%), against size."""
    part = frame[(frame["family"] == family)].dropna(subset=["relative_error"])
    figure = go.Figure(
        go.Scatter(
            x=part["size"],
            y=100 * part["relative_error"],
            mode="markers",
            name="predicted / measured - 1",
        )
    )
    figure.add_hline(y=0, line_dash="dot")
    figure.update_layout(
        title=f"{family}: residuals",
        xaxis_type="log",
        xaxis_title=part["size_unit"].iloc[0] if len(part) else "size",
        yaxis_title="error (%)",
    )
    return figure


def heldout_frame(document: FittedDocument) -> pd.DataFrame:
    """One row per fit: points, in-sample error, and the held-out errors (extrapolation to
    the largest third of the sizes; leave one device type out), in percent."""
    rows = []
    for fit in document.ops:
        slow = f" {fit.emulation_slowdown:g}x" if fit.emulation_slowdown != 1.0 else ""
        rows.append(_heldout_row(f"{fit.device_type} {fit.op} {fit.dtype}{slow}", fit))
    for fit in document.links:
        rows.append(_heldout_row(f"{fit.link_class} {fit.op}", fit))
    for fit in document.memory:
        rows.append(_heldout_row(f"{fit.device_type} memory peak ({fit.memory_measure})", fit))
    columns = [
        "family",
        "points",
        "fit_error_pct",
        "extrapolation_error_pct",
        "extrapolation_max_error_pct",
        "leave_one_type_out",
    ]
    return pd.DataFrame(rows, columns=columns)


def _heldout_row(family: str, fit) -> dict:
    held = fit.heldout
    lodo = ", ".join(f"from {e.reference}: {100 * e.mape:.1f} %" for e in held.lodo)
    return {
        "family": family,
        "points": fit.points,
        "fit_error_pct": 100 * fit.fit_mape,
        "extrapolation_error_pct": _percent(held.extrapolation_mape),
        "extrapolation_max_error_pct": _percent(held.extrapolation_max_error),
        "leave_one_type_out": lodo or held.lodo_note,
    }


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def memory_calibration_figure(
    points: Sequence[MemoryPoint], fits: Sequence[MemoryFit], device_type: str
) -> go.Figure:
    """Measured peak against the memory model's peak for each measured rank of `device_type`
    (GiB), with the model as written (measured = modelled) and its calibration."""
    mine = [p for p in points if p.device_type == device_type]
    modelled = np.array([p.modelled_bytes for p in mine]) / GiB
    measured = np.array([p.measured_bytes for p in mine]) / GiB
    figure = go.Figure()
    figure.add_trace(go.Scatter(
        x=modelled, y=measured, mode="markers", name="measured ranks",
        text=[f"run {p.run_id}" for p in mine],
    ))  # fmt: skip
    if len(mine):
        span = np.linspace(0.0, float(modelled.max()) * 1.05, 50)
        figure.add_trace(go.Scatter(x=span, y=span, mode="lines", name="model as written",
                                    line={"dash": "dot"}))  # fmt: skip
        for fit in (f for f in fits if f.device_type == device_type):
            reserve = mine[0].modelled_reserve_bytes
            calibrated = (fit.reserve_bytes + fit.scale * (span * GiB - reserve)) / GiB
            figure.add_trace(go.Scatter(
                x=span, y=calibrated, mode="lines",
                name=f"calibrated: {fit.reserve_bytes / GiB:.2f} GiB + {fit.scale:.2f} x",
            ))  # fmt: skip
    figure.update_layout(
        title=f"{device_type}: measured peak memory vs the memory model",
        xaxis_title="modelled peak (GiB)",
        yaxis_title="measured peak (GiB)",
    )
    return figure
