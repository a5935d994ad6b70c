"""Block attention kernels that return the log-sum-exp, and their backward (torch).

The runtime's ring (`_block`) calls `block_forward` / `block_backward`, which run the kernel
`hexiseq.kernels.attention_kernel` names: the rule the cost model prices and the profiler
times by. The profiler makes the same calls itself (it may not import the runtime); a test
holds its calls equal to these.

A tile (see `_tiles`) is either fully visible or a square with the standard causal mask, so
every kernel here is called with `is_causal` and no mask tensor. Shapes: q (B, H, L, D),
k/v (B, H, S, D) with the same H (GQA is expanded by the caller), lse (B, H, L) in fp32.

- `cpu_flash`: `aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`.
- `flash`: CUDA flash kernels for fp16/bf16; `efficient`: the memory-efficient kernels (fp32
  too: flash has no fp32), each with its own backward.
- `explicit`: anything else (other devices, float64 on CUDA, head sizes the CUDA kernels
  reject): an explicit fp32 matmul + softmax.
- `cudnn` is priced by the cost model but not called here yet.

The backward kernels are given the *global* (all-blocks) output and log-sum-exp, so each
block's gradients come out exact without knowing the other blocks: P = exp(S - lse_global)
and D = rowsum(dO * O_global) are what the softmax backward needs.
"""

from __future__ import annotations

import torch

from hexiseq.kernels import attention_kernel


def kernel_for(q_BHLD: torch.Tensor) -> str:
    """The kernel name (`hexiseq.kernels.attention_kernel`) for a tile with these queries."""
    return attention_kernel(q_BHLD.device.type, str(q_BHLD.dtype), q_BHLD.shape[-1])


def block_forward(
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile: (out (B, H, L, D) in q's dtype, lse (B, H, L) fp32)."""
    return forward_with(kernel_for(q_BHLD), q_BHLD, k_BHSD, v_BHSD, causal=causal, scale=scale)


def forward_with(
    kernel: str,
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` on the named `kernel` (see the module docstring)."""
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHLD, k_BHSD, v_BHSD, 0.0, causal, scale=scale
        )
        return out, lse.float()
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q_BHLD, k_BHSD, v_BHSD, 0.0, causal, False, scale=scale
        )
        return out, lse.float()
    if kernel == "efficient":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q_BHLD, k_BHSD, v_BHSD, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q_BHLD.shape[2]].float()  # drop the kernel's row padding
    if kernel == "explicit":
        return explicit_forward(q_BHLD, k_BHSD, v_BHSD, causal=causal, scale=scale)
    raise NotImplementedError(f"the runtime does not call the '{kernel}' attention kernel")


def block_backward(
    dout_BHLD: torch.Tensor,
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHLD: torch.Tensor,
    lse_BHL: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one tile given the global `out_BHLD` (q's dtype) and `lse_BHL` (fp32)."""
    args = (dout_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD, lse_BHL)
    return backward_with(kernel_for(q_BHLD), *args, causal=causal, scale=scale)


def backward_with(
    kernel: str,
    dout_BHLD: torch.Tensor,
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHLD: torch.Tensor,
    lse_BHL: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_backward` on the named `kernel` (see the module docstring)."""
    args = (dout_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args, lse_BHL, 0.0, causal, scale=scale
        )
    if kernel == "flash":
        return _cuda_flash_backward(*args, lse_BHL, causal=causal, scale=scale)
    if kernel == "efficient":
        return _cuda_efficient_backward(*args, lse_BHL, causal=causal, scale=scale)
    if kernel == "explicit":
        return explicit_backward(*args, lse_BHL, causal=causal, scale=scale)
    raise NotImplementedError(f"the runtime does not call the '{kernel}' attention kernel")


def _cuda_flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    # Dense (not varlen) call: cum_seq_q/k undefined (None); no dropout, so the philox seed
    # and offset are never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, causal, no_rng, no_rng, scale=scale,
    )  # fmt: skip


def _cuda_efficient_backward(dout, q, k, v, out, lse, *, causal, scale):
    # The kernel reads lse through its batch and head strides (its own forward pads rows to a
    # multiple of 32; an exact (B, H, L) tensor reads the same rows). No dropout: the philox
    # seed and offset are never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), no_rng, no_rng, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def explicit_forward(
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference kernel in fp32: softmax(q k^T * scale) v, with its log-sum-exp."""
    scores = _scores(q_BHLD, k_BHSD, causal=causal, scale=scale)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse[..., None])
    out = probabilities @ v_BHSD.float()
    return out.to(q_BHLD.dtype), lse


def explicit_backward(
    dout_BHLD: torch.Tensor,
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHLD: torch.Tensor,
    lse_BHL: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax backward in fp32 (FlashAttention-2, Dao 2023, Alg. 2): dS = P * (dP - D)."""
    dout = dout_BHLD.float()
    scores = _scores(q_BHLD, k_BHSD, causal=causal, scale=scale)
    probabilities = torch.exp(scores - lse_BHL[..., None])  # masked entries: exp(-inf) = 0
    dv = probabilities.transpose(-1, -2) @ dout
    dprobabilities = dout @ v_BHSD.float().transpose(-1, -2)
    delta = (dout * out_BHLD.float()).sum(dim=-1, keepdim=True)
    dscores = probabilities * (dprobabilities - delta) * scale
    dq = dscores @ k_BHSD.float()
    dk = dscores.transpose(-1, -2) @ q_BHLD.float()
    dtype = q_BHLD.dtype
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _scores(q_BHLD, k_BHSD, *, causal, scale):
    scores = (q_BHLD.float() @ k_BHSD.float().transpose(-1, -2)) * scale
    if causal:  # top-left aligned lower triangle; tiles are square
        rows, keys = scores.shape[-2:]
        hidden = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores
