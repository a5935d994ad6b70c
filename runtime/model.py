"""A Llama-style decoder for a `ModelSpec` whose attention runs on a sequence-sharded input.

RMSNorm, rotary position embedding (RoPE) at each token's *global* position, grouped-query
attention, SwiGLU MLP, tied or untied LM head (docs/design.md §8). Every rank builds every
parameter (initialized identically from a seed; `sharding` then splits the states) and a slice of
the tokens: the ranges the `AttentionLayout` gives it, concatenated in order. Everything but
attention is per token, so only the attention module needs the other ranks: `CPHPAttention(layout)`
in a process group, or `LocalAttention()` (plain causal attention on one process holding the whole
sequence in order) as the single-process reference.

Shapes carry suffixes: B batch, T tokens of this rank, H query heads, K K/V heads, D head size,
E hidden size, V vocabulary.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as functional
from torch import nn
from torch.utils.checkpoint import checkpoint

from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec
from hexiseq.runtime._elementwise import (
    RMSNormFunction,
    SwiGLUFunction,
    rms_norm_forward,
    swiglu_forward,
)

INIT_STD = 0.02  # GPT-2 / Llama reference initialization of the weight matrices


class LocalAttention(nn.Module):
    """Causal attention over a whole sequence held by one process, tokens in order 0..S-1.

    The single-process reference for `CPHPAttention`: same call, same shapes, no sharding.
    K/V head h // r serves query head h (GQA).
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
    ) -> torch.Tensor:
        """q (B, S, H, D), k and v (B, S, K, D) -> (B, S, H, D)."""
        ratio = q.shape[2] // k.shape[2]
        q_BHSD, k_BKSD, v_BKSD = (x.transpose(1, 2) for x in (q, k, v))
        k_BHSD = k_BKSD.repeat_interleave(ratio, dim=1)
        v_BHSD = v_BKSD.repeat_interleave(ratio, dim=1)
        out_BHSD = functional.scaled_dot_product_attention(
            q_BHSD, k_BHSD, v_BHSD, is_causal=causal
        )
        return out_BHSD.transpose(1, 2)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.autograd_math = False  # the former recipe's (`use_autograd_elementwise`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autograd_math:  # the same math, its intermediates kept by autograd
            return rms_norm_forward(x, self.weight, self.eps)[0]
        return RMSNormFunction.apply(x, self.weight, self.eps)  # saves x and rstd only


def rope_tables(
    positions_T: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D) of the rotation angles position * theta^(-2i/D) (rotate-half form).

    Angles are computed in float64: fp32 loses the low digits of position * frequency once
    positions reach the hundreds of thousands.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions_T.device)
    inverse_frequency = theta ** (-exponents / head_dim)
    angles_TD = positions_T.to(torch.float64)[:, None] * inverse_frequency[None, :]
    angles_TD = torch.cat([angles_TD, angles_TD], dim=-1)
    return angles_TD.cos().to(dtype), angles_TD.sin().to(dtype)


