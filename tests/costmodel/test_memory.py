"""Memory model terms against hand-computed values, and how they move with the plan."""

from __future__ import annotations

import pytest

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout, build_zigzag_layout
from hexiseq.catalog import GiB
from hexiseq.costmodel import estimate_memory, memory_limit_bytes
from hexiseq.costmodel.memory import CUDA_CONTEXT_BYTES, CUDA_WORKSPACE_BYTES, PHASES

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
    train = TrainSpec(seq_len=1600)  # bf16 compute, checkpointing: FSDP2 gathers in bf16
    memory = estimate_memory(CLUSTER, MODEL, train, layout, [0.1, 0.2, 0.3, 0.4])
    rank0 = memory[0]  # 600 tokens, heads [0,3) -> KV heads [0,2), segment 1,000
    assert layout.num_tokens(0) == 600
    # params: layer = 64*16*(2*4 + 2*2) + 3*64*128 + 2*64 = 12,288 + 24,576 + 128 = 36,992;
    # 3 layers + embedding 6,400 + head 6,400 + final norm 64 = 123,840. FP32 parameters and
    # gradients, FP32 AdamW moments (16 - 8 = 8 B), 10 % each.
    assert MODEL.params == 123_840
    assert (rank0.parameters, rank0.gradients) == (49_536, 49_536)
    assert rank0.optimizer_states == int(123_840 * 8 * 0.1)
    assert rank0.optimizer_transients == 0  # fused AdamW
    # Sharded: the root (embedding, head, final norm) gathered in bf16; in the backward a
    # block gathered again (bf16) and its bf16 gradients as the layer makes them.
    assert rank0.gathered_parameters == (6_400 + 6_400 + 64) * 2
    assert rank0.sharding_backward_buffers == 36_992 * 2 * 2
    # Stream in bf16 (sharded): embedding output + RoPE cos/sin (16 each), block outputs.
    assert rank0.embedding_output == 600 * (64 + 32) * 2
    assert rank0.checkpoints == 3 * 600 * 64 * 2
    assert rank0.block_output == 600 * 64 * 2
    assert rank0.saved_activations == 0  # checkpointing
    # A norm saves its input and its FP32 reciprocal RMS (4 B per token): the attention
    # norm's input is the block's input (a checkpoint), the MLP norm's the residual sum (bf16).
    norm = 600 * 4
    mlp_norm = 600 * (4 + 64 * 2)
    # Head form over the 1,000-token segment: q (3 heads) + K, V (2 heads) + out, bf16, and
    # the FP32 log-sum-exp of 3 heads; the output projection's input (all 4 heads, bf16).
    head_form = 1000 * ((2 * 48 + 2 * 32) * 2 + 3 * 4)
    # SwiGLU saves gate and up; the down projection saves their product (3 x ffn, bf16).
    mlp = mlp_norm + 600 * 64 * 2 + 3 * 600 * 128 * 2
    assert rank0.mlp_activations == mlp
    assert rank0.layer_activations == norm + 600 * 64 * 2 + head_form + 600 * 64 * 2 + mlp
    assert rank0.weight_cache == 0  # FSDP2 gathers bf16 weights: autocast casts nothing
    # The final norm's saved tensors (its input, the last block's output, is a checkpoint);
    # its output (bf16) is what the train loop holds, and the chunked loss makes no logits
    # beyond one chunk (here all 600 tokens): their bf16 logits with the FP32 upcast, the
    # bf16 hidden gradient and the FP32 weight gradient.
    assert rank0.head_activations == norm
    assert rank0.logits == 600 * 64 * 2
    assert rank0.loss_transients == 600 * 64 * 2 + 100 * 64 * 4 + 600 * 100 * (2 + 4)
    assert rank0.head_gradients == 100 * 64 * 2  # cast to the gathered weight's bf16
    # The final norm's backward: three FP32 T x E tensors and the bf16 input gradient.
    assert rank0.head_backward_transients == 600 * 64 * (3 * 4 + 2)
    assert rank0.mlp_backward_transients == 600 * (2 * 128 * 2 + 64 * 2)
    # Backward ring of two groups: at its peak (the last step) only the block in hand, the
    # largest visiting (1,000 tokens) x K,V x 2 KV heads x 16 dims, bf16.
    assert rank0.ring_buffers == 1000 * 2 * 2 * 16 * 2
    assert rank0.kernel_workspaces == CUDA_WORKSPACE_BYTES
    assert rank0.reserve == CUDA_CONTEXT_BYTES


