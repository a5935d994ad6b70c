"""The torch calls a compute point times, with their random inputs.

Attention times the kernel `hexiseq.kernels.attention_kernel` names for the device, dtype and
head size (cuDNN on Hopper/Blackwell with a recent cuDNN, `runtime.kernels.cudnn_usable`): the
one rule the runtime runs by and the cost model prices by. Where that kernel raises, the next
of `hexiseq.kernels.kernel_candidates` is timed instead (cudnn -> flash -> efficient), as the
runtime falls back, and the failure is remembered for that dtype and head size. The kernel
that really ran is recorded in each measurement's `extra["kernel"]`.

The calls are the runtime's own (`hexiseq.runtime.kernels.forward_with` / `backward_with`: one
kernel module for both, the only part of the runtime the profiler may import, docs/design.md
§1), so the profiler cannot time a kernel call the runtime no longer makes. The backward is
given the forward's output and fp32 log-sum-exp, as the runtime's ring backward is. Shapes as
the runtime's tiles: q (1, H, L, D), k/v (1, H, S, D) (GQA expanded by the caller).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from hexiseq.kernels import attention_kernel as _kernel_rule
from hexiseq.kernels import kernel_candidates
from hexiseq.runtime.kernels import backward_with, cudnn_usable, forward_with

from ._points import Point

_SEED = 1234


class UnprofiledKernelError(RuntimeError):
    """The runtime would use its explicit fp32 fallback here; there is no fused kernel to time."""


_failed_kernels: dict[tuple[str, str, int], str] = {}
"""(kernel, dtype, head size) -> the error that retired it in this process (as the runtime)."""


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel the runtime runs for these inputs (`hexiseq.kernels.attention_kernel`)."""
    usable = cudnn_usable(device) if device.type == "cuda" else None
    return _kernel_rule(device.type, str(dtype), head_dim, cudnn_usable=usable)


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
    return _first_running_calls(point.params, random, input_sets, kernel, backward, dtype)


def _first_running_calls(params, random, input_sets, kernel, backward, dtype):
    """The calls of the first of `kernel_candidates` that runs (one untimed probe call), and
    its name; a kernel that raises is retired for this dtype and head size."""
    shape_class = (str(dtype).removeprefix("torch."), int(params["head_dim"]))
    candidates = [
        name
        for name in kernel_candidates(kernel, int(params["kv_len"]))
        if (name, *shape_class) not in _failed_kernels
    ]
    for position, name in enumerate(candidates):
        try:
            calls = _attention_calls(params, random, input_sets, name, backward)
            if len(candidates) > 1:
                _probe(calls[0])
        except torch.OutOfMemoryError:
            raise  # recorded as an OOM point, not a kernel failure
        except RuntimeError as error:
            if position == len(candidates) - 1:
                raise
            _failed_kernels[(name, *shape_class)] = (str(error).strip().splitlines() or [""])[0]
            continue
        return calls, name
    raise AssertionError("unreachable: the last candidate raises or returns")


def _probe(call: Callable[[], object]) -> None:
    """Run `call` once and wait for it, so a kernel that fails on this device fails here."""
    result = call()
    tensors = result if isinstance(result, tuple) else (result,)
    if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


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
    """(out, lse fp32): the runtime's call of `kernel`, no fallback."""
    return forward_with(kernel, q, k, v, causal=causal, scale=scale)


def _backward(kernel, dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv): the runtime's call of `kernel`, no fallback."""
    return backward_with(kernel, dout, q, k, v, out, lse, causal=causal, scale=scale)
