"""The torch calls a compute point times, with their random inputs.

Attention times the kernel `hexiseq.kernels.attention_kernel` names for the device, dtype and
head size: the one rule the runtime runs by and the cost model prices by. The calls are the
ones `hexiseq.runtime.kernels` makes, written here because the profiler may not import the
runtime (DESIGN.md §1); `tests/profiler/test_compute_kernels.py` holds the two equal, output
for output, on every kernel the machine can run. The backward is given the forward's output
and fp32 log-sum-exp, as the runtime's ring backward is.
Shapes as the runtime's tiles: q (1, H, L, D), k/v (1, H, S, D) (GQA expanded by the caller).
The kernel's name is recorded in each measurement's `extra["kernel"]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from hexiseq.kernels import attention_kernel as _kernel_rule

from ._points import Point

_SEED = 1234


class UnprofiledKernelError(RuntimeError):
    """The runtime would use its explicit fp32 fallback here; there is no fused kernel to time."""


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel the runtime runs for these inputs (`hexiseq.kernels.attention_kernel`)."""
    return _kernel_rule(device.type, str(dtype), head_dim)


def build_calls(
    point: Point, device: torch.device, input_sets: int
) -> tuple[list[Callable[[], object]], str]:
    """One zero-argument call per input set, and the name of the kernel they run."""
    dtype = getattr(torch, point.dtype)
    generator = torch.Generator(device=device).manual_seed(_SEED)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)

    if point.op == "gemm":
        return _gemm_calls(point.params, random, input_sets), "linear"
    if point.op == "elementwise":
        return _elementwise_calls(point.params, random, input_sets), "add"
    kernel = attention_kernel(device, dtype, int(point.params["head_dim"]))
    if kernel == "explicit":
        raise UnprofiledKernelError(
            f"no fused attention kernel for {point.dtype} head_dim {point.params['head_dim']} "
            f"on {device.type}; the runtime falls back to explicit fp32 matmuls"
        )
    backward = point.op == "attention_bwd"
    return _attention_calls(point.params, random, input_sets, kernel, backward), kernel


def _gemm_calls(params, random, input_sets: int) -> list[Callable[[], object]]:
    m, n, k = params["m"], params["n"], params["k"]
    weight = random(n, k)  # one weight, several activations: as a layer sees successive batches
    inputs = [random(m, k) for _ in range(input_sets)]
    return [lambda x=x: functional.linear(x, weight) for x in inputs]


def _elementwise_calls(params, random, input_sets: int) -> list[Callable[[], object]]:
    numel = params["numel"]
    out = random(numel)
    pairs = [(random(numel), random(numel)) for _ in range(input_sets)]
    return [lambda a=a, b=b: torch.add(a, b, out=out) for a, b in pairs]


def _attention_calls(params, random, input_sets, kernel, backward):
    heads, head_dim = params["heads"], params["head_dim"]
    causal, scale = bool(params["causal"]), head_dim**-0.5
    calls = []
    for _ in range(input_sets):
        q = random(1, heads, params["q_len"], head_dim)
        k, v = (random(1, heads, params["kv_len"], head_dim) for _ in range(2))
        if not backward:
            calls.append(lambda q=q, k=k, v=v: _forward(kernel, q, k, v, causal, scale))
            continue
        out, lse = _forward(kernel, q, k, v, causal, scale)
        dout = random(*out.shape)
        args = (dout, q, k, v, out, lse)
        calls.append(lambda args=args: _backward(kernel, *args, causal, scale))
    return calls


def _forward(kernel, q, k, v, causal, scale):
    """(out, lse fp32) as the runtime's `forward_with` computes them."""
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.float()
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse.float()
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()  # drop the kernel's row padding


def _backward(kernel, dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) as the runtime's `backward_with` computes them."""
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
            0.0, causal, no_rng, no_rng, scale=scale,
        )  # fmt: skip
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), no_rng, no_rng, 0.0,
        [True, True, True, False], causal, scale=scale,
    )[:3]  # fmt: skip
