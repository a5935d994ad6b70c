"""FittedCostModel: the CostModel protocol on fitted regressions, datasheet fallback, JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fit_cases import TrueDevice, compute_rows, link_rows

from hexiseq import Cluster, InputError
from hexiseq.costmodel import (
    DATASHEET_LABEL,
    DatasheetCostModel,
    FittedCostModel,
    ProfileSource,
    fit_cost_model,
)
from hexiseq.costmodel._state import make_context
from hexiseq.costmodel.datasheet import LINK_EFFICIENCY

PAIRS = np.array([[0, 10, 1_000_000], [5, 12_345, 7]], dtype=np.int64)
HEADS = np.array([[1], [7]], dtype=np.int64)
BYTES = np.array([0, 1, 4096, 3 * 10**9], dtype=np.int64)


@pytest.fixture(scope="module")
def model() -> FittedCostModel:
    rng = np.random.default_rng(0)
    sources = [
        ProfileSource(3, "2026-11-22T10:00:00+00:00", compute_rows(TrueDevice("cpu"), rng)),
        ProfileSource(
            4,
            "2026-11-23T09:00:00+00:00",
            link_rows("intra:cpu", 5e-5, 2.0, rng) + link_rows("inter", 1e-4, 0.5, rng),
        ),
    ]
    return FittedCostModel(fit_cost_model(sources))


@pytest.mark.parametrize("backward", [False, True])
def test_attention_broadcasts_like_scalar_calls(model, backward):
    seconds = model.attention_time_s("cpu", PAIRS, HEADS, 64, backward=backward)
    assert seconds.shape == PAIRS.shape
    for (i, j), pairs in np.ndenumerate(PAIRS):
        scalar = model.attention_time_s("cpu", int(pairs), int(HEADS[i, 0]), 64, backward=backward)
        assert seconds[i, j] == scalar
    q_tokens = np.array([[1, 100, 1000]])
    with_tokens = model.attention_time_s(
        "cpu", PAIRS, HEADS, 64, backward=backward, q_tokens=q_tokens, kv_tokens=2 * q_tokens
    )
    for (i, j), pairs in np.ndenumerate(PAIRS):
        scalar = model.attention_time_s(
            "cpu", int(pairs), int(HEADS[i, 0]), 64, backward=backward,
            q_tokens=int(q_tokens[0, j]), kv_tokens=int(2 * q_tokens[0, j]),
        )  # fmt: skip
        assert with_tokens[i, j] == scalar


def test_gemm_and_memory_bound_broadcast_like_scalar_calls(model):
    flops = BYTES.astype(np.float64) * 100
    gemm = model.gemm_time_s("cpu", flops, bytes_moved=BYTES, calls=3)
    default_bytes = model.gemm_time_s("cpu", flops)
    memory = model.memory_bound_time_s("cpu", BYTES, calls=2)
    for i, value in enumerate(BYTES):
        assert gemm[i] == model.gemm_time_s(
            "cpu", float(flops[i]), bytes_moved=int(value), calls=3
        )
        assert default_bytes[i] == model.gemm_time_s("cpu", float(flops[i]))
        assert memory[i] == model.memory_bound_time_s("cpu", int(value), calls=2)


def test_fitted_times_follow_the_fitted_coefficients(model):
    device = TrueDevice("cpu")
    # 2 % noise: the fitted model predicts the true law within a few percent.
    flops, nbytes = 2 * 1024**3, 3 * 1024**2 * 4
    true = device.gemm[0] * flops + device.gemm[1] * nbytes + device.gemm[2]
    assert model.gemm_time_s("cpu", flops, bytes_moved=nbytes) == pytest.approx(true, rel=0.05)
    # `calls` adds the per-call cost: 10 calls of the same total work cost 9 launches more.
    ten = model.gemm_time_s("cpu", flops, bytes_moved=nbytes, calls=10)
    (fit,) = [f for f in model.document.ops if f.op == "gemm"]
    assert ten - model.gemm_time_s("cpu", flops, bytes_moved=nbytes) == pytest.approx(
        9 * fit.coefficients[2]
    )


def test_unprofiled_types_fall_back_to_the_datasheet_and_say_so(model):
    datasheet = DatasheetCostModel()
    assert model.label("H100-SXM") == DATASHEET_LABEL
    assert model.gemm_time_s("H100-SXM", 1e15) == datasheet.gemm_time_s("H100-SXM", 1e15)
    assert model.attention_time_s("H100-SXM", PAIRS, HEADS, 128, backward=True) == pytest.approx(
        datasheet.attention_time_s("H100-SXM", PAIRS, HEADS, 128, backward=True)
    )
    assert model.memory_bound_time_s("H100-SXM", 1e9) == datasheet.memory_bound_time_s(
        "H100-SXM", 1e9
    )
    assert model.covered_types == ("cpu",)


def test_label_names_the_profile_run_and_its_date(model):
    assert model.label("cpu") == "fitted (profile run 3, 2026-11-22)"


def test_label_names_the_families_left_to_the_datasheet():
    rows = [r for r in compute_rows(TrueDevice("cpu"), np.random.default_rng(1)) if r.op == "gemm"]
    partial = FittedCostModel(fit_cost_model([ProfileSource(7, "2026-12-01T00:00:00", rows)]))
    assert partial.label("cpu") == (
        "fitted (profile run 7, 2026-12-01); datasheet for attention_fwd, attention_bwd, "
        "elementwise"
    )
    datasheet = DatasheetCostModel()
    assert partial.memory_bound_time_s("cpu", 1e6) == datasheet.memory_bound_time_s("cpu", 1e6)


def test_transfer_time_is_alpha_plus_bytes_over_beta_and_zero_for_nothing(model):
    seconds = model.transfer_time_s(BYTES, 2.0, 5e-5)
    assert seconds[0] == 0.0
    assert seconds[2] == pytest.approx(5e-5 + 4096 / 2e9)
    assert isinstance(model.transfer_time_s(0, 2.0, 5e-5), float)


def test_link_parameters_use_measured_classes_and_declared_links_elsewhere(model):
    cluster = Cluster.from_dict(
        {
            "name": "mixed",
            "nodes": [
                {"name": "a", "gpu": "cpu", "count": 2},
                {"name": "b", "gpu": "H100-SXM", "count": 1},
            ],
            "network": {"inter_node_GBps": 50},
        }
    )
    bandwidth, latency = model.link_parameters(cluster)
    (intra,) = [f for f in model.document.links if f.link_class == "intra:cpu"]
    regime = intra.regimes[-1]
    assert bandwidth[0, 0] == pytest.approx(1 / (regime.seconds_per_byte * 1e9))
    assert latency[0, 0] == regime.latency_s
    assert bandwidth[0, 0] == pytest.approx(2.0, rel=0.05)
    assert bandwidth[0, 1] == bandwidth[1, 0] == pytest.approx(0.5, rel=0.05)  # "inter"
    # H100 node: not profiled, so its NVLink from the catalog x the datasheet link efficiency.
    declared, declared_latency = DatasheetCostModel().link_parameters(cluster)
    assert bandwidth[1, 1] == declared[1, 1] * LINK_EFFICIENCY
    assert latency[1, 1] == declared_latency[1, 1]


def test_the_simulator_uses_the_fitted_links_and_labels_the_type(model):
    from hexiseq import ModelSpec, TrainSpec, build_uniform_layout
    from hexiseq.costmodel import simulate_step

    cluster = Cluster.preset("cpu-emulated-2type")
    spec = ModelSpec.preset("tiny")
    groups = [1] * cluster.world_size  # one rank per group: every ring hop crosses a link
    layout = build_uniform_layout(1024, spec.heads, spec.kv_heads, groups)
    train = TrainSpec(seq_len=1024)
    context = make_context(cluster, spec, train, layout, model)
    np.testing.assert_array_equal(context.bandwidth_GBps, model.link_parameters(cluster)[0])
    fitted = simulate_step(cluster, spec, train, layout, model)
    datasheet = simulate_step(cluster, spec, train, layout, DatasheetCostModel())
    assert fitted.cost_model_labels == {"cpu": "fitted (profile run 3, 2026-11-22)"}
    assert fitted.step_time_s != datasheet.step_time_s


def test_json_round_trip_is_exact(model):
    text = model.to_json()
    again = FittedCostModel.from_json(text)
    assert again.to_json() == text
    assert again.document == model.document
    assert again.gemm_time_s("cpu", 1e9) == model.gemm_time_s("cpu", 1e9)
    assert "pickle" not in text and json.loads(text)["format"] == "hexiseq.fitted_cost_model"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "something else"}', "not a hexiseq fitted cost model"),
        ("[1, 2]", "not a hexiseq fitted cost model"),
    ],
)
def test_corrupt_json_is_one_line_input_error(text, expected):
    with pytest.raises(InputError, match=expected) as error:
        FittedCostModel.from_json(text, source="store x: latest fitted model")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("store x: latest fitted model")


def test_a_tampered_coefficient_is_refused_naming_the_field(model):
    document = json.loads(model.to_json())
    document["ops"][0]["coefficients"][0] = -1.0
    with pytest.raises(InputError, match=r"ops\[0\].*>= 0") as error:
        FittedCostModel.from_json(json.dumps(document))
    assert "\n" not in str(error.value)
    del document["ops"][0]["heldout"]
    with pytest.raises(InputError, match=r"ops\[0\]"):
        FittedCostModel.from_json(json.dumps(document))
