"""The held-out error table of a fitted document, as `hexiseq fit` and the benchmark print it."""

from __future__ import annotations

from hexiseq.costmodel._fit_document import (
    COMPUTE_GOAL_MAPE,
    LINK_GOAL_MAPE,
    STABILITY_FACTOR,
    FittedDocument,
    HeldOut,
    LinkFit,
    MemoryFit,
    OpFit,
)
from hexiseq.report import format_table

__all__ = ["COMPUTE_GOAL_MAPE", "LINK_GOAL_MAPE", "format_heldout_table", "missed_goal_lines"]

_HEADERS = [
    "device / link",
    "op",
    "dtype",
    "emul.",
    "points",
    "train/test",
    "extrap. MAPE",
    "max err",
    "LODO MAPE",
    "bootstrap p10-p90",
    "goal (extrap.)",
]


def format_heldout_table(document: FittedDocument) -> str:
    """One row per fit: points, the extrapolation split, its mean and max relative error,
    the leave-one-device-type-out error and whether the goal is met; then the emulation
    checks and what was not fitted."""
    rows = [_op_row(fit) for fit in document.ops] + [_link_row(fit) for fit in document.links]
    rows += [_memory_row(fit) for fit in document.memory]
    if not rows:
        return "no family had enough ok points to fit" + _skipped_lines(document)
    table = format_table(_HEADERS, rows, right={3, 4, 5, 6, 7, 9})
    missed = missed_goal_lines(document)
    heading = (
        "\n\nmissed its goal or unstable (`--cost-model auto` uses the datasheet for it instead; "
    )
    heading += "`--cost-model fitted` forces the fit):\n"
    fallback = heading + "\n".join(missed) if missed else ""
    return table + fallback + _emulation_lines(document) + _skipped_lines(document)


def missed_goal_lines(document: FittedDocument) -> list[str]:
    """One line per fit whose extrapolation error exceeds its goal (`HeldOut.goal_met`) or
    that is unstable (`HeldOut.stable`)."""
    fits = [f for f in document.ops if f.emulation_slowdown == 1.0] + list(document.links)
    lines = []
    for fit in fits:
        heldout = fit.heldout
        if heldout.goal_met is False:
            lines.append(
                f"  {_fit_name(fit)}: {_percent(heldout.extrapolation_mape)} > "
                f"{100 * heldout.goal_mape:g} %"
            )
        elif heldout.stable is False:
            lines.append(
                f"  {_fit_name(fit)}: unstable, bootstrap p90 "
                f"{_percent(heldout.bootstrap_mape_p90)} > {STABILITY_FACTOR:g} x "
                f"{100 * heldout.goal_mape:g} %"
            )
    return lines


def _fit_name(fit: OpFit | LinkFit) -> str:
    if isinstance(fit, LinkFit):
        return f"{fit.link_class} {fit.op}"
    return f"{fit.device_type} {fit.op} {fit.dtype}"


def _op_row(fit: OpFit) -> list[str]:
    return [
        fit.device_type,
        fit.op,
        fit.dtype,
        f"{fit.emulation_slowdown:g}x",
        *_error_cells(fit.points, fit.heldout, COMPUTE_GOAL_MAPE),
    ]


def _link_row(fit: LinkFit) -> list[str]:
    knee = f", knee {fit.regimes[-1].from_bytes:,.0f} B" if len(fit.regimes) > 1 else ""
    return [
        fit.link_class,
        fit.op + knee,
        "-",
        "-",
        *_error_cells(fit.points, fit.heldout, LINK_GOAL_MAPE),
    ]


def _memory_row(fit: MemoryFit) -> list[str]:
    calibration = f"memory peak ({fit.memory_measure}: {fit.reserve_bytes / 2**20:,.0f} MiB"
    calibration += f" + {fit.scale:.2f} x model)"
    return [fit.device_type, calibration, "-", "-", *_error_cells(fit.points, fit.heldout, None)]


def _error_cells(points: int, heldout: HeldOut, goal: float | None) -> list[str]:
    mape = heldout.extrapolation_mape
    goal = heldout.goal_mape if heldout.goal_mape is not None else goal
    met = "met" if mape is not None and goal is not None and mape <= goal else "MISSED"
    return [
        str(points),
        f"{heldout.train_points}/{heldout.test_points}",
        _percent(mape),
        _percent(heldout.extrapolation_max_error),
        _lodo_cell(heldout),
        _stability_cell(heldout),
        f"≤ {100 * goal:g} %: {met}" if goal is not None else "-",
    ]


def _stability_cell(heldout: HeldOut) -> str:
    if heldout.bootstrap_mape_p10 is None or heldout.bootstrap_mape_p90 is None:
        return "-"
    spread = f"{_percent(heldout.bootstrap_mape_p10)} - {_percent(heldout.bootstrap_mape_p90)}"
    return spread + ("" if heldout.stable is not False else " UNSTABLE")


def _lodo_cell(heldout: HeldOut) -> str:
    if not heldout.lodo:
        return heldout.lodo_note or "-"
    worst = max(heldout.lodo, key=lambda error: error.mape)
    others = f", worst of {len(heldout.lodo)}" if len(heldout.lodo) > 1 else ""
    return f"{_percent(worst.mape)} (from {worst.reference}{others})"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


def _emulation_lines(document: FittedDocument) -> str:
    lines = [
        f"  {f.device_type} {f.op} {f.dtype} {f.emulation_slowdown:g}x: time ratio to the 1x "
        f"fit {f.emulation_check.time_ratio:.2f} (expected {f.emulation_check.expected_ratio:g})"
        for f in document.ops
        if f.emulation_check is not None
    ]
    return "\n\nemulation check (emulated fit / 1x fit):\n" + "\n".join(lines) if lines else ""


def _skipped_lines(document: FittedDocument) -> str:
    if not document.skipped:
        return ""
    lines = [f"  {s.what}: {s.reason}" for s in document.skipped]
    return "\n\nnot fitted (datasheet model used instead):\n" + "\n".join(lines)
