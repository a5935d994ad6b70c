"""Which attention kernel runs where: one rule for the runtime, the profiler and the cost model.

The runtime (`hexiseq.runtime.kernels`) calls the kernel this module names for a tile's
device, dtype and head size; the profiler times that same kernel; the datasheet cost model
prices attention at that kernel's efficiency (`hexiseq/data/gpus.yaml`,
`attention_efficiency`). Keeping the choice here, pure and torch-free, means the three
cannot disagree.

Kernel names:
- `flash`: torch's FlashAttention-2 kernels (`aten._scaled_dot_product_flash_attention`),
  CUDA, fp16/bf16, head size a multiple of 8 up to 256.
- `cudnn`: cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention`); priced by
  the cost model, not yet called by the runtime.
- `efficient`: the memory-efficient (xFormers/CUTLASS) kernels, CUDA, incl. fp32.
- `cpu_flash`: the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`).
- `explicit`: the runtime's fp32 matmul + softmax reference (anything else).
"""

from __future__ import annotations

ATTENTION_KERNELS = ("flash", "cudnn", "efficient", "cpu_flash", "explicit")
"""Every kernel name `attention_kernel` may return or a cost model may be asked about."""

CUDA_MAX_HEAD_DIM = 256
"""Largest head size torch's CUDA flash and memory-efficient kernels take."""

_HALF_DTYPES = ("float16", "bfloat16")
_EFFICIENT_DTYPES = ("float16", "bfloat16", "float32")

LEGACY_KERNEL_NAMES = {"cuda_flash": "flash", "cuda_efficient": "efficient"}
"""Names profile rows written before this module carry (`extra["kernel"]`)."""


def attention_kernel(device: str, dtype: str, head_dim: int) -> str:
    """The attention kernel the runtime runs for a tile on `device` in `dtype` with `head_dim`.

    `device` is a torch device type (`"cuda"`, `"cpu"`, ...) or a GPU catalog name (every
    catalog GPU but `cpu` runs torch's CUDA kernels, ROCm included); `dtype` a torch dtype
    name with or without the `torch.` prefix. Returns one of ATTENTION_KERNELS.
    """
    kind = _device_type(device)
    dtype_name = dtype.removeprefix("torch.")
    if kind == "cpu":
        return "cpu_flash"
    cuda_head_dim_ok = head_dim % 8 == 0 and 0 < head_dim <= CUDA_MAX_HEAD_DIM
    if kind == "cuda" and cuda_head_dim_ok:
        if dtype_name in _HALF_DTYPES:
            return "flash"
        if dtype_name in _EFFICIENT_DTYPES:
            return "efficient"
    return "explicit"


def training_dtype(device: str) -> str:
    """The dtype hexiseq computes in on `device`: float32 on CPU, bfloat16 on GPUs."""
    return "float32" if _device_type(device) == "cpu" else "bfloat16"


def canonical_kernel_name(name: str) -> str:
    """`name` with the profiler's former names (`cuda_flash`, ...) mapped to the current ones."""
    return LEGACY_KERNEL_NAMES.get(name, name)


def _device_type(device: str) -> str:
    """torch device type of a device type or catalog GPU name."""
    if device in ("cpu", "cuda"):
        return device
    from hexiseq.catalog import gpu_catalog  # core; deferred so the runtime pays nothing

    if device in gpu_catalog():
        return "cuda"  # every catalog GPU runs torch's CUDA (or ROCm-as-CUDA) kernels
    return device
