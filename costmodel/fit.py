"""Fitting the cost model to profile measurements, with held-out errors (docs/design.md §6).

`fit_cost_model` turns the profiler's `ProfileMeasurement` rows into a `FittedDocument`:
- per (device type, op family, dtype, emulation slowdown) an op-time regression that
  extrapolates: time = a·FLOPs + b·bytes + c·calls (+ cache terms on a CPU, wave and tile
  terms and the elementwise knee on a GPU: `_features`, `_gpu_features`, `fit_knee`),
  non-negative, relative-error loss
  (`hexiseq.costmodel._regression`); the final coefficients use every point;
- per (link class, op) α + bytes/β, one to three size regimes;
- held-out errors of each: extrapolation (fit on the smallest two thirds by size, predict the
  largest third: mean and max relative error) and, for compute, leave-one-device-type-out
  (predict the type's points from another profiled GPU type's fit scaled by datasheet ratios;
  a CPU is no peer for a GPU's ratios); each fit is flagged with whether its extrapolation
  error meets its goal (5 % compute, 10 % links), which `--cost-model auto` heeds;
- for emulated slow devices, the ratio of their fit to the 1x fit of the same device;
- given runtime runs, the memory model calibrated per device type against the measured
  peaks (`hexiseq.costmodel._memory_fit`).
Rows whose status is not `ok` are skipped; a family with fewer than `MIN_POINTS` points is
not fitted (listed under `skipped`), and its device type falls back to the datasheet model.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

from hexiseq.catalog import gpu_catalog
from hexiseq.costmodel._features import (
    CACHED_OPS,
    OP_FEATURES,
    STREAMING_OPS,
    cache_terms,
    feature_names,
    measurement_cache_bytes,
    measurement_features,
    size_key,
)
from hexiseq.costmodel._fit_document import (
    BOOTSTRAP_RESAMPLES,
    COMPUTE_GOAL_MAPE,
    LINK_GOAL_MAPE,
    EmulationCheck,
    FittedDocument,
    HeldOut,
    LinkFit,
    LodoError,
    OpFit,
    Regime,
    Skipped,
    SourceRun,
    goal_flags,
    stability_flags,
)
from hexiseq.costmodel._gpu_features import gpu_memory_bound_features, gpu_traits
from hexiseq.costmodel._memory_fit import RuntimeSource, fit_memory, memory_points
from hexiseq.costmodel._regression import (
    extrapolation_split,
    fit_effective_capacity,
    fit_knee,
    fit_link,
    fit_relative_nnls,
    predict_link,
    relative_errors,
)
from hexiseq.kernels import LEGACY_KERNEL_NAMES
from hexiseq.profiles import COMPUTE_OPS, LINK_OPS, ProfileMeasurement

MIN_POINTS = 6
"""Fewest ok points a family needs: 3 coefficients, and 4 + 2 for the extrapolation split."""

LOSS = (
    "relative error: non-negative least squares on rows divided by the measured time "
    "(sklearn LinearRegression(positive=True, fit_intercept=False)), = sample_weight 1/t^2"
)


@dataclass(frozen=True)
class ProfileSource:
    """The measurements of one profile run, with the run's id and start time (ISO 8601)."""

    run_id: int | None
    created_at: str | None
    measurements: Sequence[ProfileMeasurement]


@dataclass(frozen=True)
class _Points:
    """One family's ok points as arrays: features [point, feature], seconds and sizes."""

    features: np.ndarray
    seconds: np.ndarray
    sizes: np.ndarray
    runs: tuple[int, ...]
    device_type: str
    cache_bytes: tuple[float, float] | None = None
    kernel: str | None = None
    feature_names: tuple[str, ...] = ()


