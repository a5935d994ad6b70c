"""The fitted model prices the attention kernel the runtime runs: the shared H100 profile timed
torch's flash kernel, the runtime now runs cuDNN's on an H100, so attention there is the
datasheet's cuDNN estimate (labelled), while the profile still prices flash when asked."""

from __future__ import annotations

import pytest
from test_fit_gpu import h100_sources

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout
from hexiseq.costmodel import DatasheetCostModel, FittedCostModel, fit_cost_model, simulate_step
from hexiseq.kernels import attention_kernel

Q_TOKENS, HEADS = 16384, 32  # the shape of the shared H100 SDPA rates (causal 16K, H=32, D=128)
PAIRS = Q_TOKENS * (Q_TOKENS + 1) // 2


@pytest.fixture(scope="module")
def h100_model() -> FittedCostModel:
    return FittedCostModel(fit_cost_model(h100_sources()))


def test_the_shared_profile_timed_flash_and_the_runtime_runs_cudnn_there(h100_model):
    fits = [fit for fit in h100_model.document.ops if fit.op.startswith("attention")]
    assert {fit.attention_kernel for fit in fits} == {"cuda_flash"}  # profiled before the rule
    assert attention_kernel("H100-SXM", "bfloat16", 128) == "cudnn"


@pytest.mark.parametrize("backward", [False, True])
def test_unasked_attention_is_the_datasheets_cudnn_estimate(h100_model, backward):
    args = ("H100-SXM", PAIRS, HEADS, 128)
    shape = {"backward": backward, "q_tokens": Q_TOKENS, "kv_tokens": Q_TOKENS}
    runtime = h100_model.attention_time_s(*args, **shape)
    cudnn = DatasheetCostModel().attention_time_s(*args, **shape, kernel="cudnn")
    flash_fit = h100_model.attention_time_s(*args, **shape, kernel="flash")
    assert runtime == cudnn
    # The flash profile is still the fit's to price. Measured on the H100 at this shape
    # (../shared/data/h100-sdpa-gemm-rates.json): cuDNN 623 / 496 TFLOP/s forward / backward,
    # flash 338 / 308, i.e. 1.84x / 1.61x.
    assert 1.55 < flash_fit / runtime < 1.9


def test_the_label_says_attention_left_the_profile_and_why(h100_model):
    label = h100_model.label("H100-SXM")
    assert label.startswith("fitted (")
    assert "attention_fwd, attention_bwd: datasheet — profiled flash, the runtime runs cudnn" in (
        label
    )
    assert "datasheet for" not in label  # gemm and elementwise are still the fit's


def test_a_plan_on_the_profiled_gpu_is_simulated_with_cudnn_attention(h100_model):
    cluster = Cluster.from_dict(
        {"name": "one-h100", "nodes": [{"name": "n0", "gpu": "H100-SXM", "count": 1}],
         "network": {"inter_node_GBps": 50}}
    )  # fmt: skip
    model, train = ModelSpec.preset("llama3.2-3b"), TrainSpec(seq_len=16384)
    layout = build_uniform_layout(16384, model.heads, model.kv_heads, (1,))
    step = simulate_step(cluster, model, train, layout, h100_model, [1.0])
    datasheet = simulate_step(cluster, model, train, layout, DatasheetCostModel(), [1.0])
    (rank,), (datasheet_rank,) = step.rank_times, datasheet.rank_times
    assert rank.linear_s != datasheet_rank.linear_s  # the GEMMs are the profile's
    assert rank.attention_s > 0
    assert rank.attention_s == pytest.approx(datasheet_rank.attention_s, rel=1e-9)


def test_a_family_profiled_with_two_kernels_fits_its_newest_runs_kernel():
    """Re-profiling after the rule changed (flash rows, then cuDNN rows) keeps the family:
    the newest run's kernel's rows, not a family dropped for mixing kernels."""
    from types import SimpleNamespace

    from hexiseq.costmodel.fit import _newest_kernel_only

    def row(kernel):
        return SimpleNamespace(op="attention_fwd", extra={"kernel": kernel})

    members = [(1, row("flash")), (1, row("flash")), (2, row("cudnn")), (2, row("cudnn"))]
    kept = _newest_kernel_only(members)
    assert [run for run, _ in kept] == [2, 2]
    assert {m.extra["kernel"] for _, m in kept} == {"cudnn"}
    same = members[:2]
    assert _newest_kernel_only(same) == same
