"""The regressions behind the fitted cost model (pure numpy; scikit-learn loaded on first fit).

Op times: time = Σ coefficient x feature with every coefficient >= 0, fitted for relative error:
scikit-learn `LinearRegression(positive=True, fit_intercept=False)` (non-negative least squares)
on the rows divided by their measured time, i.e. minimizing Σ ((prediction − t) / t)², the same
as `sample_weight = 1 / t²`. Relative error because times span six orders of magnitude and a
plain fit would ignore every small point.

Links: time = α + bytes / β with α, β >= 0 (the effective bandwidth bytes / time then never
falls with size), one line per size regime: a second regime is kept only when a knee cuts the
mean relative error by half (`KNEE_GAIN`). The piecewise model is made monotone at the knee:
above it, the time never drops below the time just under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_REGIME_POINTS = 4
"""Points on each side of a knee (an α–β line needs a few more than its two parameters)."""
KNEE_GAIN = 0.5
"""A knee must bring the mean relative error below this fraction of the one-line fit's
(four parameters fit noise better than two: a third less error is what 2 % noise alone
gives on a straight line of 17 sizes)."""


def fit_relative_nnls(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative coefficients c minimizing Σ ((features @ c − seconds) / seconds)².

    `features`: [point, feature]; `seconds`: [point], all > 0. Columns are scaled to a unit
    maximum before the solve (NNLS is invariant to that, the conditioning is not).
    """
    from sklearn.linear_model import LinearRegression  # ~1 s to import: only when fitting

    relative = features / seconds[:, None]
    scale = np.abs(relative).max(axis=0)
    scale[scale == 0] = 1.0
    model = LinearRegression(positive=True, fit_intercept=False)
    model.fit(relative / scale, np.ones_like(seconds))
    return np.maximum(model.coef_, 0.0) / scale


CAPACITY_GAIN = 0.75
"""Cache capacities other than the hardware's are kept only when they bring the mean
relative error of the fit below this fraction of the error with the hardware's."""
CAPACITY_CANDIDATES = 24
"""Log-spaced last-level capacities tried for each L2 capacity."""


def fit_effective_capacity(
    features: np.ndarray,
    seconds: np.ndarray,
    per_call_bytes: np.ndarray,
    calls: np.ndarray,
    capacities: tuple[float, float],
    *,
    streaming: bool,
) -> tuple[np.ndarray, tuple[float, float]]:
    """`fit_relative_nnls` with the last two columns (the cache terms of L2 and last-level
    cache, `hexiseq.costmodel._features.cache_terms`) rebuilt for the capacities that fit
    best, and those capacities.

    The hardware's sizes (`capacities`) are the first choice. A process does not get all of
    them: other data (the rotated inputs, the runtime's buffers) share the L2, and in a VM or
    beside other tenants the share of a host's last-level cache is smaller, so the step in
    time per byte comes earlier. Capacities from 1/8 of the hardware L2 up to it, and from
    twice that up to the hardware's last-level size, are tried (log-spaced); others than the
    hardware's are kept only when they cut the mean relative error (`CAPACITY_GAIN`). Only
    the given points decide: the held-out fit passes its training points alone.
    """
    from hexiseq.costmodel._features import bytes_out_of_cache

    def fit_with(trial: tuple[float, float]):
        rebuilt = features.copy()
        for column, capacity in zip((-2, -1), trial):
            out = bytes_out_of_cache(per_call_bytes, capacity, streaming)
            rebuilt[:, column] = calls * out
        coefficients = fit_relative_nnls(rebuilt, seconds)
        error = float(np.mean(relative_errors(rebuilt @ coefficients, seconds)))
        return coefficients, trial, error

    l2_bytes, llc_bytes = capacities
    best = fit_with((float(l2_bytes), float(llc_bytes)))
    hardware_error = best[2]
    for l2 in np.geomspace(l2_bytes / 8, l2_bytes, 7):
        if llc_bytes <= 2 * l2:
            continue
        for llc in np.geomspace(2 * l2, llc_bytes, CAPACITY_CANDIDATES):
            fitted = fit_with((float(l2), float(llc)))
            if fitted[2] < min(best[2], CAPACITY_GAIN * hardware_error):
                best = fitted
    return best[0], best[1]


def relative_errors(predicted: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """|predicted − measured| / measured, per point."""
    return np.abs(predicted - seconds) / seconds


@dataclass(frozen=True)
class Regime:
    """One α–β line of a link model, used from `from_bytes` upwards."""

    from_bytes: float
    latency_s: float
    seconds_per_byte: float


def predict_link(regimes: Sequence[Regime], bytes_moved: np.ndarray) -> np.ndarray:
    """Time of messages of `bytes_moved` under the piecewise α–β model `regimes` (anything
    with `from_bytes`, `latency_s`, `seconds_per_byte`, sorted by `from_bytes`, the first
    from 0); non-decreasing in bytes by construction."""
    bytes_moved = np.asarray(bytes_moved, dtype=np.float64)
    seconds = _line_seconds(regimes[0], bytes_moved)
    for index, regime in enumerate(regimes[1:], start=1):
        below_knee = float(predict_link(regimes[:index], np.array(regime.from_bytes)))
        above = np.maximum(_line_seconds(regime, bytes_moved), below_knee)
        seconds = np.where(bytes_moved < regime.from_bytes, seconds, above)
    return seconds


def _line_seconds(regime: Regime, bytes_moved: np.ndarray) -> np.ndarray:
    return regime.latency_s + bytes_moved * regime.seconds_per_byte


def fit_link(bytes_moved: np.ndarray, seconds: np.ndarray) -> tuple[Regime, ...]:
    """One or two α–β regimes (see the module docstring); the knee, if any, is the split of the
    points sorted by size that minimizes the mean relative error of the piecewise model."""
    order = np.argsort(bytes_moved, kind="stable")
    sizes, times = bytes_moved[order], seconds[order]
    one_line = (_line(sizes, times, 0.0),)
    one_line_error = _mean_error(one_line, sizes, times)
    best, best_error = one_line, one_line_error
    for split in range(MIN_REGIME_POINTS, len(sizes) - MIN_REGIME_POINTS + 1):
        if sizes[split] == sizes[split - 1]:
            continue  # a knee falls between two sizes
        regimes = (
            _line(sizes[:split], times[:split], 0.0),
            _line(sizes[split:], times[split:], float(sizes[split])),
        )
        error = _mean_error(regimes, sizes, times)
        if error < best_error:
            best, best_error = regimes, error
    return best if best_error < KNEE_GAIN * one_line_error else one_line


def _line(sizes: np.ndarray, times: np.ndarray, from_bytes: float) -> Regime:
    latency_s, seconds_per_byte = fit_relative_nnls(
        np.column_stack([np.ones_like(sizes), sizes]), times
    )
    return Regime(from_bytes, float(latency_s), float(seconds_per_byte))


def _mean_error(regimes: tuple[Regime, ...], sizes: np.ndarray, times: np.ndarray) -> float:
    return float(np.mean(relative_errors(predict_link(regimes, sizes), times)))
