"""RMSNorm and SwiGLU's product as autograd functions that save only what their backward needs.

Left to autograd, RMSNorm in FP32 keeps its input's FP32 upcast and the FP32 normalized
input for the backward (8 bytes per element on a bf16 stream), and SwiGLU keeps silu(gate)
beside gate and up. These functions save the input and the FP32 reciprocal RMS per token
(RMSNorm), and gate and up (SwiGLU), and recompute the rest in the backward: the same values,
fewer bytes held per layer. `costmodel.memory` counts exactly these saved tensors.

RMSNorm runs ATen's fused kernels (`_fused_rms_norm` and its backward: one pass each way,
FP32 inside) on a device where this torch has both (CUDA; its CPU build has no fused
backward) and when the input and weight share a dtype; elsewhere the same math in plain
tensor operations. Both save the same tensors. On an H200 the unfused
chain was 64 ms of a 0.71 s step (3B model, 8K tokens: ten passes over each norm's input).

The math is in plain tensor functions, so `compile_elementwise()` can swap them for
`torch.compile`d versions (each chain fused into few kernels, with the same saved tensors
and so the same memory model); `hexiseq.runtime.train --compile` does that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as functional

_FUSED_RMS_NORM_BY_DEVICE: dict[str, bool] = {}


def fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_forward` / `_backward` run ATen's fused kernels for these tensors."""
    return x.dtype == weight.dtype and fused_rms_norm_available(x.device.type)


def fused_rms_norm_available(device_type: str) -> bool:
    """Whether this torch runs both fused RMSNorm kernels on `device_type` (tried once on a
    tiny input: an operator can exist without a kernel for the device)."""
    if device_type not in _FUSED_RMS_NORM_BY_DEVICE:
        _FUSED_RMS_NORM_BY_DEVICE[device_type] = _fused_rms_norm_runs(device_type)
    return _FUSED_RMS_NORM_BY_DEVICE[device_type]


def _fused_rms_norm_runs(device_type: str) -> bool:
    aten = torch.ops.aten
    if not (hasattr(aten, "_fused_rms_norm") and hasattr(aten, "_fused_rms_norm_backward")):
        return False
    x = torch.ones(1, 8, device=device_type)
    try:
        _, rstd = aten._fused_rms_norm(x, [8], x[0], 1e-6)
        aten._fused_rms_norm_backward(x, x, [8], rstd, x[0], [True, True])
    except (NotImplementedError, RuntimeError):
        return False
    return True


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x / sqrt(mean(x^2) + eps) * weight, computed in FP32 and returned in
    x's dtype; rstd the FP32 reciprocal RMS per token (shape (..., 1))."""
    if fused_rms_norm_applies(x, weight):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return rms_norm_forward_math(x, weight, eps)


def rms_norm_forward_math(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_forward` in plain tensor operations."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `rms_norm_forward`: with n = x * rstd and g = dy * weight,
    dx = rstd * (g - n * mean(g * n)) and dweight = sum over tokens of dy * n (FP32 math)."""
    if fused_rms_norm_applies(x, weight):
        return torch.ops.aten._fused_rms_norm_backward(
            dy, x, [x.shape[-1]], rstd, weight, [True, True]
        )
    return rms_norm_backward_math(dy, x, weight, rstd)


def rms_norm_backward_math(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_backward` in plain tensor operations. At most three FP32 tensors of x's
    size live at once (`dy` is never written: autograd may hand the same gradient to
    another branch)."""
    normed = x.float() * rstd
    dy32 = dy.float()
    weight_grad = (dy32 * normed).reshape(-1, x.shape[-1]).sum(0)
    g = dy32 * weight.float()
    del dy32
    g_dot_normed = (g * normed).mean(-1, keepdim=True)
    dx = g.sub_(normed.mul_(g_dot_normed)).mul_(rstd)
    return dx.to(x.dtype), weight_grad.to(weight.dtype)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functional.silu(gate) * up


def swiglu_backward(
    d_product: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of silu(gate) * up; silu's derivative by ATen's own kernel (FP32
    inside whatever the dtype, as autograd computes it). At most three tensors of the
    product's size live at once, `d_product` included."""
    d_gate = torch.ops.aten.silu_backward(d_product * up, gate)
    d_up = functional.silu(gate).mul_(d_product)
    return d_gate, d_up


_KERNELS = {
    "rms_norm_forward": rms_norm_forward,
    "rms_norm_backward": rms_norm_backward,
    "swiglu_forward": swiglu_forward,
    "swiglu_backward": swiglu_backward,
}
_EAGER = dict(_KERNELS)


def compile_elementwise(enabled: bool = True) -> None:
    """Run the four math functions through `torch.compile` (process-wide; dynamic shapes, so
    ranks of other token counts share the compiled code), or back to eager with
    `enabled=False`. Compiling twice (a re-plan's hand-over builds the model again) keeps the
    functions compiled once."""
    if enabled == elementwise_compiled():
        return
    for name, function in _EAGER.items():
        _KERNELS[name] = torch.compile(function, dynamic=True) if enabled else function


def elementwise_compiled() -> bool:
    return any(_KERNELS[name] is not _EAGER[name] for name in _EAGER)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm saving (x, weight, rstd) only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _KERNELS["rms_norm_forward"](x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        dx, weight_grad = _KERNELS["rms_norm_backward"](dy, x, weight, rstd)
        return dx, weight_grad, None


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up saving (gate, up) only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _KERNELS["swiglu_forward"](gate, up)

    @staticmethod
    def backward(ctx, d_product: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _KERNELS["swiglu_backward"](d_product, gate, up)
