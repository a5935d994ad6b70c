"""A plan applied to a user's own Hugging Face model: Llama- and Qwen2-style decoders of
`transformers` (any model whose attention goes through transformers' attention interface).

    attention = apply_layout(model, layout, group)          # every rank of `group`, once
    ids, positions = shard_tokens(tokens_BS, layout, rank)  # this rank's tokens
    logits = model(input_ids=ids, position_ids=positions).logits
    loss = sequence_loss(logits, tokens_BS, layout, rank, group)
    loss.local_share.backward(); reduce_gradients(model, group); optimizer.step()

`apply_layout` swaps the model's attention for `CPHPAttention` on `group` (the way ring-
attention libraries patch transformers): it registers one attention function with
`transformers.AttentionInterface` (and a mask function that builds no mask: the causal mask
comes from the tokens' global positions inside `CPHPAttention`) and points the model's config
at it (a model built from the same config object shares that config: build the unpatched twin
of a test from a copy). Each rank then feeds only its own tokens with their global positions
(RoPE is applied by the model at those positions), and the loss is the mean over all labelled
tokens of the sequence, whatever the shard sizes (`hexiseq.runtime.loss`). Parameters stay
whole on every rank; their gradients are summed over the group (`reduce_gradients`). Sharding
model states (`hexiseq.runtime.sharding`) is left to the built-in model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hexiseq.errors import InputError
from hexiseq.layout import AttentionLayout
from hexiseq.runtime.attention import CPHPAttention
from hexiseq.runtime.loss import (
    ShardedLoss,
    all_reduce_gradients,
    next_token_labels,
    sharded_next_token_loss,
)
from hexiseq.runtime.model import token_positions

__all__ = ["ATTENTION_NAME", "apply_layout", "reduce_gradients", "sequence_loss", "shard_tokens"]

ATTENTION_NAME = "hexiseq_cphp"
"""The name under which the attention function is registered with transformers."""
_ATTENTION_ATTRIBUTE = "_hexiseq_cphp_attention"


def apply_layout(
    model: torch.nn.Module, layout: AttentionLayout, group: dist.ProcessGroup | None = None
) -> CPHPAttention:
    """Make every attention layer of `model` run `CPHPAttention(layout, group)` (collective
    over `group`); returns that module. Raises InputError, before any communication, when the
    model's heads do not match the layout's or it does not use transformers' attention
    interface."""
    config = getattr(model, "config", None)
    layers = _attention_layers(model)
    if config is None or not layers:
        raise InputError(
            "apply_layout: the model has no transformers config or no attention layers with "
            "a config (a Hugging Face PreTrainedModel such as LlamaForCausalLM is needed)"
        )
    _check_heads(config, layout)
    _register()
    attention = CPHPAttention(layout, group)
    for layer in layers:
        object.__setattr__(layer, _ATTENTION_ATTRIBUTE, attention)  # not a submodule
    model.set_attn_implementation(ATTENTION_NAME)
    return attention


def shard_tokens(
    tokens_BS: torch.Tensor, layout: AttentionLayout, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (B, T_rank) of the whole sequences `tokens_BS` and their global
    positions (B, T_rank), the model's `position_ids`."""
    if tokens_BS.dim() != 2 or tokens_BS.shape[1] != layout.seq_len:
        raise InputError(
            f"shard_tokens: tokens have shape {tuple(tokens_BS.shape)}; the layout needs "
            f"(batch, {layout.seq_len})"
        )
    positions_T = token_positions(layout, rank).to(tokens_BS.device)
    batch = tokens_BS.shape[0]
    return tokens_BS[:, positions_T], positions_T[None, :].expand(batch, -1)


def sequence_loss(
    logits_BTV: torch.Tensor,
    tokens_BS: torch.Tensor,
    layout: AttentionLayout,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> ShardedLoss:
    """The mean next-token loss of the whole sequences from this rank's logits (collective
    over `group`): back-propagate `.local_share`; `.global_loss` is the same on every rank."""
    positions_T = token_positions(layout, rank)
    return sharded_next_token_loss(logits_BTV, next_token_labels(tokens_BS, positions_T), group)


def reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of the model's parameters over `group` (each rank back-propagated
    only its tokens' share of the loss)."""
    all_reduce_gradients([p for p in model.parameters() if p.requires_grad], group)


def _attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules: those holding the attention's head counts in their config."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "config") and hasattr(module, "head_dim") and hasattr(module, "o_proj")
    ]


def _check_heads(config: Any, layout: AttentionLayout) -> None:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if (heads, kv_heads) != (layout.num_heads, layout.num_kv_heads):
        raise InputError(
            f"apply_layout: the model has {heads} query and {kv_heads} K/V heads but the "
            f"layout is for {layout.num_heads} and {layout.num_kv_heads}; plan for this model"
        )


def _register() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise InputError(
            "apply_layout needs transformers >= 4.56 (its attention and mask interfaces): "
            "pip install 'hexiseq[hf]'"
        ) from None

    AttentionInterface.register(ATTENTION_NAME, _cphp_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def _cphp_attention(
    module: torch.nn.Module,
    query_BHTD: torch.Tensor,
    key_BHTD: torch.Tensor,
    value_BHTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, T, D) in, (B, T, H, D) out."""
    attention = getattr(module, _ATTENTION_ATTRIBUTE, None)
    if attention is None:
        raise InputError("this attention layer was not given a layout; call apply_layout")
    if dropout:
        raise InputError(f"CPHPAttention has no attention dropout (the model asks {dropout})")
    out = attention(
        query_BHTD.transpose(1, 2),
        key_BHTD.transpose(1, 2),
        value_BHTD.transpose(1, 2),
        causal=True,
        scale=scaling,
    )
    return out, None


def _no_mask(*_: Any, **__: Any) -> None:
    """No mask tensor: `CPHPAttention` masks by the tokens' global positions itself."""
    return None
