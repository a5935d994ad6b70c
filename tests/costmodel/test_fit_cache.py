"""Hardware terms of the fit: cache capacities (bytes beyond L2 / last-level cache), the CPU
flash kernel's tiles under a causal mask, and reading schema-1 documents."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fit_cases import TrueDevice, compute_rows, measurement

from hexiseq.costmodel import FittedCostModel, fit_cost_model
from hexiseq.costmodel._features import (
    OP_FEATURES,
    attention_features,
    computed_masked_fraction,
    measurement_features,
)
from hexiseq.costmodel._fit_document import DOCUMENT_SCHEMA_VERSION
from hexiseq.flops import ATTENTION_BACKWARD_FACTOR, attention_flops
from hexiseq.profiles import attention_pairs

L2_BYTES, LLC_BYTES = 2 * 1024**2, 64 * 1024**2
CACHE_EXTRA = {"l2_bytes": L2_BYTES, "llc_bytes": LLC_BYTES}
# A streaming kernel: s/byte in L2, s/call, extra s/byte of a call out of L2, extra s/byte of
# a call out of the LLC: 100 GB/s in L2, 30 GB/s from the LLC, 10 GB/s from memory.
ELEMENTWISE = {
    "bytes": 1 / 100e9,
    "calls": 2e-6,
    "bytes_out_of_l2": 1 / 30e9 - 1 / 100e9,
    "bytes_out_of_llc": 1 / 10e9 - 1 / 30e9,
}


def _elementwise_rows(rng, noise: float, extra: dict | None = CACHE_EXTRA):
    """Sizes from 48 KiB to 3 GB a call, denser beyond the LLC, as the benchmark grid is."""
    numels = [2**12, 2**16, 2**18, 2**20, 2**22, 2**23, 2**24, 2**25, 3 * 2**24, 2**26,
              5 * 2**24, 3 * 2**25, 7 * 2**24, 2**28]  # fmt: skip
    rows = []
    for numel in numels:
        nbytes = 12.0 * numel
        exact = _elementwise_seconds(nbytes)
        seconds = exact * float(np.exp(rng.normal(0.0, noise)))
        rows.append(measurement("cpu", "elementwise", {"numel": numel}, 0.0, nbytes, seconds,
                                extra=extra))  # fmt: skip
    return rows


def _elementwise_seconds(nbytes: float) -> float:
    out_of = [nbytes if nbytes > c else 0.0 for c in (L2_BYTES, LLC_BYTES)]
    return (ELEMENTWISE["bytes"] * nbytes + ELEMENTWISE["calls"]
            + ELEMENTWISE["bytes_out_of_l2"] * out_of[0]
            + ELEMENTWISE["bytes_out_of_llc"] * out_of[1])  # fmt: skip


def test_cache_terms_are_recovered_from_exact_data():
    (fit,) = fit_cost_model(_elementwise_rows(np.random.default_rng(0), 0.0)).ops
    assert fit.features == ("bytes", "calls", "bytes_out_of_l2", "bytes_out_of_llc")
    assert fit.cache_bytes == (L2_BYTES, LLC_BYTES)
    expected = [ELEMENTWISE[name] for name in fit.features]
    np.testing.assert_allclose(fit.coefficients, expected, rtol=1e-6)
    assert fit.heldout.extrapolation_mape < 1e-6


def test_cache_terms_extrapolate_beyond_the_last_level_cache_under_noise():
    rows = _elementwise_rows(np.random.default_rng(1), 0.02)
    (fit,) = fit_cost_model(rows).ops
    # 2 % noise: the largest third (all beyond the LLC) is predicted within about the noise.
    assert fit.heldout.extrapolation_mape < 0.04
    model = FittedCostModel(fit_cost_model(rows))
    nbytes = 6e9  # twice the largest size profiled, out of every cache
    assert model.memory_bound_time_s("cpu", nbytes) == pytest.approx(
        _elementwise_seconds(nbytes), rel=0.04
    )
    # Two calls of half the bytes each: each call's bytes are compared with the caches.
    assert model.memory_bound_time_s("cpu", 2 * 1e6, calls=2) == pytest.approx(
        2 * (1e6 / 100e9 + 2e-6), rel=0.05
    )


def test_an_earlier_step_than_the_hardware_cache_is_found_from_the_training_points():
    # The process gets 16 MiB of the 64 MiB last-level cache (a VM's share): the fit, told
    # 64 MiB, finds the step where the points show it and extrapolates beyond it.
    shared = 16 * 1024**2
    rows = []
    for row in _elementwise_rows(np.random.default_rng(4), 0.0):
        nbytes = row.bytes_moved
        slow = nbytes > shared
        seconds = _elementwise_seconds(nbytes) + (
            ELEMENTWISE["bytes_out_of_llc"] * nbytes if slow and nbytes <= LLC_BYTES else 0.0
        )
        rows.append(dataclasses.replace(row, median_s=seconds, p10_s=seconds, p90_s=seconds))
    (fit,) = fit_cost_model(rows).ops
    # Any capacity between the profiled sizes around a step fits the points alike.
    l2_bytes, llc_bytes = fit.cache_bytes
    assert 12 * 2**16 <= l2_bytes < 12 * 2**18 and 12 * 2**20 <= llc_bytes < 12 * 2**22
    assert fit.heldout.extrapolation_mape < 1e-3


def test_without_cache_sizes_the_step_beyond_the_cache_is_not_seen():
    rows = _elementwise_rows(np.random.default_rng(2), 0.0, extra=None)
    (fit,) = fit_cost_model(rows).ops
    assert fit.cache_bytes is None and fit.coefficients[2:] == (0.0, 0.0)
    assert fit.heldout.extrapolation_bias < -0.1  # the largest sizes are slower than predicted


@pytest.mark.parametrize(
    ("length", "computed_pairs"),
    [
        (128, 128 * 128),  # one 32-row block after another, all within the one 128-key block
        (512, 512 * 512),  # 64-row blocks, one 512-key block: the whole box
        # 256-row blocks, 512-key blocks: blocks 0-1 compute keys < 512, blocks 2-3 all 1024
        (1024, 256 * (512 + 512 + 1024 + 1024)),
        (2048, 256 * 512 * (1 + 1 + 2 + 2 + 3 + 3 + 4 + 4)),
    ],
)
def test_cpu_flash_tiles_compute_masked_pairs_up_to_the_next_key_block(length, computed_pairs):
    exact = attention_pairs(length, length, causal=True)
    fraction = computed_masked_fraction(length, length, "cpu_flash")
    assert exact + fraction * (length * length - exact) == pytest.approx(computed_pairs)
    assert computed_masked_fraction(length, length, "cuda_flash") == 1.0
    assert computed_masked_fraction(np.array([length]), np.array([length]), None)[0] == 1.0


@pytest.mark.parametrize("op", ["attention_fwd", "attention_bwd"])
@pytest.mark.parametrize(
    ("kernel", "causal", "softmax_pairs"),
    [
        # the masked pairs of the tiles it computes too: 256 x (512 + 512 + 1024 + 1024)
        ("cpu_flash", True, 256 * (512 + 512 + 1024 + 1024)),
        ("cpu_flash", False, 1024 * 1024),
        ("cuda_flash", True, 1024 * 1025 // 2),  # tiles unknown: the unmasked pairs only
        (None, False, 1024 * 1024),
    ],
)
def test_pair_heads_count_the_pairs_the_softmax_passes_over(op, kernel, causal, softmax_pairs):
    heads, head_dim = 4, 64
    params = {"q_len": 1024, "kv_len": 1024, "heads": heads, "head_dim": head_dim,
              "causal": causal}  # fmt: skip
    pairs = attention_pairs(1024, 1024, causal=causal)
    backward = op == "attention_bwd"
    flops = attention_flops(pairs, heads, head_dim) * (
        ATTENTION_BACKWARD_FACTOR if backward else 1
    )
    extra = {"kernel": kernel} if kernel else {}
    row = measurement("cpu", op, params, flops, 0.0, 1.0, extra=extra)
    fitted = measurement_features(row)
    assert fitted[OP_FEATURES[op].index("pair_heads")] == softmax_pairs * heads
    # The prediction side computes the same from the shape, for one block or several.
    for calls in (1, 3):
        predicted = attention_features(
            calls * pairs, heads, head_dim, backward=backward, q_tokens=1024,
            kv_tokens=1024, calls=calls, element_size=4, kernel=kernel,
        )  # fmt: skip
        assert predicted == pytest.approx(tuple(calls * feature for feature in fitted))


def test_attention_fit_on_cpu_flash_recovers_the_tile_law():
    device = TrueDevice("cpu")
    rows = []
    for length in (128, 256, 512, 768, 1024, 1536, 2048):
        for head_dim in (32, 64, 128):
            for causal in (False, True):
                params = {"q_len": length, "kv_len": length, "heads": 4, "head_dim": head_dim,
                          "causal": causal}  # fmt: skip
                flops = attention_flops(
                    attention_pairs(length, length, causal=causal), 4, head_dim
                )
                row = measurement("cpu", "attention_fwd", params, flops, 0.0, 1.0,
                                  extra={"kernel": "cpu_flash"})  # fmt: skip
                seconds = float(np.dot(device.attention_fwd, measurement_features(row)))
                rows.append(measurement("cpu", "attention_fwd", params, flops, 0.0, seconds,
                                        extra={"kernel": "cpu_flash"}))  # fmt: skip
    document = fit_cost_model(rows)
    (fit,) = document.ops
    assert fit.attention_kernel == "cpu_flash"
    np.testing.assert_allclose(fit.coefficients, device.attention_fwd, rtol=1e-6)
    # The prediction applies the same tiles: a causal 1024-block costs what the law says.
    model = FittedCostModel(document)
    (row,) = [r for r in rows if r.params["q_len"] == 1024 and r.params["causal"]
              and r.params["head_dim"] == 64]  # fmt: skip
    predicted = model.attention_time_s("cpu", attention_pairs(1024, 1024, causal=True), 4, 64,
                                       backward=False, q_tokens=1024, kv_tokens=1024)  # fmt: skip
    assert predicted == pytest.approx(row.median_s, rel=1e-9)


def test_a_schema_1_document_is_still_read_and_predicts_with_its_own_features():
    document = fit_cost_model(compute_rows(TrueDevice("cpu"), np.random.default_rng(3)))
    current = FittedCostModel(document)
    raw = json.loads(current.to_json())
    version_2 = {key: value for key, value in raw.items() if key != "memory"}
    assert (
        FittedCostModel.from_json(json.dumps(version_2 | {"schema_version": 2})).document.memory
        == ()
    )
    raw["schema_version"] = 1
    del raw["memory"]  # versions 1 and 2 had no memory calibration
    for fit in raw["ops"]:  # as version 1 wrote them: no cache terms, no kernel
        if fit["op"] in ("gemm", "elementwise"):
            fit["features"] = fit["features"][:-2]
            fit["coefficients"] = fit["coefficients"][:-2]
        del fit["cache_bytes"], fit["attention_kernel"]
    old = FittedCostModel.from_json(json.dumps(raw))
    assert old.document.schema_version == 1
    # Upgraded on reading: every reader sees today's features, the cache terms at 0.
    (gemm,) = [fit for fit in old.document.ops if fit.op == "gemm"]
    assert gemm.features[-2:] == ("bytes_beyond_l2", "bytes_beyond_llc")
    assert gemm.coefficients[-2:] == (0.0, 0.0)
    assert old.gemm_time_s("cpu", 1e9, bytes_moved=1e7) == current.gemm_time_s(
        "cpu", 1e9, bytes_moved=1e7
    )
    assert old.memory_bound_time_s("cpu", 1e8) == current.memory_bound_time_s("cpu", 1e8)
    assert json.loads(current.to_json())["schema_version"] == DOCUMENT_SCHEMA_VERSION == 5


def test_a_point_is_predicted_with_the_capacities_its_fit_used():
    rows = _elementwise_rows(np.random.default_rng(5), 0.0)
    (fit,) = fit_cost_model(rows).ops
    for row in rows:
        predicted = float(np.dot(fit.coefficients, measurement_features(row, fit.cache_bytes)))
        assert predicted == pytest.approx(row.median_s, rel=1e-6)
