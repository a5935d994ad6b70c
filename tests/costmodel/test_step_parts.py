"""The step's bandwidth-bound parts: elementwise, casts, loss, optimizer, launch overhead."""

from __future__ import annotations

import dataclasses

import pytest

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout
from hexiseq.catalog import gpu_spec
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.costmodel._runtime_work import (
    FUSED_ADAMW_BYTES_PER_PARAM,
    RankKernels,
    block_elementwise_per_token,
    runtime_dtypes,
)
from hexiseq.costmodel._state import BREAKDOWN_KEYS, make_context
from hexiseq.costmodel._step_parts import per_rank_work
from hexiseq.costmodel.datasheet import KERNEL_FLOOR_S, attention_seconds_per_pair_head
from hexiseq.plan import RankTime

SMALL = ModelSpec(
    name="small", layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn_hidden=688,
    vocab=1024,
)  # fmt: skip


def h100s(count: int) -> Cluster:
    return Cluster.from_dict(
        {"name": "h", "nodes": [{"name": "n0", "gpu": "H100-SXM", "count": count}]}
    )


def predict(model, seq_len, count=1, fractions=None, checkpointing=True):
    layout = build_uniform_layout(seq_len, model.heads, model.kv_heads, [1] * count)
    train = TrainSpec(seq_len=seq_len, activation_checkpointing=checkpointing)
    cost = DatasheetCostModel()
    return simulate_step(h100s(count), model, train, layout, cost, fractions)


def test_breakdown_keys_are_the_rank_time_fields():
    assert tuple(f.name for f in dataclasses.fields(RankTime)) == BREAKDOWN_KEYS


@pytest.mark.parametrize("count", [1, 4])
def test_parts_add_up_to_the_step(count):
    prediction = predict(ModelSpec.preset("llama3.2-3b"), 8192, count)
    for rank in prediction.rank_times:
        assert rank.step_s == pytest.approx(prediction.step_time_s, rel=1e-9)
        for key in ("elementwise_s", "cast_s", "loss_s", "optimizer_s"):
            assert getattr(rank, key) > 0, key


def test_optimizer_time_follows_the_state_share():
    model = ModelSpec.preset("llama3.2-3b")
    prediction = predict(model, 8192, 2, fractions=[0.25, 0.75])
    small, large = (rank.optimizer_s for rank in prediction.rank_times)
    assert large == pytest.approx(3 * small, rel=1e-9)
    spec = gpu_spec("H100-SXM")
    bandwidth = spec.hbm_GBps * 1e9 * spec.memory_bound_efficiency
    bytes_moved = 0.75 * model.params * FUSED_ADAMW_BYTES_PER_PARAM  # fused AdamW
    assert large == pytest.approx(bytes_moved / bandwidth, rel=1e-9)


def test_short_kernels_pay_the_launch_floor_long_ones_do_not():
    tiny = predict(SMALL, 2048, checkpointing=False).rank_times[0]
    large = predict(ModelSpec.preset("llama3.2-3b"), 8192).rank_times[0]
    assert tiny.launch_s > tiny.elementwise_s  # 2K tokens x 256 wide: host-bound
    assert large.launch_s == 0.0  # every kernel moves enough bytes


def test_datasheet_kernel_floor():
    cost = DatasheetCostModel()
    assert cost.memory_bound_time_s("H100-SXM", 0.0, calls=10) == pytest.approx(
        10 * KERNEL_FLOOR_S
    )
    assert cost.memory_bound_time_s("H100-SXM", 1e12, calls=10) > 10 * KERNEL_FLOOR_S
    assert cost.gemm_time_s("H100-SXM", 1.0, calls=3) == pytest.approx(3 * KERNEL_FLOOR_S)


def test_attention_is_priced_for_the_kernel_the_device_runs():
    cost = DatasheetCostModel()
    args = ("H100-SXM", 1e9, 24, 128)
    for backward in (False, True):
        default = cost.attention_time_s(*args, backward=backward)
        assert default == cost.attention_time_s(*args, backward=backward, kernel="cudnn")
        assert cost.attention_time_s(*args, backward=backward, kernel="flash") > default
        assert cost.attention_time_s(*args, backward=backward, kernel="efficient") > default


def test_head_size_128_reproduces_the_catalog_rate_smaller_heads_run_slower():
    spec = gpu_spec("H100-SXM")
    seconds = attention_seconds_per_pair_head(spec, "flash", 128, backward=False)
    assert 4 * 128 / seconds == pytest.approx(spec.peak_flops * 0.332, rel=1e-9)
    rate = {d: 4 * d / attention_seconds_per_pair_head(spec, "flash", d, False) for d in (32, 64)}
    assert rate[32] < rate[64] < 4 * 128 / seconds
    # Shared H100 profile (8 heads, causal 16K): D=64 runs at 0.85x the D=128 rate.
    assert rate[64] / (4 * 128 / seconds) == pytest.approx(0.85, abs=0.03)


