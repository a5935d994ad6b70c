"""The JSON document of a fitted cost model: every coefficient plus what it was fitted from.

Validated by pydantic on the way in, so a corrupt or hand-edited document is refused with one
line naming the field (`parse_fitted_document`). Times are seconds, bytes are bytes, errors
are fractions (0.05 = 5 %). Never pickle (docs/design.md §6).
"""

from __future__ import annotations

import json
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hexiseq._yaml import format_validation_error
from hexiseq.costmodel._features import FEATURE_SETS, LEGACY_OP_FEATURES, OP_FEATURES
from hexiseq.errors import InputError
from hexiseq.profiles import COMPUTE_OPS, LINK_OPS

DOCUMENT_FORMAT = "hexiseq.fitted_cost_model"
DOCUMENT_SCHEMA_VERSION = 5
"""2 added the cache terms (gemm, elementwise), `cache_bytes` and `attention_kernel`; 3 added
the memory calibrations (`memory`); 4 added the GPU feature sets (`sm_count`,
`ridge_flops_per_byte`) and each held-out error's goal (`goal_mape`, `goal_met`); 5 added each
compute fit's stability (`bootstrap_mape_p10`, `bootstrap_mape_p90`, `stable`). Version 1
documents are still read, their fits upgraded to today's features (cache terms 0); versions
1 and 2 have no memory calibration; fits of versions 1 to 3 get their goal flags on reading,
from the extrapolation error they carry."""