def fit_cost_model(
    sources: Sequence[ProfileSource] | Sequence[ProfileMeasurement],
    *,
    runtime_runs: Sequence[RuntimeSource] = (),
    created_at: datetime | None = None,
) -> FittedDocument:
    """Fit every family the measurements hold; see the module docstring.

    `sources`: profile runs, or bare measurements (one source without a run id);
    `runtime_runs`: runs whose measured peaks calibrate the memory model.
    Never raises for thin data: what cannot be fitted is listed in the document's `skipped`.
    """
    runs = _as_sources(sources)
    rows = [(run.run_id, m) for run in runs for m in run.measurements if _is_ok(m)]
    skipped: list[Skipped] = []
    compute = _group(rows, lambda m: m.op in COMPUTE_OPS, _compute_key, skipped)
    links = _group(rows, lambda m: m.op in LINK_OPS, _link_key, skipped)
    ops = _with_lodo(_fit_compute_families(compute))
    memory, memory_skipped = fit_memory(memory_points(runtime_runs))
    skipped += memory_skipped
    return FittedDocument(
        created_at=(created_at or datetime.now(timezone.utc)).isoformat(),
        versions=_versions(),
        loss=LOSS,
        sources=tuple(_describe_source(run) for run in runs),
        ops=tuple(_with_emulation_checks(ops)),
        links=tuple(_fit_link_families(links)),
        memory=tuple(memory),
        skipped=tuple(skipped),
    )


def _as_sources(sources) -> list[ProfileSource]:
    items = list(sources)
    if items and all(isinstance(item, ProfileMeasurement) for item in items):
        return [ProfileSource(None, None, items)]
    return items


def _is_ok(m: ProfileMeasurement) -> bool:
    return (
        m.status == "ok" and m.median_s is not None and np.isfinite(m.median_s) and m.median_s > 0
    )


def _compute_key(m: ProfileMeasurement) -> tuple:
    return (m.device_type, m.op, m.dtype, float(m.emulation_slowdown))


def _link_key(m: ProfileMeasurement) -> tuple:
    # Emulation pads compute only, so link points of every slowdown describe the same link.
    return (m.link_class or f"intra:{m.device_type}", m.op)


def _group(rows, accept, key_of, skipped: list[Skipped]) -> dict[tuple, _Points]:
    """The accepted rows by family key, as arrays; families with too few points, or points
    without the shape their features need, go to `skipped`."""
    grouped: dict[tuple, list] = {}
    for run_id, m in rows:
        if accept(m):
            grouped.setdefault(key_of(m), []).append((run_id, m))
    points = {}
    for key, members in grouped.items():
        what = " ".join(_format_key_part(part) for part in key)
        if len(members) < MIN_POINTS:
            reason = f"{len(members)} ok points, a fit needs at least {MIN_POINTS}"
            skipped.append(Skipped(what=what, reason=reason))
            continue
        try:
            points[key] = _points(members)
        except ValueError as error:
            skipped.append(Skipped(what=what, reason=str(error)))
    return points


def _format_key_part(part) -> str:
    return f"{part:g}x" if isinstance(part, float) else str(part)


def _newest_kernel_only(members: list) -> list:
    """A family profiled with several attention kernels (a store re-profiled after the
    kernel rule changed, e.g. flash then cuDNN) keeps the rows of its newest run's kernel."""
    kernels = {m.extra.get("kernel") for _, m in members}
    if len(kernels) <= 1:
        return members
    newest = max(members, key=lambda member: member[0] if member[0] is not None else -1)
    kernel = newest[1].extra.get("kernel")
    return [(run, m) for run, m in members if m.extra.get("kernel") == kernel]


def _points(members: list) -> _Points:
    members = _newest_kernel_only(members) if members[0][1].op in COMPUTE_OPS else members
    measurements = [m for _, m in members]
    names: tuple[str, ...] = ()
    if measurements[0].op in COMPUTE_OPS:
        names = _the_one({feature_names(m) for m in measurements})
        if names is None:
            raise ValueError("rows of different kernels need different features; profile one")
        features = np.array([measurement_features(m) for m in measurements], dtype=np.float64)
        sizes = np.array([size_key(m.op, m) for m in measurements], dtype=np.float64)
    else:
        sizes = np.array([m.bytes_moved for m in measurements], dtype=np.float64)
        features = sizes[:, None]
    seconds = np.array([m.median_s for m in measurements], dtype=np.float64)
    runs = tuple(sorted({run_id for run_id, _ in members if run_id is not None}))
    return _Points(
        features,
        seconds,
        sizes,
        runs,
        measurements[0].device_type,
        cache_bytes=_the_one({measurement_cache_bytes(m) for m in measurements}),
        kernel=_the_one({m.extra.get("kernel") for m in measurements if m.op in COMPUTE_OPS}),
        feature_names=names,
    )


