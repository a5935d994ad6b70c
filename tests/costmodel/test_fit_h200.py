"""cuDNN attention's schedule, the elementwise knee, and the goals on the H200 profile.

`profiles/h200-2026-11-26/profile.db` is the committed compute profile of one H200 (bf16,
cuDNN attention, 215 points); the fits read a copy of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hexiseq.costmodel import FittedCostModel, fit_cost_model
from hexiseq.costmodel._features import measurement_features
from hexiseq.costmodel._gpu_features import GPU_OP_FEATURES, flash_schedule
from hexiseq.costmodel._regression import fit_knee
from hexiseq.profiles import attention_pairs

H200_PROFILE = Path(__file__).parents[2] / "profiles" / "h200-2026-11-26" / "profile.db"
SMS = 132


# --- cuDNN's schedule ------------------------------------------------------------------------


def test_cudnn_does_not_split_the_keys_of_a_short_query():
    # 8 heads x 4 query blocks: 32 CTAs on 132 SMs, each running all 256 key blocks, where
    # FlashAttention-2 would split the keys over more CTAs.
    cudnn = flash_schedule(512, 32768, 8, 64, False, False, SMS, cudnn=True)
    assert (cudnn.splits, cudnn.tile_rows, cudnn.tile_cols) == (1, 128, 128)
    assert cudnn.shared_tiles + cudnn.alone_tiles == 256
    assert cudnn.shared_tiles == pytest.approx(32 * 256 / SMS)  # the balanced share
    assert flash_schedule(512, 32768, 8, 64, False, False, SMS).splits > 1


def test_a_full_last_wave_leaves_no_tail_and_a_short_one_does():
    full = flash_schedule(128 * SMS, 1024, 1, 128, False, False, SMS, cudnn=True)
    assert (full.shared_tiles, full.alone_tiles) == (8, 0)
    short = flash_schedule(128 * (SMS + 1), 1024, 1, 128, False, False, SMS, cudnn=True)
    assert short.shared_tiles + short.alone_tiles == 16  # two rounds of 8 key blocks
    assert short.alone_tiles == pytest.approx(16 - (SMS + 1) * 8 / SMS)


def test_the_cudnn_backward_runs_over_key_blocks():
    # 32 K queries x 512 keys: 4 key blocks x 8 heads, each CTA running all 256 query blocks.
    schedule = flash_schedule(32768, 512, 8, 64, False, True, SMS, cudnn=True)
    assert schedule.shared_tiles + schedule.alone_tiles == 256
    assert schedule.critical_ctas == 1


# --- the elementwise knee --------------------------------------------------------------------


def _floor_rows(sizes, floor_s=15e-6, launch_s=6e-6, bytes_per_s=4.3e12):
    nbytes = np.asarray(sizes, dtype=np.float64)
    seconds = np.maximum(floor_s, launch_s + nbytes / bytes_per_s)
    features = np.column_stack([nbytes, np.ones_like(nbytes), np.zeros_like(nbytes)])
    return features, seconds


def test_a_knee_at_an_l2_past_the_floor_is_not_admissible():
    # The floor hides (15 - 6) us x 4.3 TB/s = 39 MB; a 60 MiB L2 knee would need a negative
    # launch time, so the knee goes near the floor's end, and the line above it extrapolates.
    sizes = [0.4e6, 6e6, 25e6, 100e6, 200e6]
    features, seconds = _floor_rows(sizes)
    coefficients, knee = fit_knee(features, seconds, features[:, 0], features[:, 1], 60 * 2**20)
    assert 25e6 <= knee <= 45e6
    assert coefficients[-1] * knee <= coefficients[1]
    big = 1.6e9
    predicted = coefficients @ [big, 1.0, big - knee]
    assert predicted == pytest.approx(6e-6 + big / 4.3e12, rel=0.05)


def test_the_l2_stays_the_knee_where_it_fits():
    sizes = np.geomspace(1e6, 3e9, 12)
    seconds = 2e-5 + sizes / 4e12 + np.maximum(sizes - 50 * 2**20, 0) / 3e12
    features = np.column_stack([sizes, np.ones_like(sizes), np.zeros_like(sizes)])
    _, knee = fit_knee(features, seconds, sizes, np.ones_like(sizes), 50 * 2**20)
    assert knee == 50 * 2**20


# --- the H200 profile ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h200_document(tmp_path_factory):
    from hexiseq.cli.fit import read_profile_sources
    from hexiseq.store import Store

    copy = tmp_path_factory.mktemp("h200") / "profile.db"
    shutil.copyfile(H200_PROFILE, copy)
    with Store.open(f"sqlite:///{copy}", create=False) as store:
        sources = read_profile_sources(store)
    return fit_cost_model(sources), sources


@pytest.mark.parametrize("op", ["attention_fwd", "attention_bwd"])
def test_cudnn_attention_on_the_h200_extrapolates_within_five_percent(h200_document, op):
    document, _ = h200_document
    (fit,) = [f for f in document.ops if f.op == op]
    assert fit.attention_kernel == "cudnn"
    assert fit.features == GPU_OP_FEATURES[op]
    assert fit.heldout.extrapolation_mape <= 0.05 and fit.heldout.goal_met
    assert fit.heldout.stable


def test_the_h200_elementwise_fit_is_honest_about_its_one_bandwidth_point(h200_document):
    # 6 points: the 4 fitted ones are 3 at the launch floor and 1 bound by HBM, so the knee
    # and the bandwidth hang on that one point: resamples without it miss, and the fit is
    # flagged unstable (`--cost-model auto` keeps the datasheet) even though it extrapolates.
    document, _ = h200_document
    (fit,) = [f for f in document.ops if f.op == "elementwise"]
    assert fit.heldout.extrapolation_mape <= 0.05
    assert fit.cache_bytes[0] < 60 * 2**20  # the knee left the L2 for the floor's end
    assert fit.heldout.stable is False


def test_the_fitted_model_prices_cudnn_attention_as_the_fit_saw_it(h200_document):
    document, sources = h200_document
    model = FittedCostModel(document)
    (fit,) = [f for f in document.ops if f.op == "attention_fwd"]
    row = next(
        m
        for source in sources
        for m in source.measurements
        if m.op == "attention_fwd" and m.params["q_len"] == 512 and m.params["kv_len"] == 32768
    )
    q, kv = row.params["q_len"], row.params["kv_len"]
    pairs = attention_pairs(q, kv, causal=bool(row.params["causal"]))
    expected = float(np.dot(fit.coefficients, measurement_features(row)))
    predicted = model.attention_time_s(
        "H200", pairs, row.params["heads"], row.params["head_dim"], backward=False,
        q_tokens=q, kv_tokens=kv, kernel="cudnn",
    )  # fmt: skip
    assert predicted == pytest.approx(expected, rel=1e-6)


def test_attention_fits_of_other_kernels_are_no_peers_for_leave_one_type_out(h200_document):
    from hexiseq.costmodel.fit import _are_peers

    document, _ = h200_document
    (fit,) = [f for f in document.ops if f.op == "attention_fwd"]
    assert fit.attention_kernel == "cudnn"
    flash_h100 = fit.model_copy(
        update={"device_type": "H100-SXM", "attention_kernel": "cuda_flash"}
    )
    cudnn_h100 = fit.model_copy(update={"device_type": "H100-SXM", "attention_kernel": "cudnn"})
    assert not _are_peers(fit, flash_h100)
    assert _are_peers(fit, flash_h100, same_kernel=False)
    assert _are_peers(fit, cudnn_h100)
