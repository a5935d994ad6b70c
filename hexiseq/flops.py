"""FLOP accounting for one training step (pure).

A multiply-add is 2 FLOPs. Forward FLOPs of the linear parts are 2 x (weights in matmuls) per
token (Kaplan et al. 2020, "Scaling Laws", Table 1; PaLM, Chowdhery et al. 2022, Appendix B).
Causal attention costs 4 x head_dim FLOPs per (query, key) pair and head in the forward pass
(Q·Kᵀ and P·V, 2 x head_dim each). The backward pass costs 2x the forward for matmuls (gradients
for inputs and weights) and 2.5x for attention: FlashAttention's backward runs five matmuls
against the forward's two, recomputing the scores (Dao 2023, FlashAttention-2, §3.1-3.2).
"""

from __future__ import annotations

from hexiseq.model import ModelSpec

LINEAR_BACKWARD_FACTOR = 2.0
ATTENTION_BACKWARD_FACTOR = 2.5  # five matmuls in FlashAttention's backward vs two in forward
MODEL_ATTENTION_BACKWARD_FACTOR = 2.0  # the MFU convention counts 2x (no recompute)


def linear_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's matmuls (q, k, v, o, SwiGLU) per token."""
    attention_weights = model.hidden * model.head_dim * (2 * model.heads + 2 * model.kv_heads)
    mlp_weights = 3 * model.hidden * model.ffn_hidden
    return 2.0 * (attention_weights + mlp_weights)


def head_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of the LM head (hidden -> vocab logits) per token."""
    return 2.0 * model.hidden * model.vocab


def attention_flops(pairs: float, heads: float, head_dim: int) -> float:
    """Forward FLOPs of attention over `pairs` (query, key) pairs for `heads` heads."""
    return 4.0 * head_dim * pairs * heads


def causal_pairs(seq_len: int) -> int:
    """(query, key) pairs with key <= query in a causal sequence of `seq_len` tokens."""
    return seq_len * (seq_len + 1) // 2


def model_flops_per_step(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs of one causal sequence, forward + backward, no recompute (MFU convention)."""
    linear = model.layers * linear_flops_per_token(model) * seq_len
    head = head_flops_per_token(model) * seq_len
    attention = model.layers * attention_flops(causal_pairs(seq_len), model.heads, model.head_dim)
    return (1 + LINEAR_BACKWARD_FACTOR) * (linear + head) + (
        1 + MODEL_ATTENTION_BACKWARD_FACTOR
    ) * attention


def hardware_flops_per_step(
    model: ModelSpec, seq_len: int, *, activation_checkpointing: bool
) -> float:
    """FLOPs actually executed: FlashAttention's 2.5x backward, plus the recomputed forward
    of every layer when activation checkpointing is on (the LM head is not recomputed)."""
    recompute = 1.0 if activation_checkpointing else 0.0
    linear = model.layers * linear_flops_per_token(model) * seq_len
    head = head_flops_per_token(model) * seq_len
    attention = model.layers * attention_flops(causal_pairs(seq_len), model.heads, model.head_dim)
    return (
        (1 + LINEAR_BACKWARD_FACTOR + recompute) * linear
        + (1 + LINEAR_BACKWARD_FACTOR) * head
        + (1 + ATTENTION_BACKWARD_FACTOR + recompute) * attention
    )


def matmul_params(model: ModelSpec) -> int:
    """Parameters that take part in matmuls: all but an untied input embedding and the norms."""
    norms = (2 * model.layers + 1) * model.hidden
    untied_embedding = 0 if model.tied_embeddings else model.embedding_params
    return model.params - untied_embedding - norms


def standard_flops_estimate(model: ModelSpec, seq_len: int) -> float:
    """The textbook estimate 6·N·T + 6·L·H·D·T² for one causal sequence of T tokens.

    PaLM's attention term (Appendix B) is 12·L·H·D·T per token for full attention; causal
    attention does half the pairs, giving 6·L·H·D·T² per sequence.
    """
    return 6.0 * matmul_params(model) * seq_len + 6.0 * model.layers * model.heads * (
        model.head_dim * seq_len**2
    )