def _the_one(values: set):
    """The value every row agrees on, else None (rows of older profiles, or mixed hosts:
    the prediction then leaves that refinement out)."""
    return next(iter(values)) if len(values) == 1 else None


def _fit_compute_families(families: dict[tuple, _Points]) -> list[tuple[OpFit, _Points]]:
    fits = []
    for (device_type, op, dtype, slowdown), points in families.items():
        coefficients, cache_bytes, features = _fit_points(op, points, slice(None))
        train, test = extrapolation_split(points.sizes)
        train_coefficients, train_cache, _ = _fit_points(op, points, train)
        test_features = _with_capacity(op, points.features[test], train_cache)
        predicted = test_features @ train_coefficients
        heldout = _heldout(train, test, predicted, points.seconds[test], COMPUTE_GOAL_MAPE)
        stability = stability_flags(_bootstrap_mapes(op, points, train, test), COMPUTE_GOAL_MAPE)
        heldout = heldout.model_copy(update=stability)
        fit = OpFit(
            device_type=device_type,
            op=op,
            dtype=dtype,
            emulation_slowdown=slowdown,
            features=points.feature_names,
            coefficients=tuple(float(c) for c in coefficients),
            points=len(points.seconds),
            fit_mape=_mape(features @ coefficients, points.seconds),
            size_range=(float(points.sizes.min()), float(points.sizes.max())),
            source_runs=points.runs,
            heldout=heldout,
            cache_bytes=cache_bytes,
            attention_kernel=points.kernel if op.startswith("attention") else None,
            **_gpu_fields(op, points),
        )
        fits.append((fit, dataclasses.replace(points, features=features)))
    return fits


def _gpu_fields(op: str, points: _Points) -> dict:
    """What a GPU fit's features need at prediction: the SM count (attention) and the roofline
    ridge (gemm), from the catalog at fit time; nothing for the CPU's features."""
    if points.feature_names == OP_FEATURES[op]:
        return {}
    traits = gpu_traits(points.device_type)
    if op == "gemm":
        return {"ridge_flops_per_byte": traits.ridge_flops_per_byte}
    return {"sm_count": traits.sm_count} if op.startswith("attention") else {}


def _fit_points(op: str, points: _Points, rows) -> tuple[np.ndarray, tuple | None, np.ndarray]:
    """Coefficients fitted on `rows` of the family, the cache capacities they use, and the
    family's features with those capacities (`fit_effective_capacity` for the CPU's cache
    terms; a GPU's L2 term takes the hardware's capacity)."""
    features, seconds = points.features[rows], points.seconds[rows]
    cpu_features = points.feature_names == OP_FEATURES[op]
    if op == "elementwise" and points.cache_bytes is not None and not cpu_features:
        bytes_moved, calls = features[:, 0], features[:, 1]
        coefficients, knee = fit_knee(
            features, seconds, bytes_moved / calls, calls, points.cache_bytes[0]
        )
        cache = (knee, points.cache_bytes[1])
        return coefficients, cache, _with_capacity(op, points.features, cache)
    if op not in CACHED_OPS or points.cache_bytes is None or not cpu_features:
        return fit_relative_nnls(features, seconds), points.cache_bytes, points.features
    calls, per_call = _calls_and_bytes_per_call(op, features)
    coefficients, cache = fit_effective_capacity(
        features, seconds, per_call, calls, points.cache_bytes, streaming=op in STREAMING_OPS
    )
    return coefficients, cache, _with_capacity(op, points.features, cache)


