"""Profile views: measurements against the fitted curves, residuals, held-out errors."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from hexiseq.dashboard.views import profiles as views


def test_every_point_is_a_row_with_its_fitted_prediction(profile_points, fitted_document):
    frame = views.profile_frame(profile_points, fitted_document)
    assert len(frame) == len(profile_points)
    ok = frame[frame["status"] == "ok"]
    # The points are exactly linear in the features: the fit reproduces them.
    np.testing.assert_allclose(ok["predicted_s"], ok["measured_s"], rtol=1e-3)
    assert ok["relative_error"].abs().max() < 1e-3
    assert set(frame["family"]) == {"cpu gemm float32", "intra:cpu p2p"}
    oom = frame[frame["status"] == "oom"].iloc[0]
    assert pd.isna(oom["predicted_s"]) and pd.isna(oom["relative_error"])


def test_without_a_fit_there_is_no_prediction(profile_points):
    frame = views.profile_frame(profile_points, None)
    assert frame["predicted_s"].isna().all()
    figure = views.profile_figure(frame, "cpu gemm float32")
    assert [t.name for t in figure.data] == ["measured (median, p10-p90)"]


def test_profile_figure_draws_points_with_their_spread_and_the_curve(
    profile_points, fitted_document
):
    frame = views.profile_frame(profile_points, fitted_document)
    figure = views.profile_figure(frame, "cpu gemm float32")
    measured, fitted = figure.data
    gemm = sorted(
        (p for p in profile_points if p.op == "gemm" and p.status == "ok"), key=lambda p: p.flops
    )
    assert list(measured.x) == sorted(p.flops for p in gemm)
    np.testing.assert_allclose(measured.error_y.array, [0.1 * p.median_s for p in gemm])
    np.testing.assert_allclose(fitted.y, measured.y, rtol=1e-3)
    assert figure.layout.xaxis.type == "log" and figure.layout.xaxis.title.text == "FLOPs"


def test_residuals_are_in_percent(profile_points, fitted_document):
    frame = views.profile_frame(profile_points, fitted_document)
    figure = views.residuals_figure(frame, "intra:cpu p2p")
    assert len(figure.data[0].y) == 7
    np.testing.assert_allclose(
        figure.data[0].y, 100 * frame[frame["op"] == "p2p"]["relative_error"].to_numpy(dtype=float)
    )


def test_heldout_frame_lists_every_fit(fitted_document):
    frame = views.heldout_frame(fitted_document)
    assert list(frame["family"]) == ["cpu gemm float32", "intra:cpu p2p"]
    gemm = frame.iloc[0]
    assert gemm["points"] == 8
    assert gemm["extrapolation_error_pct"] == pytest.approx(
        100 * fitted_document.ops[0].heldout.extrapolation_mape
    )
    assert gemm["leave_one_type_out"]  # a figure, or why there is none


def test_memory_calibration_figure_draws_each_rank_against_the_model():
    from hexiseq.costmodel import MemoryFit, MemoryPoint
    from hexiseq.costmodel._fit_document import HeldOut
    from hexiseq.dashboard.views.profiles import memory_calibration_figure

    GiB = 2**30
    points = [MemoryPoint("cpu", "cpu_max_rss", dynamic * GiB, (0.5 + 1.5 * dynamic) * GiB, 1,
                          modelled_reserve_bytes=0.25 * GiB)
              for dynamic in (1.0, 2.0, 3.0)]  # fmt: skip
    fit = MemoryFit(device_type="cpu", memory_measure="cpu_max_rss", reserve_bytes=0.5 * GiB,
                    scale=1.5, points=3, fit_mape=0.0, size_range=(GiB, 3 * GiB),
                    heldout=HeldOut(train_points=2, test_points=1))  # fmt: skip
    figure = memory_calibration_figure(points, [fit], "cpu")
    measured, as_written, calibrated = figure.data
    assert list(measured.y) == [2.0, 3.5, 5.0]
    assert list(measured.x) == [1.25, 2.25, 3.25]  # + the model's 0.25 GiB CPU reserve
    assert list(as_written.x) == list(as_written.y)
    x, y = calibrated.x[-1], calibrated.y[-1]
    assert y == pytest.approx(0.5 + 1.5 * (x - 0.25))
    assert len(memory_calibration_figure(points, [], "cpu").data) == 2  # not calibrated yet
