"""The regressions behind the fitted cost model (pure numpy; scikit-learn loaded on first fit).

Op times: time = Σ coefficient x feature with every coefficient >= 0, fitted for relative error:
scikit-learn `LinearRegression(positive=True, fit_intercept=False)` (non-negative least squares)
on the rows divided by their measured time, i.e. minimizing Σ ((prediction − t) / t)², the same
as `sample_weight = 1 / t²`. Relative error because times span six orders of magnitude and a
plain fit would ignore every small point.

Links: time = α + bytes / β with α, β >= 0 (the effective bandwidth bytes / time then never
falls with size), one line per size regime, up to `MAX_REGIMES`: a link often has three
(latency-bound small messages, a bandwidth while the buffers sit in a cache or a protocol
suits them, and the bandwidth of the largest messages, which may be lower). For each count
the knees minimize the mean squared relative error. The count is chosen for extrapolation,
the model's use: each count's model fitted on the smaller two thirds of the given points
predicts the largest third, and the fewest regimes whose error there is within one standard
error of the best count's win (the one-standard-error rule, Hastie, Tibshirani & Friedman,
*The Elements of Statistical Learning*, §7.10), so a knee that only follows the timing noise
is not kept. The piecewise model is made monotone at each knee: above it, the time never
drops below the time just under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

import numpy as np

MIN_REGIME_POINTS = 4
"""Points on each side of a knee (an α–β line needs a few more than its two parameters)."""
MAX_REGIMES = 3
"""Most α–β lines a link model is cut into."""
TIE_ERROR = 1e-6
"""Mean relative errors closer than this are ties (round-off on exact data)."""


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


KNEE_CANDIDATES = 48
"""Log-spaced elementwise knees tried besides the L2 capacity and the given sizes."""


def fit_knee(
    features: np.ndarray,
    seconds: np.ndarray,
    per_call_bytes: np.ndarray,
    calls: np.ndarray,
    l2_bytes: float,
) -> tuple[np.ndarray, float]:
    """`fit_relative_nnls` of a GPU's elementwise features (bytes, calls, bytes beyond the
    knee) with the last column rebuilt at the knee that fits best, and that knee.

    A call timed by CUDA events costs max(floor, launch + bytes / bandwidth): the host's issue
    time hides the kernel up to some size, then time grows with the bytes from HBM. The knee
    of calls x max(0, bytes - knee) is where it starts to grow: the L2 capacity (the first
    choice, as `fit_effective_capacity` keeps the hardware's), or another size: the given
    sizes and `KNEE_CANDIDATES` log-spaced between the smallest and the largest. A knee is
    admissible only if the line above it, at 0 bytes, leaves a launch time >= 0
    (bytes-beyond coefficient x knee <= calls coefficient): a knee past the bytes the kernel
    moves within the floor would need a negative launch time, which is what a knee at the L2
    does when the L2 is larger than that. Another knee
    than the L2 is kept when the L2 is not admissible or the other one cuts the mean
    relative error below `CAPACITY_GAIN` x the L2's; ties go to the smaller knee. Only the
    given points decide: the held-out fit passes its training points alone.
    """

    def fit_with(knee: float):
        rebuilt = features.copy()
        rebuilt[:, -1] = calls * np.maximum(per_call_bytes - knee, 0.0)
        coefficients = fit_relative_nnls(rebuilt, seconds)
        error = float(np.mean(relative_errors(rebuilt @ coefficients, seconds)))
        admissible = coefficients[-1] * knee <= coefficients[1] * (1 + TIE_ERROR)
        return coefficients, knee, error, admissible

    hardware = fit_with(float(l2_bytes))
    best = hardware if hardware[3] else None
    sizes = np.unique(per_call_bytes[per_call_bytes > 0])
    if len(sizes) == 0:
        return hardware[0], hardware[1]
    candidates = np.union1d(sizes, np.geomspace(sizes[0], sizes[-1], KNEE_CANDIDATES))
    for knee in candidates:
        fitted = fit_with(float(knee))
        if not fitted[3] or (best is not None and fitted[2] >= best[2] - TIE_ERROR):
            continue
        if best is hardware and fitted[2] >= CAPACITY_GAIN * hardware[2]:
            continue
        best = fitted
    best = best or hardware
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
    """One to `MAX_REGIMES` α–β regimes (see the module docstring): as many as
    `regime_count` finds, split at the knees that minimize the mean squared relative error
    of the piecewise model on all the given points."""
    order = np.argsort(bytes_moved, kind="stable")
    sizes, times = bytes_moved[order], seconds[order]
    model = _best_model(sizes, times, regime_count(sizes, times))
    return model if model is not None else (_line(sizes, times, 0.0),)


def regime_count(sizes: np.ndarray, times: np.ndarray) -> int:
    """How many regimes extrapolate best (`sizes` ascending): each count's best model on
    the smaller two thirds predicts the largest third; the fewest regimes within one
    standard error of the lowest mean relative error there. 1 with too few points."""
    fit_part, check_part = extrapolation_split(sizes)
    errors = {}
    for count in range(1, MAX_REGIMES + 1):
        model = _best_model(sizes[fit_part], times[fit_part], count)
        if model is not None:
            predicted = predict_link(model, sizes[check_part])
            errors[count] = relative_errors(predicted, times[check_part])
    if not errors:
        return 1
    best = min(errors, key=lambda count: float(np.mean(errors[count])))
    spread = errors[best]
    standard_error = (
        float(np.std(spread, ddof=1) / np.sqrt(len(spread))) if len(spread) > 1 else 0.0
    )
    limit = float(np.mean(spread)) + max(standard_error, TIE_ERROR)
    return min(count for count, error in errors.items() if float(np.mean(error)) <= limit)


def extrapolation_split(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the smallest two thirds (train) and the largest third (test, at least one
    point) of `sizes`, by a stable sort: every test size >= every train size."""
    order = np.argsort(sizes, kind="stable")
    test_count = max(1, len(order) // 3)
    return order[: len(order) - test_count], order[len(order) - test_count :]


def _best_model(sizes: np.ndarray, times: np.ndarray, count: int) -> tuple[Regime, ...] | None:
    """The `count` regimes (`sizes` ascending) whose knees minimize the mean squared relative
    error; None when too few points for that many."""
    lines = _SegmentLines(sizes, times)
    models = [lines.model(knees) for knees in _knee_sets(sizes, count - 1)]
    return min(models, key=lambda model: model[1])[0] if models else None


def _knee_sets(sizes: np.ndarray, count: int):
    """Every increasing tuple of `count` split indices leaving `MIN_REGIME_POINTS` points in
    each regime, splitting only between two different sizes."""
    splits = [
        index
        for index in range(MIN_REGIME_POINTS, len(sizes) - MIN_REGIME_POINTS + 1)
        if sizes[index] != sizes[index - 1]
    ]
    for knees in combinations(splits, count):
        bounds = (0, *knees, len(sizes))
        if all(high - low >= MIN_REGIME_POINTS for low, high in pairwise(bounds)):
            yield knees


class _SegmentLines:
    """The α–β line of each run of points, fitted once however many models share it."""

    def __init__(self, sizes: np.ndarray, times: np.ndarray) -> None:
        self.sizes, self.times = sizes, times
        self._lines: dict[tuple[int, int], Regime] = {}

    def line(self, low: int, high: int) -> Regime:
        if (low, high) not in self._lines:
            from_bytes = float(self.sizes[low]) if low else 0.0
            self._lines[low, high] = _line(self.sizes[low:high], self.times[low:high], from_bytes)
        return self._lines[low, high]

    def model(self, knees: tuple[int, ...]) -> tuple[tuple[Regime, ...], float]:
        """The regimes split at `knees`, and their mean squared relative error."""
        bounds = (0, *knees, len(self.sizes))
        regimes = tuple(self.line(low, high) for low, high in pairwise(bounds))
        residuals = (predict_link(regimes, self.sizes) - self.times) / self.times
        return regimes, float(np.mean(residuals**2))


def _line(sizes: np.ndarray, times: np.ndarray, from_bytes: float) -> Regime:
    latency_s, seconds_per_byte = fit_relative_nnls(
        np.column_stack([np.ones_like(sizes), sizes]), times
    )
    return Regime(from_bytes, float(latency_s), float(seconds_per_byte))
