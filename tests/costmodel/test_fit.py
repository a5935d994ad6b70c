"""Fitting op-time regressions and link models: recovery, held-out splits, LODO, α–β links."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fit_cases import TrueDevice, compute_rows, link_rows, measurement

from hexiseq.costmodel import fit_cost_model
from hexiseq.costmodel._features import measurement_features
from hexiseq.costmodel._regression import fit_link, fit_relative_nnls, predict_link
from hexiseq.costmodel.fit import MIN_POINTS, achieved_rate, extrapolation_split

DEVICE = TrueDevice("cpu")


def _fits_by_op(document, device="cpu", slowdown=1.0):
    return {
        f.op: f
        for f in document.ops
        if f.device_type == device and f.emulation_slowdown == slowdown
    }


def test_exact_data_gives_back_the_coefficients():
    document = fit_cost_model(compute_rows(DEVICE, np.random.default_rng(0), noise=0.0))
    for op, fit in _fits_by_op(document).items():
        np.testing.assert_allclose(fit.coefficients, getattr(DEVICE, op), rtol=1e-6)
        assert fit.fit_mape < 1e-8


def test_two_percent_noise_recovers_the_dominant_coefficients_within_five_percent():
    # Tolerance: with 2 % lognormal noise on 13 to 36 points the error averages out to well
    # under 5 % on every coefficient whose term is at least half the time of some point.
    # A term that never dominates (attention's bytes, ~1e-3 of the time) is not identifiable
    # from times alone and is not checked; its effect on predictions is (fit_mape).
    rows = compute_rows(DEVICE, np.random.default_rng(1), noise=0.02)
    fits = _fits_by_op(fit_cost_model(rows))
    for op, fit in fits.items():
        true = np.array(getattr(DEVICE, op))
        features = np.array([measurement_features(r) for r in rows if r.op == op])
        shares = features * true / (features @ true)[:, None]
        dominant = shares.max(axis=0) >= 0.5
        assert dominant.sum() >= 2, op
        got = np.array(fit.coefficients)
        np.testing.assert_allclose(got[dominant], true[dominant], rtol=0.05, err_msg=op)
        assert min(fit.coefficients) >= 0.0
        assert fit.fit_mape < 0.03  # about the noise: 2 % x sqrt(2/pi) = 1.6 %


def test_coefficients_stay_non_negative_when_the_data_wants_a_negative_one():
    # Times that fall with bytes at fixed FLOPs: least squares would give bytes a negative
    # coefficient; the fit clamps it at 0 and puts the time on the other features.
    flops, nbytes = 1e9 * np.arange(1, 9), 1e6 * np.arange(10, 2, -1)
    seconds = 1e-12 * flops - 1e-11 * nbytes
    rows = [
        measurement("cpu", "gemm", {"i": i}, f, b, t)
        for i, (f, b, t) in enumerate(zip(flops, nbytes, seconds))
    ]
    (fit,) = fit_cost_model(rows).ops
    assert min(fit.coefficients) >= 0.0
    assert fit.coefficients[1] == 0.0


def test_relative_loss_weighs_small_points_like_large_ones():
    features = np.array([[1.0, 1.0], [1e6, 1.0], [2e6, 1.0], [4e6, 1.0]])
    seconds = features @ np.array([1e-9, 1e-4])
    seconds[0] *= 1.5  # a 50 % outlier at the small end must not be ignored: it moves `c`
    coefficients = fit_relative_nnls(features, seconds)
    assert coefficients[1] > 1.05e-4


def test_extrapolation_split_puts_the_largest_third_in_the_test_set():
    sizes = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0])
    train, test = extrapolation_split(sizes)
    assert sorted(sizes[test]) == [7.0, 8.0, 9.0]
    assert max(sizes[train]) <= min(sizes[test])
    assert len(train) + len(test) == len(sizes)


def test_extrapolation_error_is_measured_on_the_largest_third():
    rows = compute_rows(DEVICE, np.random.default_rng(2), noise=0.0)
    gemm = [r for r in rows if r.op == "gemm"]
    largest = sorted(gemm, key=lambda r: r.flops)[-(len(gemm) // 3) :]
    # Make only the largest third 10 % slower: the extrapolation error sees exactly that,
    # while a fit on the small two thirds alone is unaffected.
    slower = {id(r) for r in largest}
    rows = [dataclasses.replace(r, median_s=r.median_s * 1.1) if id(r) in slower else r
            for r in rows]  # fmt: skip
    fit = _fits_by_op(fit_cost_model(rows))["gemm"]
    assert fit.heldout.test_points == len(largest)
    assert fit.heldout.extrapolation_mape == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert fit.heldout.extrapolation_max_error == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert fit.heldout.extrapolation_bias == pytest.approx(-0.1 / 1.1, rel=1e-6)  # too fast


def test_held_out_points_do_not_influence_the_held_out_fit():
    rows = [r for r in compute_rows(DEVICE, np.random.default_rng(3)) if r.op == "elementwise"]
    _, test = extrapolation_split(np.array([r.bytes_moved for r in rows]))
    first = _fits_by_op(fit_cost_model(rows))["elementwise"].heldout
    # Perturb only the test points by known factors; the model fitted on the train points
    # is unchanged, so each test error moves by exactly what was done to its point.
    factors = np.linspace(1.2, 2.0, len(test))
    perturbed = list(rows)
    for index, factor in zip(test, factors):
        perturbed[index] = dataclasses.replace(rows[index], median_s=rows[index].median_s * factor)
    train_only = _heldout_predictions(rows, test)
    np.testing.assert_allclose(train_only, _heldout_predictions(perturbed, test), rtol=0, atol=0)
    second = _fits_by_op(fit_cost_model(perturbed))["elementwise"].heldout
    assert second.extrapolation_mape != first.extrapolation_mape


def _heldout_predictions(rows, test) -> np.ndarray:
    """What the extrapolation fit (train points only) predicts for the test points."""
    features = np.array([measurement_features(r) for r in rows])
    seconds = np.array([r.median_s for r in rows])
    train = np.setdiff1d(np.arange(len(rows)), test)
    return features[test] @ fit_relative_nnls(features[train], seconds[train])


def test_too_few_points_are_skipped_with_a_reason():
    rows = [r for r in compute_rows(DEVICE, np.random.default_rng(4)) if r.op == "gemm"]
    failed = dataclasses.replace(rows[0], status="oom", median_s=None)
    document = fit_cost_model(rows[: MIN_POINTS - 1] + [failed] * 3)
    assert document.ops == ()
    (skipped,) = document.skipped
    assert skipped.what == "cpu gemm float32 1x"
    assert f"{MIN_POINTS - 1} ok points" in skipped.reason


def test_leave_one_device_type_out_transfers_by_datasheet_ratios():
    # Two synthetic types whose true coefficients differ exactly by the datasheet ratio of
    # achieved GEMM rates: the transfer must predict the held-out type within the noise.
    rng = np.random.default_rng(5)
    ratio = achieved_rate("A100-80G", "gemm") / achieved_rate("H100-SXM", "gemm")
    h100 = TrueDevice("H100-SXM", gemm=tuple(c / 1000 for c in DEVICE.gemm))
    a100 = TrueDevice("A100-80G", gemm=tuple(c / 1000 / ratio for c in DEVICE.gemm))
    rows = [r for d in (h100, a100) for r in compute_rows(d, rng, dtype="bfloat16")]
    document = fit_cost_model(rows)
    a100_gemm = _fits_by_op(document, "A100-80G")["gemm"]
    (lodo,) = a100_gemm.heldout.lodo
    assert lodo.reference == "H100-SXM"
    assert lodo.mape < 0.04
    # Attention did not follow the datasheet ratio in this data: the transfer shows it.
    a100_attention = _fits_by_op(document, "A100-80G")["attention_fwd"]
    assert a100_attention.heldout.lodo[0].mape > 0.2


def test_one_profiled_type_has_no_lodo():
    document = fit_cost_model(compute_rows(DEVICE, np.random.default_rng(6)))
    for fit in document.ops:
        assert fit.heldout.lodo == ()
        assert fit.heldout.lodo_note == "n/a (one type profiled)"


def test_emulated_fit_is_checked_against_the_real_one():
    rng = np.random.default_rng(7)
    rows = compute_rows(DEVICE, rng) + compute_rows(DEVICE, rng, slowdown=2.0)
    emulated = _fits_by_op(fit_cost_model(rows), slowdown=2.0)["gemm"]
    assert emulated.emulation_check.expected_ratio == 2.0
    assert emulated.emulation_check.time_ratio == pytest.approx(2.0, rel=0.03)


def test_link_fit_recovers_alpha_and_beta():
    rows = link_rows("intra:cpu", 5e-5, 2.0, np.random.default_rng(8), noise=0.0)
    (fit,) = fit_cost_model(rows).links
    (regime,) = fit.regimes
    assert regime.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert 1 / (regime.seconds_per_byte * 1e9) == pytest.approx(2.0, rel=1e-6)


def test_link_fit_finds_a_knee_and_stays_monotone():
    rng = np.random.default_rng(9)
    rows = link_rows("inter", 2e-5, 1.0, rng, knee=(2**16, 2e-4, 3.0))
    (fit,) = fit_cost_model(rows).links
    assert [regime.from_bytes for regime in fit.regimes] == [0.0, 2.0**16]
    assert 1 / (fit.regimes[-1].seconds_per_byte * 1e9) == pytest.approx(3.0, rel=0.05)
    sizes = np.geomspace(1, 2**28, 2000)
    seconds = predict_link(fit.regimes, sizes)
    assert np.all(np.diff(seconds) >= 0)
    assert all(r.latency_s >= 0 and r.seconds_per_byte >= 0 for r in fit.regimes)


def test_a_straight_line_gets_no_knee():
    rows = link_rows("inter", 2e-5, 1.0, np.random.default_rng(10))
    (fit,) = fit_cost_model(rows).links
    assert len(fit.regimes) == 1


def test_monotone_at_a_knee_where_the_second_line_starts_lower():
    # A protocol twice as fast per byte from 1 MiB on, so a 1 MiB message is measured 20 %
    # faster than a 0.9 MiB one would be: the model must not predict such a drop.
    sizes = np.array([2.0**e for e in range(10, 27)])
    seconds = np.where(sizes < 2**20, 1e-5 + sizes / 1e9, 3e-4 + sizes / 2e9)
    regimes = fit_link(sizes, seconds)
    assert len(regimes) == 2
    assert np.all(np.diff(predict_link(regimes, np.geomspace(1e3, 1e8, 4000))) >= 0)


def test_three_regimes_of_a_loopback_link_are_found_and_extrapolate():
    # Latency-bound small messages (0.3 GB/s), 1.6 GB/s while the buffers fit a cache, 1.2
    # GB/s from 8 MiB on; sizes as benchmarks/grids/costmodel_cpu.yaml places them, each in
    # both ring directions: two knees, and the largest third predicted within the noise.
    rng = np.random.default_rng(11)
    sizes = [2**e for e in range(10, 23, 2)] + [2**e * m for e in range(23, 30) for m in (1, 1.5)]
    rows = []
    for size, direction in ((s, d) for s in sizes[:-1] for d in ("next", "prev")):
        if size < 2**18:
            true_s = 1.5e-4 + size / 0.3e9
        elif size < 2**23:
            true_s = 2.4e-4 + size / 1.6e9
        else:
            true_s = size / 1.2e9
        seconds = true_s * float(np.exp(rng.normal(0.0, 0.02)))
        params = {"world": 2, "message_bytes": int(size), "direction": direction}
        rows.append(measurement("cpu", "p2p", params, 0.0, float(size), seconds,
                                link_class="intra:cpu"))  # fmt: skip
    (fit,) = fit_cost_model(rows).links
    knees = [regime.from_bytes for regime in fit.regimes]
    assert len(knees) == 3 and 2**16 <= knees[1] <= 2**18 and 2**22 <= knees[2] <= 2**23
    assert 1 / (fit.regimes[-1].seconds_per_byte * 1e9) == pytest.approx(1.2, rel=0.05)
    assert fit.heldout.extrapolation_mape < 0.05
    few = rows[:6]  # too few points for a knee: one line
    assert (
        len(fit_link(np.array([r.bytes_moved for r in few]), np.array([r.median_s for r in few])))
        == 1
    )
