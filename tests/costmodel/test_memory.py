"""Memory model terms against hand-computed values, and how they move with the plan."""

from __future__ import annotations

import pytest

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout, build_zigzag_layout
from hexiseq.catalog import GiB
from hexiseq.costmodel import estimate_memory, memory_limit_bytes
from hexiseq.costmodel.memory import GPU_RESERVE_BYTES

# A small model with round shapes: hidden 64, 4 heads of 16, 2 KV heads, ffn 128, vocab 100.
MODEL = ModelSpec(
    name="m", layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128, vocab=100
)
CLUSTER = Cluster.from_dict(
    {
        "name": "pair",
        "nodes": [
            {"name": "n0", "gpu": "A100-80G", "count": 2},
            {"name": "n1", "gpu": "A100-80G", "count": 2},
        ],
        "network": {"inter_node_GBps": 25},
    }
)


def layout_two_groups_of_two():
    # 2 HP groups of 2 ranks, 1,600 tokens, segments 1,000 and 600, heads 3+1 and 2+2.
    return build_zigzag_layout(
        1600, 4, 2, [[0, 1], [2, 3]], [1000, 600], [[3, 2], [1, 1]], [[3, 1], [2, 2]]
    )


def test_terms_by_hand():
    layout = layout_two_groups_of_two()
    train = TrainSpec(seq_len=1600)
    memory = estimate_memory(CLUSTER, MODEL, train, layout, [0.1, 0.2, 0.3, 0.4])
    rank0 = memory[0]  # 600 tokens, heads [0,3) -> KV heads [0,2), segment 1,000
    assert layout.num_tokens(0) == 600
    # params: layer = 64*16*(2*4 + 2*2) + 3*64*128 + 2*64 = 12,288 + 24,576 + 128 = 36,992;
    # 3 layers + embedding 6,400 + head 6,400 + final norm 64 = 123,840; 16 B each, 10 %.
    assert MODEL.params == 123_840
    assert rank0.model_states == int(123_840 * 16 * 0.1)
    # FSDP buffers: max(3 layers, head weights + grads) in BF16 = max(110,976, 12,800) * 2.
    assert rank0.sharding_buffers == 3 * 36_992 * 2
    # Checkpoints: 3 layers x 600 tokens x 64 hidden x 2 B.
    assert rank0.checkpoints == 3 * 600 * 64 * 2
    # Layer activations: sequence part 600 x (3*64 + 4*16 + 4*128) x 2 B; head part over
    # the 1,000-token segment: (2*3 + 2*2) x 16 x 2 B + 3 heads x 4 B (log-sum-exp).
    sequence = 600 * (192 + 64 + 512) * 2
    head = 1000 * (10 * 16 * 2 + 3 * 4)
    assert rank0.layer_activations == sequence + head
    assert rank0.mlp_activations == 600 * 4 * 128 * 2
    assert rank0.mlp_backward_transients == 600 * 3 * 128 * 2
    # dq/dk/dv (BF16) + FP32 dq accumulator over the segment.
    assert rank0.attention_backward_transients == 1000 * 16 * ((3 + 4) * 2 + 3 * 4)
    # Backward ring: largest visiting block (1,000 tokens) x 2 buffers x K,V x 2 KV heads x
    # 16 dims x (BF16 + FP32 dK/dV).
    assert rank0.ring_buffers == 2 * 1000 * 2 * 2 * 16 * 6
    assert rank0.logits == 600 * 100 * 6
    assert rank0.reserve == GPU_RESERVE_BYTES


def test_peak_is_persistent_terms_plus_largest_transient():
    layout = layout_two_groups_of_two()
    m = estimate_memory(CLUSTER, MODEL, TrainSpec(seq_len=1600), layout)[0]
    mlp_phase = m.layer_activations + m.mlp_backward_transients
    attention_phase = (
        m.layer_activations - m.mlp_activations + m.attention_backward_transients + m.ring_buffers
    )
    persistent = m.model_states + m.sharding_buffers + m.checkpoints + m.reserve
    assert m.peak_bytes == persistent + max(mlp_phase, attention_phase, m.logits)
    assert sum(m.terms().values()) == m.peak_bytes


def test_even_sharding_by_default():
    layout = layout_two_groups_of_two()
    memory = estimate_memory(CLUSTER, MODEL, TrainSpec(seq_len=1600), layout)
    assert {m.model_states for m in memory} == {int(123_840 * 16 / 4)}


def test_more_tokens_need_more_memory():
    model = ModelSpec.preset("llama3-8b")
    cluster = Cluster.preset("h100x8")
    short = build_uniform_layout(64 * 1024, model.heads, model.kv_heads, [8])
    long = build_uniform_layout(256 * 1024, model.heads, model.kv_heads, [8])
    peak = [
        estimate_memory(cluster, model, TrainSpec(seq_len=layout.seq_len), layout)[0].peak_bytes
        for layout in (short, long)
    ]
    assert peak[1] > peak[0]


def test_checkpointing_saves_memory():
    model = ModelSpec.preset("llama3-8b")
    cluster = Cluster.preset("h100x8")
    layout = build_uniform_layout(64 * 1024, model.heads, model.kv_heads, [8])
    with_ckpt, without = (
        estimate_memory(
            cluster, model, TrainSpec(seq_len=65536, activation_checkpointing=c), layout
        )[0]
        for c in (True, False)
    )
    assert without.checkpoints == model.layers * with_ckpt.layer_activations
    assert without.peak_bytes > with_ckpt.peak_bytes


def test_single_group_has_no_ring_buffers():
    layout = build_uniform_layout(1600, 4, 2, [4])
    memory = estimate_memory(CLUSTER, MODEL, TrainSpec(seq_len=1600), layout)
    assert all(m.ring_buffers == 0 for m in memory)


def test_limit_is_95_percent():
    assert memory_limit_bytes(80 * GiB) == int(0.95 * 80 * GiB)
    assert memory_limit_bytes(100) == 95


@pytest.mark.parametrize("preset", ["llama3-8b", "llama-30b"])
def test_published_scale(preset):
    # Sanity against known practice: 8B at 128K on 8x H100 fits comfortably; 30B at 512K on
    # 16 A100-80G is near the limit with even sharding (about 88 % under this model).
    model = ModelSpec.preset(preset)
    cluster = Cluster.preset("h100x8" if preset == "llama3-8b" else "a100x16")
    seq = 128 * 1024 if preset == "llama3-8b" else 512 * 1024
    layout = build_uniform_layout(seq, model.heads, model.kv_heads, [cluster.world_size])
    if model.heads % cluster.world_size:
        layout = build_uniform_layout(seq, model.heads, model.kv_heads, [1] * cluster.world_size)
    peak = estimate_memory(cluster, model, TrainSpec(seq_len=seq), layout)[0].peak_bytes
    assert 0.3 < peak / (80 * GiB) < 0.95
