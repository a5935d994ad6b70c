"""The torch calls a compute point times, with their random inputs.

Attention times the kernel `hexiseq.kernels.attention_kernel` names for the device, dtype and
head size (cuDNN on Hopper/Blackwell with a recent cuDNN, `_cudnn_usable`): the one rule the
runtime runs by and the cost model prices by. Where that kernel raises, the next of
`hexiseq.kernels.kernel_candidates` is timed instead (cudnn -> flash -> efficient), as the
runtime falls back, and the failure is remembered for that dtype and head size. The kernel
that really ran is recorded in each measurement's `extra["kernel"]`.

The calls are the ones `hexiseq.runtime.kernels` makes, written here because the profiler may
not import the runtime (docs/design.md §1); `tests/profiler/test_compute_kernels.py` holds the two
equal, output for output, on every kernel the machine can run (cuDNN's calls on meta tensors
elsewhere). The backward is given the forward's output and fp32 log-sum-exp, as the runtime's
ring backward is. Shapes as the runtime's tiles: q (1, H, L, D), k/v (1, H, S, D) (GQA
expanded by the caller).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional

from hexiseq.kernels import attention_kernel as _kernel_rule
from hexiseq.kernels import cudnn_attention_usable, kernel_candidates

from ._points import Point

_SEED = 1234


class UnprofiledKernelError(RuntimeError):
    """The runtime would use its explicit fp32 fallback here; there is no fused kernel to time."""


_failed_kernels: dict[tuple[str, str, int], str] = {}
"""(kernel, dtype, head size) -> the error that retired it in this process (as the runtime)."""


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel the runtime runs for these inputs (`hexiseq.kernels.attention_kernel`)."""
    usable = _cudnn_usable(device) if device.type == "cuda" else None
    return _kernel_rule(device.type, str(dtype), head_dim, cudnn_usable=usable)


def _cudnn_usable(device: torch.device) -> bool:
    """`hexiseq.runtime.kernels.cudnn_usable`, restated (the profiler may not import it)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    strict = torch.are_deterministic_algorithms_enabled()
    if strict and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cudnn_hardware_usable(index)


@functools.cache
def _cudnn_hardware_usable(device_index: int) -> bool:
    if torch.version.hip is not None or not torch.backends.cudnn.is_available():
        return False  # ROCm's "cudnn" is MIOpen, which has no such kernel
    capability = torch.cuda.get_device_capability(device_index)
    return cudnn_attention_usable(capability, torch.backends.cudnn.version())


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
    """(out, lse fp32) as the runtime's `forward_with` computes them."""
    if kernel == "cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
            scale=scale,
        )  # fmt: skip
        return out, lse.reshape(q.shape[:3]).float()  # cuDNN's lse is (B, H, L, 1)
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
    if kernel == "cudnn":
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.contiguous().unsqueeze(-1), no_rng, no_rng, None, None,
            None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )  # fmt: skip
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
            0.0, causal, no_rng, no_rng, scale=scale,
        )  # fmt: skip
    if q.dtype != torch.float32:  # the runtime's efficient backward: FP32 on upcast inputs
        upcast = [t.float() for t in (dout, q, k, v, out)]
        grads = _backward(kernel, *upcast, lse, causal, scale)
        return tuple(g.to(q.dtype) for g in grads)
    rows = lse.shape[-1]
    padded = lse.contiguous()
    if rows % 32:  # the rows padded to 32 with +inf, as the kernel's forward (and the runtime)
        padded = lse.new_full((*lse.shape[:-1], -(-rows // 32) * 32), float("inf"))
        padded[..., :rows] = lse
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, no_rng, no_rng, 0.0,
        [True, True, True, False], causal, scale=scale,
    )[:3]  # fmt: skip