def test_the_autocast_recipe_keeps_fp32_weights_and_stream():
    """The former one-rank recipe (the shared GPU runs): autocast casts the FP32 weights at
    every use and the residual stream stays FP32 (the embedding is not autocast)."""
    cluster = Cluster.from_dict(
        {"name": "one", "nodes": [{"name": "n0", "gpu": "A100-80G", "count": 1}]}
    )
    layout = build_uniform_layout(1600, 4, 2, [1])
    train = TrainSpec(seq_len=1600, runtime_recipe="autocast")
    m = estimate_memory(cluster, MODEL, train, layout)[0]
    assert m.gathered_parameters == m.sharding_backward_buffers == 0
    assert m.optimizer_transients == MODEL.params * 4  # foreach AdamW's sqrt(v), FP32
    assert m.checkpoints == 3 * 1600 * 64 * 4
    linear = 36_992 - 2 * 64
    assert m.weight_cache == 3 * linear * 2
    # The final norm's saved tensors (FP32 input: no upcast), its bf16 output saved by the
    # head and autocast's bf16 head weight copy; then every logit in bf16, upcast to FP32 by
    # the loss (log-softmax saved, its gradient, the logits' gradient: 12 B each).
    assert m.head_activations == 1600 * (64 * 4 + 4) + 1600 * 64 * 2 + 100 * 64 * 2
    assert m.logits == 1600 * 100 * 2
    assert m.loss_transients == 1600 * 100 * 12
    assert m.head_gradients == 100 * 64 * 4


def test_peak_is_the_largest_phase():
    layout = layout_two_groups_of_two()
    m = estimate_memory(CLUSTER, MODEL, TrainSpec(seq_len=1600), layout)[0]
    phases = m.phase_bytes()
    assert set(phases) == set(PHASES)
    assert m.allocated_bytes == max(phases.values())
    assert phases["optimizer"] == (
        m.parameters + m.gradients + m.optimizer_states + m.optimizer_transients + m.logits
        + m.kernel_workspaces
    )  # fmt: skip
    assert phases["loss"] - phases["forward_end"] == m.loss_transients
    head_backward = m.head_gradients + m.head_backward_transients
    assert phases["head_backward"] - phases["forward_end"] == head_backward
    assert m.peak_bytes == int(m.allocated_bytes * (1 + m.fragmentation)) + m.reserve
    assert sum(m.terms().values()) == m.peak_bytes


def test_even_sharding_by_default():
    layout = layout_two_groups_of_two()
    memory = estimate_memory(CLUSTER, MODEL, TrainSpec(seq_len=1600), layout)
    assert {m.model_states for m in memory} == {int(123_840 * 16 / 4)}
    assert {m.parameters for m in memory} == {int(123_840 * 4 / 4)}


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
    assert without.saved_activations == model.layers * without.layer_activations
    assert with_ckpt.saved_activations == 0
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
    # Sanity against known practice: 8B at 128K on 8x H100 fits comfortably (about 30 % under
    # this model); 30B at 512K on 16 A100-80G is near the limit with even sharding (86 %).
    model = ModelSpec.preset(preset)
    cluster = Cluster.preset("h100x8" if preset == "llama3-8b" else "a100x16")
    seq = 128 * 1024 if preset == "llama3-8b" else 512 * 1024
    layout = build_uniform_layout(seq, model.heads, model.kv_heads, [cluster.world_size])
    if model.heads % cluster.world_size:
        layout = build_uniform_layout(seq, model.heads, model.kv_heads, [1] * cluster.world_size)
    peak = estimate_memory(cluster, model, TrainSpec(seq_len=seq), layout)[0].peak_bytes
    assert 0.2 < peak / (80 * GiB) < 0.95


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("seq_len", [1600, 64_000])
def test_terms_follow_the_peak_phase(checkpointing, seq_len):
    """Each term is what the peak phase holds: no term negative, and they add up."""
    layout = build_zigzag_layout(
        seq_len, 4, 2, [[0, 1], [2, 3]], [seq_len // 2] * 2, [[3, 2], [1, 1]], [[3, 1], [2, 2]]
    )
    train = TrainSpec(seq_len=seq_len, activation_checkpointing=checkpointing)
    for m in estimate_memory(CLUSTER, MODEL, train, layout):
        terms = m.terms()
        assert all(value >= 0 for value in terms.values()), (m.peak_phase, terms)
        assert sum(terms.values()) == m.peak_bytes
        if m.peak_phase == "optimizer":
            assert terms["sharding_buffers"] == 0  # FSDP2 holds nothing gathered then