COMPUTE_GOAL_MAPE = 0.05
"""Goal for the extrapolation error of compute ops (docs/design.md §6, issue 5): 5 %."""
LINK_GOAL_MAPE = 0.10
"""Goal for the extrapolation error of links: 10 %."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LodoError(_Strict):
    """Leave-one-device-type-out: this fit's points predicted from `reference`'s fit scaled by
    the datasheet ratio of achieved rates (peak x efficiency, or HBM bandwidth)."""

    reference: str
    mape: float = Field(ge=0)


class HeldOut(_Strict):
    """Held-out errors of one fit (docs/design.md §6)."""

    train_points: int = Field(ge=0)
    """Extrapolation: the smallest two thirds of the points by size, fitted ..."""
    test_points: int = Field(ge=0)
    """... and the largest third, predicted."""
    extrapolation_mape: float | None = Field(default=None, ge=0)
    extrapolation_max_error: float | None = Field(default=None, ge=0)
    extrapolation_bias: float | None = None
    """Mean signed relative error (prediction − measured) / measured on the test points: near
    −MAPE when the largest sizes are systematically slower than the small ones predict."""
    lodo: tuple[LodoError, ...] = ()
    lodo_note: str = ""
    """Why there is no LODO figure, e.g. "n/a (one type profiled)"."""
    goal_mape: float | None = Field(default=None, gt=0)
    """The goal for `extrapolation_mape` (5 % compute, 10 % links); None: no goal (memory)."""
    goal_met: bool | None = None
    """`extrapolation_mape` <= `goal_mape`; False: `--cost-model auto` does not use the fit
    (the datasheet stands in for it); None: no goal, or no extrapolation error."""
    bootstrap_mape_p10: float | None = Field(default=None, ge=0)
    """Stability: the extrapolation error of fits to resamples of the training points (drawn
    with replacement, `BOOTSTRAP_RESAMPLES` of them), 10th percentile ..."""
    bootstrap_mape_p90: float | None = Field(default=None, ge=0)
    """... and 90th: a wide spread means the fit hangs on a few points and a new profile of
    the same device may well fit otherwise."""
    stable: bool | None = None
    """`bootstrap_mape_p90` <= `STABILITY_FACTOR` x `goal_mape`; False: `--cost-model auto`
    does not use the fit either; None: not measured (links, memory, documents before it)."""


class EmulationCheck(_Strict):
    """An emulated slow device's fit against the 1x fit of the same device, op and dtype:
    both ratios should be close to the slowdown if the emulation pads compute faithfully."""

    expected_ratio: float = Field(gt=0)
    time_ratio: float = Field(ge=0)
    """Median over this fit's points of its prediction / the 1x fit's prediction."""
    coefficient_ratios: tuple[float | None, ...]
    """Coefficient by coefficient (None where the 1x coefficient is 0)."""


class OpFit(_Strict):
    """time = Σ coefficient x feature for one (device type, op family, dtype, slowdown)."""

    device_type: str = Field(min_length=1)
    op: Literal[COMPUTE_OPS]  # type: ignore[valid-type]
    dtype: str
    emulation_slowdown: float = Field(ge=1.0)
    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    points: int = Field(ge=1)
    fit_mape: float = Field(ge=0)
    size_range: tuple[float, float]
    """Smallest and largest size fitted (FLOPs, or bytes for elementwise)."""
    source_runs: tuple[int, ...] = ()
    heldout: HeldOut
    emulation_check: EmulationCheck | None = None
    cache_bytes: tuple[float, float] | None = None
    """(L2, last-level cache) capacity in bytes that the cache terms use: the profiled
    device's as the profiler read them, or the smaller effective ones the fit found in the
    points (`fit_effective_capacity`); None: unknown, cache terms 0."""
    attention_kernel: str | None = None
    """The attention kernel profiled (e.g. `cpu_flash`): its tiles decide the masked FLOPs."""
    sm_count: int | None = Field(default=None, ge=1)
    """GPU features: the SMs the thread blocks were scheduled over (catalog, at fit time)."""
    ridge_flops_per_byte: float | None = Field(default=None, gt=0)
    """GPU features: the roofline ridge (datasheet peak FLOP/s / HBM bytes/s) of the GEMM's
    bytes-beyond-the-ridge term."""

    @model_validator(mode="after")
    def _features_match_op(self) -> OpFit:
        allowed = FEATURE_SETS[self.op]
        if self.features not in allowed:
            choices = " or ".join(str(list(names)) for names in allowed)
            raise ValueError(f"features of {self.op} must be {choices}")
        gpu = self.features != OP_FEATURES[self.op]
        if gpu and self.op == "gemm" and self.ridge_flops_per_byte is None:
            raise ValueError("a GPU gemm fit needs ridge_flops_per_byte")
        if gpu and self.op.startswith("attention") and self.sm_count is None:
            raise ValueError("a GPU attention fit needs sm_count")
        if len(self.coefficients) != len(self.features) or min(self.coefficients) < 0:
            raise ValueError(f"needs {len(self.features)} coefficients, all >= 0")
        return self


class Regime(_Strict):
    """One α–β line of a link model, used from `from_bytes` upwards."""

    from_bytes: float = Field(ge=0)
    latency_s: float = Field(ge=0)
    seconds_per_byte: float = Field(ge=0)


class LinkFit(_Strict):
    """α + bytes/β per size regime for one (link class, op)."""

    link_class: str = Field(min_length=1)
    op: Literal[LINK_OPS]  # type: ignore[valid-type]
    device_type: str
    regimes: tuple[Regime, ...] = Field(min_length=1)
    points: int = Field(ge=1)
    fit_mape: float = Field(ge=0)
    size_range: tuple[float, float]
    source_runs: tuple[int, ...] = ()
    heldout: HeldOut

    @model_validator(mode="after")
    def _regimes_in_order(self) -> LinkFit:
        starts = [regime.from_bytes for regime in self.regimes]
        if starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError("regimes must start at from_bytes 0 and increase")
        return self


class MemoryFit(_Strict):
    """The memory model calibrated against measured peaks for one device type: measured ≈
    `reserve_bytes` + `scale` x (modelled peak - modelled reserve)."""

    device_type: str = Field(min_length=1)
    memory_measure: Literal["cuda_max_allocated", "cpu_max_rss"]
    reserve_bytes: float = Field(ge=0)
    scale: float = Field(ge=0)
    points: int = Field(ge=1)
    fit_mape: float = Field(ge=0)
    size_range: tuple[float, float]
    """Smallest and largest modelled peak (without reserve) of the points, bytes."""
    source_runs: tuple[int, ...] = ()
    """The runtime runs (`hexiseq run`) the points came from."""
    heldout: HeldOut


class SourceRun(_Strict):
    """A profile run the fit read (run_id None: measurements given without a run)."""

    run_id: int | None
    created_at: str | None
    rows: int = Field(ge=0)
    ok_rows: int = Field(ge=0)


class Skipped(_Strict):
    """A family that was not fitted, and why (its device type falls back to the datasheet)."""

    what: str
    reason: str


class FittedDocument(_Strict):
    """The whole fit session: every fit, where the points came from, what was skipped."""

    format: Literal["hexiseq.fitted_cost_model"] = DOCUMENT_FORMAT
    schema_version: Literal[1, 2, 3, 4, 5] = DOCUMENT_SCHEMA_VERSION
    created_at: str
    versions: dict[str, str]
    loss: str
    sources: tuple[SourceRun, ...]
    ops: tuple[OpFit, ...]
    links: tuple[LinkFit, ...]
    memory: tuple[MemoryFit, ...] = ()
    skipped: tuple[Skipped, ...] = ()


def parse_fitted_document(text: str, source: str = "fitted model") -> FittedDocument:
    """Read a fitted-model JSON document; InputError (one line) if it is not a valid one."""
    try:
        raw = json.loads(text)
    except (TypeError, json.JSONDecodeError) as error:
        raise InputError(f"{source}: not valid JSON: {error}") from None
    if not isinstance(raw, dict) or raw.get("format") != DOCUMENT_FORMAT:
        raise InputError(f"{source}: not a hexiseq fitted cost model (format {DOCUMENT_FORMAT})")
    try:
        return FittedDocument.model_validate(_upgraded(raw))
    except ValidationError as error:
        raise InputError(format_validation_error(error, source)) from None


def _upgraded(raw: dict) -> dict:
    """An older document in today's form: schema-1 fits with the cache terms (`_with_cache_
    terms`), schema 1-3 fits with their goal flags (`_with_goals`)."""
    return _with_goals(_with_cache_terms(raw))


def _with_goals(raw: dict) -> dict:
    """Fits of schema 1-3 with `goal_mape` and `goal_met` from the error they carry, so an
    older fit that missed its goal is not used silently either."""
    if raw.get("schema_version") not in (1, 2, 3):
        return raw
    upgraded = dict(raw)
    for key, goal in (("ops", COMPUTE_GOAL_MAPE), ("links", LINK_GOAL_MAPE)):
        if isinstance(raw.get(key), list):
            upgraded[key] = [_fit_with_goal(fit, goal) for fit in raw[key]]
    return upgraded


def _fit_with_goal(fit, goal: float):
    heldout = fit.get("heldout") if isinstance(fit, dict) else None
    if not isinstance(heldout, dict) or "goal_mape" in heldout:
        return fit  # malformed (left for validation to name) or already flagged
    return {**fit, "heldout": {**heldout, **goal_flags(heldout.get("extrapolation_mape"), goal)}}


BOOTSTRAP_RESAMPLES = 40
"""Resamples of a compute fit's training points behind its stability figures."""
STABILITY_FACTOR = 2.0
"""A fit is stable when 9 of 10 resampled fits extrapolate within this many times its goal."""


def stability_flags(bootstrap_mapes, goal: float) -> dict:
    """The bootstrap's p10 and p90 extrapolation errors and whether the fit is stable."""
    if len(bootstrap_mapes) == 0:
        return {}
    p10, p90 = (float(np.percentile(bootstrap_mapes, q)) for q in (10, 90))
    return {
        "bootstrap_mape_p10": p10,
        "bootstrap_mape_p90": p90,
        "stable": bool(p90 <= STABILITY_FACTOR * goal),
    }


def goal_flags(extrapolation_mape, goal: float) -> dict:
    """{"goal_mape": goal, "goal_met": mape <= goal} (goal_met None without a number)."""
    number = isinstance(extrapolation_mape, (int, float)) and not isinstance(
        extrapolation_mape, bool
    )
    return {"goal_mape": goal, "goal_met": bool(extrapolation_mape <= goal) if number else None}


def _with_cache_terms(raw: dict) -> dict:
    """A schema-1 document with its gemm / elementwise fits in today's features: the cache
    terms appended with coefficient 0 (no capacities known), so it predicts as it did and
    every reader sees one feature list per op."""
    if raw.get("schema_version") != 1 or not isinstance(raw.get("ops"), list):
        return raw
    ops = []
    for fit in raw["ops"]:
        legacy = LEGACY_OP_FEATURES.get(fit.get("op")) if isinstance(fit, dict) else None
        if legacy is not None and tuple(fit.get("features", ())) == legacy:
            added = len(OP_FEATURES[fit["op"]]) - len(legacy)
            fit = {**fit, "features": list(OP_FEATURES[fit["op"]])}
            fit["coefficients"] = [*_raw_list(fit.get("coefficients")), *[0.0] * added]
        ops.append(fit)
    return {**raw, "ops": ops}


def _raw_list(value) -> list:
    """`value` as a list (a malformed one is left for validation to name)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def dump_fitted_document(document: FittedDocument) -> str:
    """The document as JSON text (keys sorted, indented); `parse_fitted_document` reads it
    back to an equal document."""
    return json.dumps(document.model_dump(mode="json"), indent=2, sort_keys=True)