def _with_capacity(op: str, features: np.ndarray, cache: tuple | None) -> np.ndarray:
    """`features` with the cache terms taken at the capacities `cache` (CPU features), or a
    GPU's elementwise knee term at the knee `cache[0]`."""
    if cache is not None and op == "elementwise" and features.shape[1] == 3:
        return np.column_stack(gpu_memory_bound_features(features[:, 0], features[:, 1], cache[0]))
    if cache is None or op not in CACHED_OPS or features.shape[1] != len(OP_FEATURES[op]):
        return features
    calls, per_call = _calls_and_bytes_per_call(op, features)
    rebuilt = features.copy()
    rebuilt[:, -2], rebuilt[:, -1] = cache_terms(
        per_call * calls, calls, cache, streaming=op in STREAMING_OPS
    )
    return rebuilt


def _calls_and_bytes_per_call(op: str, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    names = OP_FEATURES[op]
    calls = features[:, names.index("calls")]
    return calls, features[:, names.index("bytes")] / calls


def _bootstrap_mapes(op: str, points: _Points, train: np.ndarray, test: np.ndarray) -> list:
    """The extrapolation error (on the test points) of fits to `BOOTSTRAP_RESAMPLES`
    resamples of the training points drawn with replacement (seeded by the family's size, so
    one profile always gives the same figures)."""
    rng = np.random.default_rng(len(points.seconds) * 7919 + len(train))
    mapes = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        rows = rng.choice(train, size=len(train), replace=True)
        coefficients, cache, _ = _fit_points(op, points, rows)
        predicted = _with_capacity(op, points.features[test], cache) @ coefficients
        mapes.append(_mape(predicted, points.seconds[test]))
    return mapes


def _heldout(
    train: np.ndarray,
    test: np.ndarray,
    predicted: np.ndarray,
    seconds: np.ndarray,
    goal: float,
) -> HeldOut:
    errors = relative_errors(predicted, seconds)
    mape = float(np.mean(errors))
    return HeldOut(
        train_points=len(train),
        test_points=len(test),
        extrapolation_mape=mape,
        extrapolation_max_error=float(np.max(errors)),
        extrapolation_bias=float(np.mean((predicted - seconds) / seconds)),
        **goal_flags(mape, goal),
    )


def _mape(predicted: np.ndarray, seconds: np.ndarray) -> float:
    return float(np.mean(relative_errors(predicted, seconds)))


def _with_lodo(fits: list[tuple[OpFit, _Points]]) -> list[tuple[OpFit, _Points]]:
    """Each 1x fit with its leave-one-device-type-out errors from every other profiled type."""
    real = [(fit, points) for fit, points in fits if fit.emulation_slowdown == 1.0]
    types = {fit.device_type for fit, _ in real}
    result = []
    for fit, points in fits:
        if fit.emulation_slowdown != 1.0:
            note = "n/a (emulated: see the emulation check)"
            result.append((_with_heldout(fit, lodo_note=note), points))
            continue
        references = [r for r, _ in real if r.op == fit.op and r.device_type != fit.device_type]
        peers = [r for r in references if _are_peers(fit, r)]
        lodo, note = _lodo_errors(fit, points, peers, len(types))
        if references and not peers:
            note = "n/a (no other GPU type profiled; a CPU is no peer for GPU ratios)"
            others = {_kernel(r) for r in references if _kernel(r) != _kernel(fit)}
            if others and all(_are_peers(fit, r, same_kernel=False) for r in references):
                note = f"n/a (other types profiled on another kernel: {', '.join(sorted(others))})"
        result.append((_with_heldout(fit, lodo=lodo, lodo_note=note), points))
    return result


def _are_peers(fit: OpFit, reference: OpFit, same_kernel: bool = True) -> bool:
    """Whether `reference`'s fit can stand for `fit`'s type by datasheet ratios: two GPU types
    with the same features (a CPU's achieved share of its peak says nothing of a GPU's) and,
    for attention, the same kernel (FlashAttention-2's rate says little of cuDNN's: 1.7-1.9x
    apart on one H100)."""
    gpus = "cpu" not in (fit.device_type, reference.device_type)
    kernels = not same_kernel or _kernel(fit) == _kernel(reference)
    return gpus and fit.features == reference.features and kernels


def _kernel(fit: OpFit) -> str | None:
    """The attention kernel a fit was profiled on, by its current name (None: not attention)."""
    kernel = fit.attention_kernel
    return LEGACY_KERNEL_NAMES.get(kernel, kernel) if kernel else None


def _lodo_errors(
    fit: OpFit, points: _Points, references: list[OpFit], type_count: int
) -> tuple[tuple[LodoError, ...], str]:
    if type_count < 2:
        return (), "n/a (one type profiled)"
    if not references:
        return (), f"n/a (no other type has {fit.op} fitted)"
    catalog = gpu_catalog()
    if fit.device_type not in catalog:
        return (), f"n/a ({fit.device_type} has no datasheet entry)"
    errors = []
    for reference in references:
        if reference.device_type not in catalog:
            continue
        ratio = achieved_rate(reference.device_type, fit.op) / achieved_rate(
            fit.device_type, fit.op
        )
        # the reference's coefficients with its own capacities (a GPU's elementwise knee)
        features = _with_capacity(fit.op, points.features, reference.cache_bytes)
        predicted = features @ np.array(reference.coefficients) * ratio
        errors.append(
            LodoError(reference=reference.device_type, mape=_mape(predicted, points.seconds))
        )
    note = "" if errors else "n/a (no other profiled type has a datasheet entry)"
    return tuple(errors), note


def achieved_rate(device_type: str, op: str) -> float:
    """The datasheet rate of `op` on `device_type`: FLOP/s (peak x published efficiency) for
    matmul and attention, bytes/s (HBM bandwidth) for elementwise. Ratios of these transfer a
    fit from one device type to another."""
    spec = gpu_catalog()[device_type]
    efficiency = {
        "gemm": spec.gemm_efficiency,
        "attention_fwd": spec.attention_fwd_efficiency,
        "attention_bwd": spec.attention_bwd_efficiency,
    }
    if op in efficiency:
        return spec.peak_flops * efficiency[op]
    return spec.hbm_GBps * 1e9


def _with_heldout(fit: OpFit, **changes) -> OpFit:
    return fit.model_copy(update={"heldout": fit.heldout.model_copy(update=changes)})


def _with_emulation_checks(fits: list[tuple[OpFit, _Points]]) -> list[OpFit]:
    """Emulated fits with their ratio to the 1x fit of the same device type, op and dtype."""
    base = {(f.device_type, f.op, f.dtype): f for f, _ in fits if f.emulation_slowdown == 1.0}
    result = []
    for fit, points in fits:
        reference = base.get((fit.device_type, fit.op, fit.dtype))
        if fit.emulation_slowdown == 1.0 or reference is None:
            result.append(fit)
            continue
        own = points.features @ np.array(fit.coefficients)
        real = points.features @ np.array(reference.coefficients)
        check = EmulationCheck(
            expected_ratio=fit.emulation_slowdown,
            time_ratio=float(np.median(own / real)),
            coefficient_ratios=tuple(
                a / b if b > 0 else None for a, b in zip(fit.coefficients, reference.coefficients)
            ),
        )
        result.append(fit.model_copy(update={"emulation_check": check}))
    return result


def _fit_link_families(families: dict[tuple, _Points]) -> list[LinkFit]:
    fits = []
    for (link_class, op), points in families.items():
        sizes, seconds = points.sizes, points.seconds
        regimes = fit_link(sizes, seconds)
        train, test = extrapolation_split(sizes)
        predicted = predict_link(fit_link(sizes[train], seconds[train]), sizes[test])
        fits.append(
            LinkFit(
                link_class=link_class,
                op=op,
                device_type=points.device_type,
                regimes=tuple(Regime(**vars(regime)) for regime in regimes),
                points=len(seconds),
                fit_mape=_mape(predict_link(regimes, sizes), seconds),
                size_range=(float(sizes.min()), float(sizes.max())),
                source_runs=points.runs,
                heldout=_heldout(train, test, predicted, seconds[test], LINK_GOAL_MAPE).model_copy(
                    update={"lodo_note": "n/a (links)"}
                ),
            )
        )
    return fits


def _describe_source(run: ProfileSource) -> SourceRun:
    return SourceRun(
        run_id=run.run_id,
        created_at=run.created_at,
        rows=len(run.measurements),
        ok_rows=sum(1 for m in run.measurements if _is_ok(m)),
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for package in ("hexiseq", "scikit-learn"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "unknown"
    return versions
