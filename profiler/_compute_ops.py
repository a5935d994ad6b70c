"""The torch calls a compute point times, with their random inputs.

Attention calls the runtime's own kernel module (`hexiseq.runtime.kernels`, the one edge from
the profiler into the runtime), with the kernel `hexiseq.kernels.attention_kernel` names for the
device, dtype and head size: the kernel the runtime runs and the cost model prices. The
backward is given the forward's output and fp32 log-sum-exp, as the runtime's ring backward is.
Shapes as the runtime's tiles: q (1, H, L, D), k/v (1, H, S, D) (GQA expanded by the caller).
The kernel's name is recorded in each measurement's `extra["kernel"]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from hexiseq.kernels import attention_kernel as _kernel_rule
from hexiseq.runtime import kernels as runtime_kernels

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
    """(out, lse fp32) as the runtime's `block_forward` computes them."""
    return runtime_kernels.forward_with(kernel, q, k, v, causal=causal, scale=scale)


def _backward(kernel, dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) as the runtime's `block_backward` computes them."""
    return runtime_kernels.backward_with(
        kernel, dout, q, k, v, out, lse, causal=causal, scale=scale
    )
