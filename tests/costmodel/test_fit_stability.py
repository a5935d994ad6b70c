"""How stable a fit is (`HeldOut.bootstrap_mape_p10/p90`, `stable`): fits to resamples of the
training points, held to twice the goal; `--cost-model auto` leaves an unstable fit to the
datasheet (and says so), `--cost-model fitted` forces it (and says so)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fit_cases import TrueDevice, compute_rows

from hexiseq.costmodel import (
    DatasheetCostModel,
    FittedCostModel,
    ProfileSource,
    fit_cost_model,
    format_heldout_table,
)


def _fit(rows) -> FittedCostModel:
    return FittedCostModel(fit_cost_model([ProfileSource(3, "2026-11-22T10:00:00+00:00", rows)]))


@pytest.fixture(scope="module")
def clean():
    return _fit(compute_rows(TrueDevice("cpu"), np.random.default_rng(0), noise=0.01))


def _with_outliers(rows, op: str, factor: float, every: int):
    """Every `every`-th point of `op` below the top third of sizes timed `factor` x slower."""
    chosen = [r for r in rows if r.op == op]
    cutoff = np.quantile([r.flops for r in chosen], 2 / 3)
    out, seen = [], 0
    for row in rows:
        if row.op == op and row.flops < cutoff:
            seen += 1
            if seen % every == 0:
                row = dataclasses.replace(row, median_s=row.median_s * factor)
        out.append(row)
    return out


def test_a_fit_of_clean_points_is_stable(clean):
    for fit in clean.document.ops:
        heldout = fit.heldout
        assert 0 <= heldout.bootstrap_mape_p10 <= heldout.bootstrap_mape_p90 < 0.05, fit.op
        assert heldout.stable is True
    assert all(link.heldout.stable is None for link in clean.document.links)


def test_a_fit_that_hangs_on_a_few_points_is_unstable_and_left_to_the_datasheet(clean):
    rows = compute_rows(TrueDevice("cpu"), np.random.default_rng(0), noise=0.01)
    shaky = _fit(_with_outliers(rows, "gemm", factor=6.0, every=3))
    (gemm,) = [f for f in shaky.document.ops if f.op == "gemm"]
    (clean_gemm,) = [f for f in clean.document.ops if f.op == "gemm"]
    spread = gemm.heldout.bootstrap_mape_p90 - gemm.heldout.bootstrap_mape_p10
    clean_spread = clean_gemm.heldout.bootstrap_mape_p90 - clean_gemm.heldout.bootstrap_mape_p10
    assert spread > 5 * clean_spread and gemm.heldout.stable is False
    assert shaky.gemm_time_s("cpu", 1e9) == DatasheetCostModel().gemm_time_s("cpu", 1e9)
    assert "gemm: datasheet — fit " in shaky.label("cpu")
    assert "UNSTABLE" in format_heldout_table(shaky.document) or (
        "MISSED" in format_heldout_table(shaky.document)
    )


def test_auto_refuses_an_unstable_fit_that_met_its_goal_and_fitted_forces_it(clean):
    raw = json.loads(clean.to_json())
    for fit in raw["ops"]:
        if fit["op"] == "attention_fwd":
            fit["heldout"].update(bootstrap_mape_p90=0.31, stable=False)
    text = json.dumps(raw)
    auto, forced = FittedCostModel.from_json(text), FittedCostModel.from_json(text, forced=True)
    datasheet = DatasheetCostModel()
    args = (np.array([1e6, 4e8]), 8, 64)
    assert np.array_equal(
        auto.attention_time_s("cpu", *args, backward=False),
        datasheet.attention_time_s("cpu", *args, backward=False),
    )
    assert np.array_equal(
        forced.attention_time_s("cpu", *args, backward=False),
        clean.attention_time_s("cpu", *args, backward=False),
    )
    note = "attention_fwd: datasheet — fit is unstable, bootstrap p90 31 % > 2 x 5 %"
    assert note in auto.label("cpu")
    assert "attention_fwd: fit forced by --cost-model fitted though it is unstable" in (
        forced.label("cpu")
    )
    table = format_heldout_table(auto.document)
    assert "cpu attention_fwd float32: unstable, bootstrap p90 31.0 % > 2 x 5 %" in table


def test_a_document_from_before_stability_reads_with_none(clean):
    raw = json.loads(clean.to_json())
    raw["schema_version"] = 4
    for fit in raw["ops"]:
        for key in ("bootstrap_mape_p10", "bootstrap_mape_p90", "stable"):
            del fit["heldout"][key]
    model = FittedCostModel.from_json(json.dumps(raw))
    assert all(fit.heldout.stable is None for fit in model.document.ops)
    assert model.gemm_time_s("cpu", 1e9) == clean.gemm_time_s("cpu", 1e9)
