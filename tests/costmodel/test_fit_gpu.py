"""GPU-shaped features: FlashAttention-2's schedule over the SMs, the GEMM roofline and L2
terms, their recovery from synthetic data, and the goals on the shared H100 profile.

`data/h100_profile.json` holds the compute rows of the shared real-GPU store
(`../shared/data/h100-profile.db`: 358 bf16 points on one H100 80GB HBM3), extracted as JSON
(op, params, dtype, FLOPs, bytes, median / p10 / p90 seconds, samples, the kernel and cache
sizes of `extra`), so that CI, which has no shared folder, fits the real data too.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np
import pytest
from fit_cases import measurement

from hexiseq.costmodel import FittedCostModel, ProfileSource, fit_cost_model
from hexiseq.costmodel._features import OP_FEATURES, feature_names, measurement_features
from hexiseq.costmodel._gpu_features import (
    GPU_OP_FEATURES,
    critical_slot,
    flash_schedule,
    forward_splits,
    gpu_traits,
)
from hexiseq.costmodel._regression import extrapolation_split, fit_relative_nnls
from hexiseq.profiles import ProfileMeasurement

H100_PROFILE = Path(__file__).with_name("data") / "h100_profile.json"
SMS = 132


def h100_sources() -> list[ProfileSource]:
    """The shared H100 profile's compute rows, one source per profile run."""
    document = json.loads(H100_PROFILE.read_text())
    runs: dict[int, list[ProfileMeasurement]] = {}
    for row in document["rows"]:
        runs.setdefault(row["run"], []).append(
            ProfileMeasurement(
                device_type=document["device_type"],
                op=row["op"],
                params=row["params"],
                dtype=row["dtype"],
                flops=row["flops"],
                bytes_moved=row["bytes_moved"],
                status=row["status"],
                median_s=row["median_s"],
                p10_s=row["p10_s"],
                p90_s=row["p90_s"],
                samples=row["samples"],
                device_name=document["device_name"],
                torch_version=document["torch_version"],
                extra=row["extra"],
            )  # fmt: skip
        )
    return [ProfileSource(run, document["runs"][str(run)], rows) for run, rows in runs.items()]


# --- the schedule ----------------------------------------------------------------------------


