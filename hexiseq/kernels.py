"""Which attention kernel runs where: one rule for the runtime, the profiler and the cost model.

The runtime (`hexiseq.runtime.kernels`) calls the kernel this module names for a tile's
device, dtype and head size; the profiler times that same kernel; the datasheet cost model
prices attention at that kernel's efficiency (`hexiseq/data/gpus.yaml`,
`attention_efficiency`). Keeping the choice here, pure and torch-free, means the three
cannot disagree.

Kernel names:
- `cudnn`: cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention`), returning the
  log-sum-exp like the others. Named where torch's own SDPA prefers it (PyTorch
  `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`, `check_prefer_cudnn_attention`):
  NVIDIA Hopper and datacenter Blackwell (compute capability 9.x, 10.x) with cuDNN >= 9.15.1
  (older cuDNN mis-handles sequence lengths that are not multiples of 128, pytorch#169849),
  fp16/bf16, head size a multiple of 8 up to `CUDNN_MAX_HEAD_DIM` (`check_cudnn_tensor_shapes`:
  128 on every cuDNN 9; 256 needs cuDNN > 9.22 and its backward takes only 128/192/256), and
  keys of more than one token. On H100 it runs 1.7-1.9x the flash kernel (gpus.yaml, H100-SXM).
- `flash`: torch's FlashAttention-2 kernels (`aten._scaled_dot_product_flash_attention`),
  CUDA, fp16/bf16, head size a multiple of 8 up to 256.
- `efficient`: the memory-efficient (xFormers/CUTLASS) kernels, CUDA, incl. fp32.
- `cpu_flash`: the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`).
- `explicit`: the runtime's fp32 matmul + softmax reference (anything else).

Fallbacks (`kernel_candidates`): where the named kernel raises (a cuDNN or driver too old, an
architecture torch was not built for), the runtime and the profiler try `cudnn` -> `flash` ->
`efficient` in that order, and record the kernel that really ran.
"""

from __future__ import annotations

from functools import cache

ATTENTION_KERNELS = ("flash", "cudnn", "efficient", "cpu_flash", "explicit")
"""Every kernel name `attention_kernel` may return or a cost model may be asked about."""

CUDA_MAX_HEAD_DIM = 256
"""Largest head size torch's CUDA flash and memory-efficient kernels take."""

CUDNN_MAX_HEAD_DIM = 128
"""Largest head size cuDNN's fused attention takes forward and backward on every cuDNN 9."""

CUDNN_MIN_VERSION = 91501
"""cuDNN 9.15.1 (`torch.backends.cudnn.version()` numbering): torch's own SDPA prefers cuDNN
attention only from this version on (pytorch#169849: wrong results for sequence lengths that
are not multiples of 128 before it)."""

CUDNN_COMPUTE_CAPABILITY_MAJORS = (9, 10)
"""Hopper (sm90) and datacenter Blackwell (sm100, sm103): where torch prefers cuDNN attention
over FlashAttention-2 (`check_prefer_cudnn_attention`). Ampere and Ada run it about as fast as
FA2 (gpus.yaml), so they keep the flash kernel there, as torch does."""

CUDNN_ARCHITECTURES = ("hopper", "blackwell")
"""Catalog architectures (`hexiseq/data/gpus.yaml`) of those compute capabilities."""

FALLBACK_KERNELS: dict[str, tuple[str, ...]] = {
    "cudnn": ("flash", "efficient"),
    "flash": ("efficient",),
}
"""What the runtime and the profiler try, in order, when a kernel raises."""

_HALF_DTYPES = ("float16", "bfloat16")
_EFFICIENT_DTYPES = ("float16", "bfloat16", "float32")

LEGACY_KERNEL_NAMES = {"cuda_flash": "flash", "cuda_efficient": "efficient"}
"""Names profile rows written before this module carry (`extra["kernel"]`)."""


@cache
def attention_kernel(
    device: str, dtype: str, head_dim: int, *, cudnn_usable: bool | None = None
) -> str:
    """The attention kernel the runtime runs for a tile on `device` in `dtype` with `head_dim`.

    `device` is a torch device type (`"cuda"`, `"cpu"`, ...) or a GPU catalog name (every
    catalog GPU but `cpu` runs torch's CUDA kernels, ROCm included); `dtype` a torch dtype
    name with or without the `torch.` prefix. `cudnn_usable`: whether this GPU and cuDNN run
    cuDNN attention (`cudnn_attention_usable`, from the live device); None: judged from the
    catalog entry of `device` (NVIDIA Hopper or Blackwell), and True for a bare `"cuda"`.
    Returns one of ATTENTION_KERNELS.
    """
    kind = _device_type(device)
    dtype_name = dtype.removeprefix("torch.")
    if kind == "cpu":
        return "cpu_flash"
    cuda_head_dim_ok = head_dim % 8 == 0 and 0 < head_dim <= CUDA_MAX_HEAD_DIM
    if kind != "cuda" or not cuda_head_dim_ok:
        return "explicit"
    if dtype_name in _HALF_DTYPES:
        usable = _catalog_cudnn(device) if cudnn_usable is None else cudnn_usable
        return "cudnn" if usable and head_dim <= CUDNN_MAX_HEAD_DIM else "flash"
    if dtype_name in _EFFICIENT_DTYPES:
        return "efficient"
    return "explicit"


def cudnn_attention_usable(
    compute_capability: tuple[int, int] | None, cudnn_version: int | None
) -> bool:
    """Whether a CUDA GPU of `compute_capability` with cuDNN `cudnn_version` (None: no cuDNN,
    e.g. ROCm) runs cuDNN attention in hexiseq (see the module docstring)."""
    if compute_capability is None or cudnn_version is None:
        return False
    major = compute_capability[0]
    return major in CUDNN_COMPUTE_CAPABILITY_MAJORS and cudnn_version >= CUDNN_MIN_VERSION


def kernel_candidates(kernel: str, kv_len: int | None = None) -> tuple[str, ...]:
    """`kernel` and its fallbacks, in the order the runtime and the profiler try them; for a
    block of `kv_len` keys, without the kernels that cannot take it (cuDNN: one key)."""
    candidates = (kernel, *FALLBACK_KERNELS.get(kernel, ()))
    if kv_len is not None and kv_len < 2:
        candidates = tuple(name for name in candidates if name != "cudnn")
    return candidates


def kernels_label(kernels: set[str] | frozenset[str] | tuple[str, ...]) -> str:
    """The kernel names as the store records them: sorted, comma-joined ("" for none)."""
    return ",".join(sorted(set(kernels)))


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
    catalog = _catalog()
    if device in catalog:
        return "cuda"  # every catalog GPU runs torch's CUDA (or ROCm-as-CUDA) kernels
    return device


def _catalog_cudnn(device: str) -> bool:
    """Whether a catalog GPU runs cuDNN attention (NVIDIA Hopper or Blackwell, with a cuDNN
    as recent as torch's CUDA 13 wheels bring); True for a bare `cuda` device type."""
    spec = _catalog().get(device)
    if spec is None:
        return device == "cuda"
    return spec.vendor == "nvidia" and spec.architecture in CUDNN_ARCHITECTURES


def _catalog():
    from hexiseq.catalog import gpu_catalog  # core; deferred so the runtime pays nothing

    return gpu_catalog()
