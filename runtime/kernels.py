"""Block attention kernels that return the log-sum-exp, and their backward (torch).

The runtime's ring (`_block`) calls `block_forward` / `block_backward`, which run the kernel
`hexiseq.kernels.attention_kernel` names: the rule the cost model prices and the profiler
times by. The profiler makes the same calls itself (it may not import the runtime); a test
holds its calls equal to these.

A tile (see `_tiles`) is either fully visible or a square with the standard causal mask, so
every kernel here is called with `is_causal` and no mask tensor. Shapes: q (B, H, L, D),
k/v (B, H, S, D) with the same H (GQA is expanded by the caller), lse (B, H, L) in fp32.

- `cudnn`: cuDNN's fused attention, `aten._scaled_dot_product_cudnn_attention` with
  `compute_log_sumexp=True` and its `_backward`, on Hopper/Blackwell with a recent cuDNN
  (`cudnn_usable`). It returns the lse as (B, H, L, 1) fp32, reshaped here to (B, H, L), and is
  given it back as (B, H, L, 1). Its inputs, output and output gradient are made contiguous:
  torch caches one cuDNN graph per shape and q/k/v strides (`MHA.cpp`, `MHACacheKeyWrapper`),
  and the backward graph's output, dO and lse strides are not in that key, so they must be a
  function of the shape alone; contiguous tensors are also the layout every cuDNN 9 takes.
- `flash`: CUDA flash kernels for fp16/bf16; `efficient`: the memory-efficient kernels (fp32
  too: flash has no fp32), each with its own backward.
- `cpu_flash`: `aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`.
- `explicit`: anything else (other devices, float64 on CUDA, head sizes the CUDA kernels
  reject): an explicit fp32 matmul + softmax.

Fallback: `block_forward` / `block_backward` try the named kernel, then its fallbacks
(`hexiseq.kernels.kernel_candidates`: cudnn -> flash -> efficient). A kernel that raises (an
unsupported architecture, cuDNN or shape) is remembered for that (dtype, head size) with one
warning and not tried again in this process; out-of-memory is not a kernel failure and is
raised. The kernels that really ran are kept in a registry (`used_kernels`,
`take_used_kernels`) that the train loop records with each step.

The backward kernels are given the *global* (all-blocks) output and log-sum-exp, so each
block's gradients come out exact without knowing the other blocks: P = exp(S - lse_global)
and D = rowsum(dO * O_global) are what the softmax backward needs. Every kernel's lse is the
natural-log log-sum-exp of the scaled scores, so a block's forward and backward may even run
on different kernels.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from hexiseq.kernels import (
    attention_kernel,
    cudnn_attention_usable,
    kernel_candidates,
    kernels_label,
)

_used_kernels: set[str] = set()
_failed_kernels: dict[tuple[str, str, int], str] = {}
"""(kernel, dtype, head size) -> the one-line error that retired it in this process."""


def used_kernels() -> frozenset[str]:
    """Names of the attention kernels that ran since the last reset (whole process)."""
    return frozenset(_used_kernels)


def reset_used_kernels() -> None:
    """Forget which kernels ran (the failures stay remembered)."""
    _used_kernels.clear()


def take_used_kernels() -> str:
    """The kernels that ran since the last reset, as the store records them (sorted and
    comma-joined, e.g. "cudnn"; "" if none), and reset: one call per measured step."""
    label = kernels_label(_used_kernels)
    reset_used_kernels()
    return label


def failed_kernels() -> dict[tuple[str, str, int], str]:
    """(kernel, dtype, head size) -> error of each kernel retired by a failure."""
    return dict(_failed_kernels)


def cudnn_usable(device: torch.device) -> bool:
    """Whether `device` runs cuDNN attention here (`hexiseq.kernels.cudnn_attention_usable`):
    a CUDA (not ROCm) GPU with cuDNN, cuDNN SDPA not switched off by the user
    (`torch.backends.cuda.enable_cudnn_sdp(False)`), and no strict determinism asked for
    (cuDNN's attention backward is not deterministic)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    strict = torch.are_deterministic_algorithms_enabled()
    if strict and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cudnn_hardware_usable(index)


@functools.cache
def _cudnn_hardware_usable(device_index: int) -> bool:
    """The fixed part of `cudnn_usable`: the GPU's compute capability and the cuDNN loaded."""
    if torch.version.hip is not None or not torch.backends.cudnn.is_available():
        return False  # ROCm's "cudnn" is MIOpen, which has no such kernel
    capability = torch.cuda.get_device_capability(device_index)
    return cudnn_attention_usable(capability, torch.backends.cudnn.version())


def kernel_for(q_BHLD: torch.Tensor) -> str:
    """The kernel name (`hexiseq.kernels.attention_kernel`) for a tile with these queries."""
    device = q_BHLD.device
    usable = cudnn_usable(device) if device.type == "cuda" else None
    return attention_kernel(device.type, str(q_BHLD.dtype), q_BHLD.shape[-1], cudnn_usable=usable)


def block_forward(
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile: (out (B, H, L, D) in q's dtype, lse (B, H, L) fp32), on the
    kernel `kernel_for` names or its first fallback that runs."""
    args = (q_BHLD, k_BHSD, v_BHSD)
    kernel = kernel_for(q_BHLD)
    return _run_with_fallback(FORWARD_KERNELS, kernel, args, q_BHLD, k_BHSD, causal, scale)


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
    """(dq, dk, dv) of one tile given the global `out_BHLD` (q's dtype) and `lse_BHL` (fp32),
    on the kernel `kernel_for` names or its first fallback that runs."""
    args = (dout_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD, lse_BHL)
    kernel = kernel_for(q_BHLD)
    return _run_with_fallback(BACKWARD_KERNELS, kernel, args, q_BHLD, k_BHSD, causal, scale)


def _run_with_fallback(table: dict[str, Callable], kernel: str, args: tuple, q, k, causal, scale):
    """`table[kernel](*args)`, else the next of `kernel_candidates` (for `k`'s length) not
    retired for `q`'s dtype and head size; a failing kernel is retired (the last one's error
    is raised)."""
    shape_class = (str(q.dtype).removeprefix("torch."), int(q.shape[-1]))
    candidates = [
        name
        for name in kernel_candidates(kernel, int(k.shape[2]))
        if (name, *shape_class) not in _failed_kernels
    ]
    for position, name in enumerate(candidates):
        if name not in table:
            raise NotImplementedError(f"the runtime does not call the '{name}' attention kernel")
        try:
            result = table[name](*args, causal=causal, scale=scale)
        except torch.OutOfMemoryError:
            raise  # memory, not the kernel: a fallback would only hide it
        except RuntimeError as error:
            if position == len(candidates) - 1:
                raise
            _retire(name, shape_class, candidates[position + 1], error)
            continue
        _used_kernels.add(name)
        return result
    raise AssertionError("unreachable: the last candidate raises or returns")


def _retire(name: str, shape_class: tuple[str, int], instead: str, error: Exception) -> None:
    line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    _failed_kernels[(name, *shape_class)] = line
    dtype, head_dim = shape_class
    warnings.warn(
        f"hexiseq: the '{name}' attention kernel failed for {dtype} head_dim {head_dim} "
        f"({line}); running '{instead}' instead from now on",
        RuntimeWarning,
        stacklevel=4,
    )


def forward_with(
    kernel: str,
    q_BHLD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` on the named `kernel` alone, no fallback (see the module docstring)."""
    if kernel not in FORWARD_KERNELS:
        raise NotImplementedError(f"the runtime does not call the '{kernel}' attention kernel")
    return FORWARD_KERNELS[kernel](q_BHLD, k_BHSD, v_BHSD, causal=causal, scale=scale)


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
    """`block_backward` on the named `kernel` alone, no fallback (see the module docstring)."""
    if kernel not in BACKWARD_KERNELS:
        raise NotImplementedError(f"the runtime does not call the '{kernel}' attention kernel")
    args = (dout_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD, lse_BHL)
    return BACKWARD_KERNELS[kernel](*args, causal=causal, scale=scale)


def _cudnn_forward(q, k, v, *, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
        scale=scale,
    )  # fmt: skip
    batch, heads, rows = q.shape[:3]
    return out, lse.reshape(batch, heads, rows).float()  # cuDNN's lse is (B, H, L, 1)


def _cudnn_backward(dout, q, k, v, out, lse, *, causal, scale):
    # Dense call: no bias, cum_seq_q/k undefined (None), max_q/max_k the tile's lengths (the
    # kernel takes s_q and s_kv from them). No dropout, so the philox seed and offset are
    # never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.contiguous().unsqueeze(-1), no_rng, no_rng, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip


def _cuda_flash_forward(q, k, v, *, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse.float()


def _cuda_flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    # Dense (not varlen) call: cum_seq_q/k undefined (None); no dropout, so the philox seed
    # and offset are never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, causal, no_rng, no_rng, scale=scale,
    )  # fmt: skip


def _cuda_efficient_forward(q, k, v, *, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()  # drop the kernel's row padding


def _cuda_efficient_backward(dout, q, k, v, out, lse, *, causal, scale):
    # fp16/bf16 run the FP32 kernel on upcast inputs: given the global lse and output, the
    # half-precision backward returned wrong dQ (fp16: NaN; bf16: 1e34) for rows past the
    # first tile on an H200 (torch 2.11, cuDNN 9.19; profiles/h200-2026-11-26, recheck-1.log),
    # with the lse padded as its own forward pads it or not, while the FP32 kernel was right
    # on the same blocks. Slower (no bf16 tensor cores), but this kernel is the last fallback.
    if q.dtype != torch.float32:
        upcast = (t.float() for t in (dout, q, k, v, out))
        grads = _cuda_efficient_backward(*upcast, lse, causal=causal, scale=scale)
        return tuple(g.to(q.dtype) for g in grads)
    # No dropout: the philox seed and offset are never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, efficient_lse_layout(lse), no_rng, no_rng, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


EFFICIENT_LSE_ROW_ALIGNMENT = 32
"""The memory-efficient kernels' lse rows come padded to a multiple of this (PyTorch's
`kAlignLSE`); the forward writes +inf into the padding."""


def efficient_lse_layout(lse_BHL: torch.Tensor) -> torch.Tensor:
    """`lse_BHL` (FP32) laid out as the efficient kernel's own forward returns it: rows padded
    to a multiple of 32 with +inf (PyTorch's `kernel_forward.h`: "to make the backward
    easier, we pad logsumexp with inf"), so the backward never reads past it."""
    rows = lse_BHL.shape[-1]
    padded_rows = -(-rows // EFFICIENT_LSE_ROW_ALIGNMENT) * EFFICIENT_LSE_ROW_ALIGNMENT
    if padded_rows == rows:
        return lse_BHL.contiguous()
    padded = lse_BHL.new_full((*lse_BHL.shape[:-1], padded_rows), float("inf"))
    padded[..., :rows] = lse_BHL
    return padded


def _cpu_flash_forward(q, k, v, *, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse.float()


def _cpu_flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


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


FORWARD_KERNELS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "cudnn": _cudnn_forward,
    "flash": _cuda_flash_forward,
    "efficient": _cuda_efficient_forward,
    "cpu_flash": _cpu_flash_forward,
    "explicit": explicit_forward,
}
"""Kernel name -> forward call (q, k, v, *, causal, scale) -> (out, lse (B, H, L) fp32)."""

BACKWARD_KERNELS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {
    "cudnn": _cudnn_backward,
    "flash": _cuda_flash_backward,
    "efficient": _cuda_efficient_backward,
    "cpu_flash": _cpu_flash_backward,
    "explicit": explicit_backward,
}
"""Kernel name -> backward call (dout, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)."""