def test_an_fp32_run_has_no_casts():
    layout = build_uniform_layout(4096, SMALL.heads, SMALL.kv_heads, [1])
    train = TrainSpec(seq_len=4096, compute_dtype_bytes=4)
    prediction = simulate_step(h100s(1), SMALL, train, layout, DatasheetCostModel())
    assert prediction.rank_times[0].cast_s == 0.0


def test_one_dtype_rule_for_the_step_and_the_memory_model():
    """The former `autocast` recipe keeps an FP32 stream and casts (5 activation casts a
    block); the `sharded` recipe the runtime runs computes the stream in the compute dtype
    with no per-use casts, as the memory model (measured against the runtime's allocations)
    says."""
    import dataclasses

    from hexiseq.costmodel import _runtime_work as work
    from hexiseq.costmodel.memory import RankShape, rank_memory
    from hexiseq.model import ModelSpec, TrainSpec

    model, train = ModelSpec.preset("small"), TrainSpec(seq_len=4096)
    legacy = dataclasses.replace(train, runtime_recipe="autocast")
    one, many = work.runtime_dtypes(legacy), work.runtime_dtypes(train)
    assert (one.stream, one.casts_weights, one.sharded) == (4, True, False)
    assert (many.stream, many.casts_weights, many.sharded) == (2, False, True)
    assert work.block_activation_casts_per_token(model, one, backward=False).kernels == 5
    assert work.block_activation_casts_per_token(model, many, backward=False).bytes == 0
    # The narrower stream moves fewer bytes forward; backward the runtime's norm recomputes
    # its normalized input instead of keeping it (`runtime/_elementwise.py`), which is more.
    assert (
        work.block_elementwise_per_token(model, many, backward=False).bytes
        < work.block_elementwise_per_token(model, one, backward=False).bytes
    )
    for spec, dtypes in ((legacy, one), (train, many)):
        memory = rank_memory(model, spec, RankShape(4096, 4096, 8, 4, 0), 1.0)
        assert memory.block_output == 4096 * model.hidden * dtypes.stream


def _block_work(model, train, rank, backward=False):
    dtypes = runtime_dtypes(train)
    return block_elementwise_per_token(model, dtypes, backward=backward, rank=rank)


@pytest.mark.parametrize("backward", [False, True])
def test_a_block_costs_more_with_a_group_a_longer_ring_or_the_norms_math(backward):
    """A one-member HP group skips the all-to-all's copies, a one-group ring the merges, a GPU
    rank runs the fused norm (`RankKernels`)."""
    model, train = ModelSpec.preset("llama3.2-3b"), TrainSpec(seq_len=8192)
    alone = _block_work(model, train, RankKernels(True, 1, True), backward)
    for other in (RankKernels(True, 1, False), RankKernels(True, 4, True)):
        work = _block_work(model, train, other, backward)
        assert work.bytes > alone.bytes and work.kernels > alone.kernels, other
    assert _block_work(model, train, RankKernels(False, 1, True), backward).bytes > alone.bytes


def test_each_rank_gets_the_work_of_its_own_kernels():
    """GPU ranks in an HP group of two, CPU ranks alone in theirs, one ring of three groups."""
    model, train = ModelSpec.preset("llama3.2-3b"), TrainSpec(seq_len=8192)
    nodes = [
        {"name": "gpu", "gpu": "H100-SXM", "count": 2},
        {"name": "cpu", "gpu": "cpu", "count": 2},
    ]
    network = {"inter_node_GBps": 50}
    cluster = Cluster.from_dict({"name": "mixed", "nodes": nodes, "network": network})
    layout = build_uniform_layout(8192, model.heads, model.kv_heads, [2, 1, 1])
    context = make_context(cluster, model, train, layout, DatasheetCostModel())
    seen = []

    def work_of(rank):
        seen.append(rank)
        return _block_work(model, train, rank)

    work = per_rank_work(context, work_of)
    assert set(seen) == {RankKernels(True, 3, False), RankKernels(False, 3, True)}
    gpu = _block_work(model, train, RankKernels(True, 3, False))
    cpu = _block_work(model, train, RankKernels(False, 3, True))
    assert list(work.bytes) == [gpu.bytes, gpu.bytes, cpu.bytes, cpu.bytes]
    assert simulate_step(cluster, model, train, layout, DatasheetCostModel()).step_time_s > 0