def test_one_cta_more_than_the_sms_takes_a_second_wave():
    # Backward, head_dim 128: 64 x 128 tiles, 8 warps, one CTA per SM; one CTA per key block.
    one_wave = flash_schedule(4096, 128 * SMS, 1, 128, False, True, SMS)
    two_waves = flash_schedule(4096, 128 * (SMS + 1), 1, 128, False, True, SMS)
    assert (one_wave.alone_tiles, one_wave.critical_ctas) == (4096 // 64, 1)
    assert (two_waves.alone_tiles, two_waves.critical_ctas) == (2 * 4096 // 64, 2)
    assert one_wave.shared_tiles == two_waves.shared_tiles == 0


def test_forward_ctas_share_an_sm_only_beyond_one_per_sm():
    # Forward, head_dim 128: 128 x 64 tiles, two CTAs per SM; 128 rows per CTA.
    alone = flash_schedule(128 * SMS, 4096, 1, 128, False, False, SMS)
    shared = flash_schedule(128 * (SMS + 1), 4096, 1, 128, False, False, SMS)
    assert (alone.shared_tiles, alone.alone_tiles) == (0, 4096 // 64)
    assert (shared.shared_tiles, shared.alone_tiles) == (4096 // 64, 0)


def test_the_causal_schedule_is_the_greedy_list_schedule():
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 40, size=700)
    shared, alone, ctas = critical_slot(tiles, 10, 2)
    heap, ends, counts = [(0, s) for s in range(20)], [0] * 20, [0] * 20
    for work in tiles:  # brute force: every CTA to the first free slot
        end, slot = heapq.heappop(heap)
        ends[slot], counts[slot] = end + work, counts[slot] + 1
        heapq.heappush(heap, (end + work, slot))
    critical = int(np.argmax(ends))
    assert shared + alone == ends[critical] and ctas == counts[critical]
    assert shared == min(ends[critical], ends[(critical + 10) % 20])


def test_a_causal_mask_skips_the_blocks_above_the_diagonal():
    # Backward, head_dim 64: 128 x 128 tiles, one CTA per key block; 1024 tokens: 8 x 8.
    full = flash_schedule(1024, 1024, 1, 64, False, True, SMS)
    causal = flash_schedule(1024, 1024, 1, 64, True, True, SMS)
    # Alone on their SMs: the first key block's CTA sees every query block either way.
    assert full.alone_tiles == causal.alone_tiles == 8
    # 132 heads: 1056 CTAs over 132 SMs; causal ones run 8, 7, ..., 1 tiles (36 per head),
    # so the critical slot runs fewer tiles than unmasked, at least the even share.
    full = flash_schedule(1024, 1024, SMS, 64, False, True, SMS)
    causal = flash_schedule(1024, 1024, SMS, 64, True, True, SMS)
    assert full.alone_tiles == 64
    assert 36 <= causal.alone_tiles < 48


def test_the_split_heuristic_matches_flash_attentions_comment():
    # flash_api.cpp: "batch * n_heads = 48 and we have 108 SMs, having 2 splits (efficiency
    # = 0.89) is better than having 3 splits (efficiency = 0.67)" -- 108 slots = 54 SMs x 2.
    assert forward_splits(64, 64 * 128, 48, 128, 54) == 2
    assert forward_splits(64 * 64, 64 * 128, 48, 128, 54) == 1  # blocks fill the slots


# --- synthetic recovery ----------------------------------------------------------------------

TRUE_ATTENTION = (6e-13, 3.5e-13, 3e-11, 2e-7, 3e-13, 3e-5)
"""s per shared FLOP, per alone FLOP, per pair, per CTA, per byte, per call (critical slot)."""


def _synthetic_attention_rows(noise: float, rng: np.random.Generator):
    rows = []
    for q_len in (256, 512, 1024, 2048, 4096, 8192, 16384):
        for kv_len, heads, head_dim, causal in [
            (q_len, 8, 128, True), (q_len, 16, 64, False), (2 * q_len, 4, 128, False),
            (max(q_len // 4, 256), 12, 128, False),
        ]:  # fmt: skip
            params = {"q_len": q_len, "kv_len": kv_len, "heads": heads, "head_dim": head_dim,
                      "causal": causal}  # fmt: skip
            row = measurement("H100-SXM", "attention_fwd", params, 4.0 * head_dim * heads *
                              q_len * kv_len, 0.0, 1.0, dtype="bfloat16",
                              extra={"kernel": "cuda_flash"})  # fmt: skip
            exact = float(np.dot(TRUE_ATTENTION, measurement_features(row)))
            seconds = exact * float(np.exp(rng.normal(0.0, noise)))
            rows.append(measurement("H100-SXM", "attention_fwd", params, row.flops, 0.0,
                                    seconds, dtype="bfloat16", extra=row.extra))  # fmt: skip
    return rows


def test_flash_rows_of_a_gpu_get_the_gpu_features():
    (row, *_) = _synthetic_attention_rows(0.0, np.random.default_rng(0))
    assert feature_names(row) == GPU_OP_FEATURES["attention_fwd"]
    cpu_row = measurement("cpu", "attention_fwd", row.params, row.flops, 0.0, 1.0,
                          extra={"kernel": "cpu_flash"})  # fmt: skip
    assert feature_names(cpu_row) == OP_FEATURES["attention_fwd"]
    assert gpu_traits("cpu") is None and gpu_traits("H100-SXM").sm_count == SMS


def test_exact_wave_quantized_data_gives_back_its_coefficients_and_extrapolates():
    rows = _synthetic_attention_rows(0.0, np.random.default_rng(1))
    (fit,) = fit_cost_model(rows).ops
    assert fit.features == GPU_OP_FEATURES["attention_fwd"] and fit.sm_count == SMS
    dominant = [0, 1, 2, 5]  # terms that carry at least half of some point's time
    np.testing.assert_allclose(np.array(fit.coefficients)[dominant],
                               np.array(TRUE_ATTENTION)[dominant], rtol=1e-4)  # fmt: skip
    assert fit.heldout.extrapolation_mape < 1e-4 and fit.heldout.goal_met


def test_noisy_wave_quantized_data_extrapolates_within_the_goal_where_flops_do_not():
    rows = _synthetic_attention_rows(0.02, np.random.default_rng(2))
    (fit,) = fit_cost_model(rows).ops
    assert fit.heldout.extrapolation_mape < 0.05 and fit.heldout.goal_met
    # The same points with the CPU's features (FLOPs, masked FLOPs, pairs, bytes, calls):
    # without the waves the largest third is predicted much worse.
    cpu_rows = [measurement("cpu", r.op, r.params, r.flops, r.bytes_moved, r.median_s,
                            dtype="bfloat16") for r in rows]  # fmt: skip
    (cpu_fit,) = fit_cost_model(cpu_rows).ops
    assert cpu_fit.heldout.extrapolation_mape > 2 * fit.heldout.extrapolation_mape


def test_the_fitted_model_predicts_what_the_fit_saw_and_broadcasts():
    rows = _synthetic_attention_rows(0.0, np.random.default_rng(3))
    model = FittedCostModel(fit_cost_model(rows))
    model = FittedCostModel.from_json(model.to_json())  # the JSON round trip keeps the SMs
    row = next(r for r in rows if r.params["causal"] and r.params["q_len"] == 4096)
    q = row.params["q_len"]
    pairs = q * (q + 1) // 2
    predicted = model.attention_time_s("H100-SXM", pairs, 8, 128, backward=False,
                                       q_tokens=q, kv_tokens=q, kernel="flash")  # fmt: skip
    assert predicted == pytest.approx(row.median_s, rel=1e-6)
    heads = np.array([[4], [8]])
    grid = model.attention_time_s("H100-SXM", np.array([[pairs, q * q]]), heads, 128,
                                  backward=False, q_tokens=q, kv_tokens=q,
                                  kernel="flash")  # fmt: skip
    assert grid.shape == (2, 2)
    assert grid[1, 0] == predicted
    assert grid[1, 1] > grid[1, 0]  # the full block runs the tiles the mask skips
    # Another kernel than the one profiled is not this fit's to price: the datasheet's.
    other = model.attention_time_s("H100-SXM", pairs, 8, 128, backward=False,
                                   q_tokens=q, kv_tokens=q, kernel="cudnn")  # fmt: skip
    assert other == model.fallback.attention_time_s(
        "H100-SXM", pairs, 8, 128, backward=False, q_tokens=q, kv_tokens=q, kernel="cudnn"
    )


def test_gpu_gemm_and_elementwise_fits_predict_with_their_own_terms():
    rng = np.random.default_rng(4)
    rows = []
    for size in (2**e for e in range(8, 15)):
        for m, n, k in [(size, size, size), (size // 4, 4 * size, size)]:
            bytes_moved = 2 * (m * k + n * k + m * n)
            seconds = 2 * m * n * k / 7e14 + bytes_moved / 3e12 + 2e-5
            rows.append(measurement("H100-SXM", "gemm", {"m": m, "n": n, "k": k},
                                    2.0 * m * n * k, bytes_moved, seconds,
                                    dtype="bfloat16"))  # fmt: skip
    for numel in (2**e for e in range(12, 34)):  # 3 training points pass the L2
        nbytes = 6 * numel
        seconds = 2e-5 + nbytes / 4e12 + max(nbytes - 50 * 2**20, 0) / 3e12
        rows.append(
            measurement(
                "H100-SXM",
                "elementwise",
                {"numel": numel},
                0.0,
                nbytes,
                seconds * float(np.exp(rng.normal(0, 0.001))),
                dtype="bfloat16",
                extra={"l2_bytes": 50 * 2**20, "llc_bytes": 50 * 2**20},
            )
        )
    model = FittedCostModel(fit_cost_model(rows))
    fits = {fit.op: fit for fit in model.document.ops}
    assert fits["gemm"].features == GPU_OP_FEATURES["gemm"]
    assert fits["gemm"].ridge_flops_per_byte == pytest.approx(989.4e12 / 3350e9)
    assert fits["elementwise"].features == GPU_OP_FEATURES["elementwise"]
    big = 3 * 2**30
    expected = 2e-5 + big / 4e12 + (big - 50 * 2**20) / 3e12
    assert model.memory_bound_time_s("H100-SXM", big) == pytest.approx(expected, rel=0.01)
    flops, nbytes = 2.0 * 8192**3, 2 * 3 * 8192**2
    expected = flops / 7e14 + nbytes / 3e12 + 2e-5
    assert model.gemm_time_s("H100-SXM", flops, bytes_moved=nbytes) == pytest.approx(
        expected, rel=0.01
    )


# --- the shared H100 profile -----------------------------------------------------------------


@pytest.fixture(scope="module")
def h100_document():
    return fit_cost_model(h100_sources())


@pytest.mark.parametrize("op", ["gemm", "attention_fwd", "attention_bwd", "elementwise"])
def test_the_shared_h100_profile_extrapolates_within_five_percent(h100_document, op):
    (fit,) = [f for f in h100_document.ops if f.op == op]
    assert fit.features == GPU_OP_FEATURES[op]
    assert fit.heldout.extrapolation_mape <= 0.05 and fit.heldout.goal_met
    assert fit.heldout.lodo_note == "n/a (one type profiled)"


def test_the_h100_held_out_split_is_the_largest_third_and_never_fitted(h100_document):
    # The extrapolation error is that of a fit on the smaller two thirds only: refitting
    # those rows alone reproduces it, so no test point reached the coefficients.
    rows = [m for source in h100_sources() for m in source.measurements]
    attention = [m for m in rows if m.op == "attention_bwd"]
    features = np.array([measurement_features(m) for m in attention])
    seconds = np.array([m.median_s for m in attention])
    train, test = extrapolation_split(np.array([m.flops for m in attention]))
    coefficients = fit_relative_nnls(features[train], seconds[train])
    errors = np.abs(features[test] @ coefficients - seconds[test]) / seconds[test]
    (fit,) = [f for f in h100_document.ops if f.op == "attention_bwd"]
    assert fit.heldout.extrapolation_mape == pytest.approx(float(np.mean(errors)), rel=1e-9)
    assert min(m.flops for m in np.array(attention)[test]) >= max(
        m.flops for m in np.array(attention)[train]
    )


@pytest.mark.skipif(
    not Path("/work/shared/data/h100-profile.db").exists(), reason="no shared H100 store here"
)
def test_the_fixture_is_the_shared_store(tmp_path):
    import shutil

    from hexiseq.store import Store

    copy = tmp_path / "h100.db"  # the shared store is read-only: open a copy
    shutil.copyfile("/work/shared/data/h100-profile.db", copy)
    with Store.open(f"sqlite:///{copy}") as store:
        runs = store.profile_measurements_by_run()
    stored = sorted((m.op, json.dumps(m.params, sort_keys=True), m.median_s)
                    for _, _, ms in runs for m in ms)  # fmt: skip
    fixture = sorted((m.op, json.dumps(m.params, sort_keys=True), m.median_s)
                     for s in h100_sources() for m in s.measurements)  # fmt: skip
    assert stored == fixture