def apply_rope(x_BTHD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair of x by its token's angle (`RotaryEmbedding`)."""
    return RotaryEmbedding.apply(x_BTHD, cos_TD, sin_TD)


def rotate_pairs(
    x_BTHD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor, sign: int
) -> torch.Tensor:
    """x rotated by +angle (sign 1) or -angle (sign -1), pair (i, i + D/2) by pair: with
    x = (a, b), (a cos - sign b sin, b cos + sign a sin). The tables repeat their D/2 angles
    in both halves (`rope_tables`). Four kernels: two products, two in-place halves."""
    half = x_BTHD.shape[-1] // 2
    cos, sin = cos_TD[None, :, None, :], sin_TD[None, :, None, :]
    out, by_sin = x_BTHD * cos, x_BTHD * sin
    if sign > 0:
        out[..., :half] -= by_sin[..., half:]
        out[..., half:] += by_sin[..., :half]
    else:
        out[..., :half] += by_sin[..., half:]
        out[..., half:] -= by_sin[..., :half]
    return out


class RotaryEmbedding(torch.autograd.Function):
    """RoPE with an explicit backward: the rotation's transpose is the rotation by -angle, so
    dx = rotate(dy, -angle), and only the tables are saved. Autograd's own backward of the
    rotate-half form runs a zero-filled slice backward per half on top (on an H200 RoPE was
    about 25 ms of a 0.71 s step of the 3B model at 8K tokens)."""

    @staticmethod
    def forward(
        ctx, x_BTHD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(cos_TD, sin_TD)
        ctx.input_dtype = x_BTHD.dtype
        return rotate_pairs(x_BTHD, cos_TD, sin_TD, sign=1)

    @staticmethod
    def backward(ctx, dy_BTHD: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos_TD, sin_TD = ctx.saved_tensors
        return rotate_pairs(dy_BTHD, cos_TD, sin_TD, sign=-1).to(ctx.input_dtype), None, None


class SelfAttention(nn.Module):
    """q/k/v/o projections around a (sharded) attention call; no biases (Llama)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)

    def forward(
        self, x_BTE: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attention: nn.Module
    ) -> torch.Tensor:
        batch, tokens, _ = x_BTE.shape
        q = self.q_proj(x_BTE).view(batch, tokens, self.heads, self.head_dim)
        k = self.k_proj(x_BTE).view(batch, tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x_BTE).view(batch, tokens, self.kv_heads, self.head_dim)
        # Under autocast the projections are bf16 while RoPE's tables are fp32: keep q, k in
        # v's dtype, and run the attention (its own kernels, fp32 merge) outside autocast.
        q, k = apply_rope(q, *rope).to(v.dtype), apply_rope(k, *rope).to(v.dtype)
        with torch.autocast(x_BTE.device.type, enabled=False):
            out_BTHD = attention(q, k, v, causal=True)
        return self.o_proj(out_BTHD.reshape(batch, tokens, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False)
        self.autograd_math = False  # the former recipe's (`use_autograd_elementwise`)

    def forward(self, x_BTE: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x_BTE), self.up_proj(x_BTE)
        if self.autograd_math:
            return self.down_proj(swiglu_forward(gate, up))
        return self.down_proj(SwiGLUFunction.apply(gate, up))


def use_autograd_elementwise(model: nn.Module) -> None:
    """RMSNorm and SwiGLU left to autograd, as the former `autocast` recipe ran them (what
    `--state-sharding replicated` reproduces and the memory model prices for that recipe)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SwiGLU)):
            module.autograd_math = True


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attention = SelfAttention(spec)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = SwiGLU(spec)

    def forward(
        self, x_BTE: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attention: nn.Module
    ) -> torch.Tensor:
        h_BTE = x_BTE + self.attention(self.attention_norm(x_BTE), rope, attention)
        return h_BTE + self.mlp(self.mlp_norm(h_BTE))


class LlamaModel(nn.Module):
    """Token ids of this rank -> next-token logits of this rank's tokens (docs/design.md §8).

    `attention` is called as `attention(q, k, v, causal=True)` in sequence-sharded form by
    every layer (`CPHPAttention` holds no parameters, so one instance serves all layers).
    Build with `build_model` for identical, seeded parameters on every rank.

    With `checkpointing`, each block keeps only its input and runs its forward again in the
    backward pass (activation checkpointing, as the plan's `activation_checkpointing` says
    and the memory model and simulator count): the recompute repeats the block's all-to-alls
    and ring, on every rank in the same order.
    """

    def __init__(self, spec: ModelSpec, attention: nn.Module, checkpointing: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.checkpointing = checkpointing
        self.embedding = nn.Embedding(spec.vocab, spec.hidden)
        self.blocks = nn.ModuleList(DecoderBlock(spec) for _ in range(spec.layers))
        self.final_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.before_forward: Callable[[], None] | None = None
        """Called first by every forward: `sharding` binds the root's gathered weights."""

    def forward(self, tokens_BT: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T) at global positions (T,)."""
        return self.lm_head(self.hidden_states(tokens_BT, positions_T))

    def hidden_states(self, tokens_BT: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, E): what the LM head (or a chunked loss over
        `lm_head.weight`) turns into logits."""
        if self.before_forward is not None:
            self.before_forward()
        x_BTE = self.embedding(tokens_BT)
        rope = rope_tables(positions_T, self.spec.head_dim, x_BTE.dtype, self.spec.rope_theta)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x_BTE = checkpoint(block, x_BTE, rope, self.attention, use_reentrant=False)
            else:
                x_BTE = block(x_BTE, rope, self.attention)
        return self.final_norm(x_BTE)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Every parameter set to `initial_value(its name, its shape, seed)`, so every rank
        (and the single-process reference) gets the same values on any device."""
        for name, parameter in self.named_parameters():  # a tied weight is listed once
            parameter.copy_(initial_value(name, parameter.shape, seed).to(parameter.dtype))


def initial_value(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial FP32 value (on the CPU) of the parameter `name`: norms 1, weights
    N(0, 0.02) from a generator seeded by `seed` and the name alone, so any rank can draw any
    parameter without drawing the others (the sharded build draws only its shard's)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * INIT_STD


def build_model(
    spec: ModelSpec,
    attention: nn.Module,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    checkpointing: bool = False,
) -> LlamaModel:
    """A `LlamaModel` with parameters from `reset_parameters(seed)`, on `device` in `dtype`.

    Built on the meta device first, so no time goes into a default initialization.
    """
    with torch.device("meta"):
        model = LlamaModel(spec, attention, checkpointing)
    if torch.device(device).type == "meta":
        return model  # shapes only: `sharding.shard_model_states(seed=...)` fills it
    model.to_empty(device=device)
    if spec.tied_embeddings:  # to_empty makes a fresh tensor per module; tie them again
        model.lm_head.weight = model.embedding.weight
    model.reset_parameters(seed)
    return model.to(dtype)


def token_positions(layout: AttentionLayout, rank: int) -> torch.Tensor:
    """Global positions (T,) of `rank`'s tokens in its order (its ranges concatenated)."""
    pieces = [torch.arange(start, end) for start, end in layout.token_ranges[rank]]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
