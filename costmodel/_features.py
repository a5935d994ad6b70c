"""What the fitted op-time regressions are linear in, for a profiled point and for a prediction.

One formula per op family serves both the fit (a `ProfileMeasurement`) and the prediction (the
`CostModel` arguments), so the two cannot drift apart. Time = Σ coefficient x feature, with:
- gemm: FLOPs, bytes read + written, kernel calls, bytes beyond the L2 and beyond the
  last-level cache;
- attention_fwd, attention_bwd: FLOPs, masked FLOPs, (query, key) pairs x heads (those the
  softmax passes over), bytes, kernel calls;
- elementwise: bytes read + written, kernel calls, bytes of calls that do not fit in the L2
  and in the last-level cache.
The calls term is the fixed cost of a launch (dispatch, synchronization, small-size overhead).
The cache terms count the bytes a cache does not serve, x calls: a working set that no
longer fits streams from the next level at that level's lower bandwidth, so time per byte
steps up at each capacity (the roofline's memory ceiling per level, Williams et al., CACM
52(4), 2009). A blocked GEMM re-reads only the bytes beyond the capacity; a streaming kernel
(elementwise) misses on every line once its call does not fit (LRU), so all its bytes count.
The capacities are the machine's (`l2_bytes`, `llc_bytes` recorded by the profiler in each
row's `extra`) or the smaller effective ones the fit finds (`fit_effective_capacity`), kept
in the fit; a row without them has zero cache terms.
The pairs x heads term is attention's work that does not grow with head_dim: the softmax's
exponentials and rescaling, which FlashAttention-2 (arXiv:2307.08691, §3.1) counts apart from
the matmul FLOPs; without it one line cannot fit several head dims. It counts every pair the
softmax passes over, masked ones included where the kernel's tiles are known
(`softmax_pairs`). The masked FLOPs are
those of the pairs a causal mask removes but the kernel still computes. A kernel whose tiles
are known skips every tile that lies wholly above the diagonal and computes the rest in full:
the CPU flash kernel (`cpu_flash`, PyTorch aten/native/cpu/FlashAttentionKernel.cpp) splits
the queries in blocks of 32, 64 or 256 rows (q_len < 192, < 768, else) and the keys in blocks
of 512, and for query block [m, m + rows) computes the key blocks up to key m + rows; it
reads those keys and values again for every query block, which its bytes count. For other
kernels every masked pair is counted, keys are read once, and the fit finds the rates.

These are the features of the CPU (and of any device the catalog does not know). A catalog GPU
gets GPU-shaped ones (`hexiseq.costmodel._gpu_features`): wave quantization over its SMs and
FlashAttention-2's or cuDNN's tiles instead of cache terms and CPU flash tiles.
`measurement_features` picks by the row's device type; a fit names the features it used
(`feature_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from hexiseq.costmodel._gpu_features import (
    GPU_OP_FEATURES,
    flash_attention_features,
    gpu_gemm_features,
    gpu_memory_bound_features,
    gpu_traits,
    uses_gpu_features,
)
from hexiseq.costmodel.base import FloatOrArray
from hexiseq.flops import ATTENTION_BACKWARD_FACTOR, attention_flops
from hexiseq.profiles import ProfileMeasurement, attention_pairs

OP_FEATURES: dict[str, tuple[str, ...]] = {
    "gemm": ("flops", "bytes", "calls", "bytes_beyond_l2", "bytes_beyond_llc"),
    "attention_fwd": ("flops", "masked_flops", "pair_heads", "bytes", "calls"),
    "attention_bwd": ("flops", "masked_flops", "pair_heads", "bytes", "calls"),
    "elementwise": ("bytes", "calls", "bytes_out_of_l2", "bytes_out_of_llc"),
}
"""Features of each compute op family, in coefficient order (the cache terms last, so a
schema-1 fit's coefficients are a prefix)."""
LEGACY_OP_FEATURES: dict[str, tuple[str, ...]] = {
    "gemm": ("flops", "bytes", "calls"),
    "elementwise": ("bytes", "calls"),
}
"""Features of fits written before the cache terms (schema version 1), still read."""
FEATURE_SETS: dict[str, tuple[tuple[str, ...], ...]] = {
    op: (OP_FEATURES[op], GPU_OP_FEATURES[op]) for op in OP_FEATURES
}
"""The feature lists a fit of each op may name: the CPU's, a GPU's."""
CACHED_OPS = ("gemm", "elementwise")
"""Ops with cache terms (their last two features)."""
STREAMING_OPS = ("elementwise",)
"""Ops whose cache terms count a call's every byte once it does not fit (`cache_terms`)."""
CACHE_KEYS = ("l2_bytes", "llc_bytes")
"""The cache capacities (bytes) a profile row's `extra` records, in cache-term order."""
CPU_FLASH_KV_TILE = 512
"""Key block of the CPU flash kernel (see the module docstring)."""

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Element size of the dtypes a profile may be taken in."""

_ATTENTION_PARAMS = ("q_len", "kv_len", "heads", "head_dim", "causal")


def size_key(op: str, measurement: ProfileMeasurement) -> float:
    """The size the extrapolation split sorts by: FLOPs for matmul-like ops, else bytes."""
    return measurement.flops if "flops" in OP_FEATURES.get(op, ()) else measurement.bytes_moved


def feature_names(measurement: ProfileMeasurement) -> tuple[str, ...]:
    """The features `measurement_features` gives this row: a catalog GPU's (`GPU_OP_FEATURES`,
    attention only on a kernel whose grid is known, on a GPU with a known SM count), else the
    CPU's (`OP_FEATURES`)."""
    op, kernel = measurement.op, measurement.extra.get("kernel")
    if uses_gpu_features(op, gpu_traits(measurement.device_type), kernel):
        return GPU_OP_FEATURES[op]
    return OP_FEATURES[op]


def measurement_features(
    measurement: ProfileMeasurement, cache_bytes: Sequence[float] | None = None
) -> tuple[float, ...]:
    """The features of one timed call of a compute op (see the module docstring), in the
    order `feature_names` gives for the row.

    Attention pairs and bytes are recomputed from the shape (`attention_pairs`,
    `attention_bytes`), as the prediction computes them; FLOPs and GEMM / elementwise bytes
    are the profiler's counts; the attention kernel and the cache capacities come from
    `extra`, unless `cache_bytes` (a fit's `cache_bytes`, which may be the effective ones)
    names the capacities to use.
    Raises ValueError when an attention point lacks its shape or the dtype is unknown.
    """
    op, m = measurement.op, measurement
    cache = measurement_cache_bytes(m) if cache_bytes is None else tuple(cache_bytes)
    if feature_names(m) == GPU_OP_FEATURES[op]:
        return _gpu_measurement_features(m, cache)
    if op == "elementwise":
        return (m.bytes_moved, 1.0, *cache_terms(m.bytes_moved, 1.0, cache, streaming=True))
    if op == "gemm":
        cached = cache_terms(m.bytes_moved, 1.0, cache, streaming=False)
        return (m.flops, m.bytes_moved, 1.0, *cached)
    missing = [name for name in _ATTENTION_PARAMS if name not in m.params]
    if missing:
        raise ValueError(f"attention point lacks params {', '.join(missing)}")
    q_len, kv_len, heads, head_dim = (int(m.params[name]) for name in _ATTENTION_PARAMS[:4])
    backward = op == "attention_bwd"
    causal = bool(m.params["causal"])
    pairs = attention_pairs(q_len, kv_len, causal=causal)
    kernel = str(m.extra.get("kernel", ""))
    fraction, keys_read = kernel_tiles(q_len, kv_len, causal, kernel)
    masked_pairs = (q_len * kv_len - pairs) * fraction
    masked_flops = _attention_flops(masked_pairs, heads, head_dim, backward)
    nbytes = attention_bytes(
        q_len, keys_read, heads, head_dim, element_bytes(m.dtype), backward=backward
    )
    pair_heads = softmax_pairs(pairs, masked_pairs, kernel) * heads
    return (m.flops, float(masked_flops), float(pair_heads), float(nbytes), 1.0)


def _gpu_measurement_features(
    m: ProfileMeasurement, cache: Sequence[float] | None
) -> tuple[float, ...]:
    """`measurement_features` of a row of a catalog GPU (`_gpu_features`)."""
    traits = gpu_traits(m.device_type)
    if m.op == "elementwise":
        return gpu_memory_bound_features(m.bytes_moved, 1.0, cache[0] if cache else None)
    if m.op == "gemm":
        return gpu_gemm_features(m.flops, m.bytes_moved, 1.0, traits.ridge_flops_per_byte)
    missing = [name for name in _ATTENTION_PARAMS if name not in m.params]
    if missing:
        raise ValueError(f"attention point lacks params {', '.join(missing)}")
    q_len, kv_len, heads, head_dim = (int(m.params[name]) for name in _ATTENTION_PARAMS[:4])
    features = flash_attention_features(
        q_len, kv_len, heads, head_dim, causal=bool(m.params["causal"]),
        backward=m.op == "attention_bwd", calls=1.0, element_size=element_bytes(m.dtype),
        sm_count=traits.sm_count, kernel=m.extra.get("kernel"),
    )  # fmt: skip
    return tuple(float(value) for value in features)


def measurement_cache_bytes(measurement: ProfileMeasurement) -> tuple[float, float] | None:
    """(l2_bytes, llc_bytes) the profiler recorded for the row, or None (older rows)."""
    values = [measurement.extra.get(key) for key in CACHE_KEYS]
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0 for v in values):
        return None
    return (float(values[0]), float(values[1]))


def cache_terms(
    bytes_moved: FloatOrArray,
    calls: FloatOrArray,
    cache_bytes: Sequence[float] | None,
    *,
    streaming: bool,
) -> tuple[FloatOrArray, FloatOrArray]:
    """Per cache capacity, x `calls` equal calls: the bytes of a call beyond the capacity
    (a blocked kernel, GEMM, re-reads only what does not fit), or with `streaming` all its
    bytes once they do not fit (a streaming kernel under LRU misses on every line then).
    Zeros when the capacities are unknown."""
    if cache_bytes is None:
        zero = np.zeros_like(np.asarray(bytes_moved, dtype=np.float64))
        return (zero if zero.ndim else 0.0, zero if zero.ndim else 0.0)
    moved, many = np.broadcast_arrays(
        np.asarray(bytes_moved, dtype=np.float64), np.asarray(calls, dtype=np.float64)
    )
    per_call = np.divide(moved, many, out=np.zeros_like(moved), where=many > 0)  # 0 calls: 0
    terms = tuple(
        np.multiply(calls, bytes_out_of_cache(per_call, c, streaming)) for c in cache_bytes
    )
    return tuple(float(t) if np.ndim(t) == 0 else t for t in terms)  # type: ignore[return-value]


def bytes_out_of_cache(per_call_bytes, capacity: float, streaming: bool):
    """One call's bytes that a cache of `capacity` bytes does not serve (see `cache_terms`)."""
    if streaming:
        return np.where(per_call_bytes > capacity, per_call_bytes, 0.0)
    return np.maximum(per_call_bytes - capacity, 0.0)


def computed_masked_fraction(q_len: FloatOrArray, kv_len: FloatOrArray, kernel: str | None):
    """Fraction of a causal block's masked pairs that `kernel` computes anyway: for
    `cpu_flash` its tiles' share (module docstring), for square blocks; 1 otherwise."""
    return kernel_tiles(q_len, kv_len, True, kernel)[0]


def kernel_tiles(
    q_len: FloatOrArray, kv_len: FloatOrArray, causal: FloatOrArray, kernel: str | None
) -> tuple[FloatOrArray, FloatOrArray]:
    """(fraction of the masked pairs computed, key tokens read) of one block on `kernel`.

    The CPU flash kernel reads the keys (and values) once per query block, up to the last
    key block it computes; other kernels, as far as the model knows, once per block with
    every masked pair computed."""
    if kernel != "cpu_flash":
        ones = np.ones_like(np.asarray(q_len, dtype=np.float64))
        return (ones if ones.ndim else 1.0), kv_len
    fraction, keys = np.vectorize(_cpu_flash_tiles, otypes=[np.float64, np.float64])(
        q_len, kv_len, causal
    )
    if fraction.ndim == 0:
        return float(fraction), float(keys)
    return fraction, keys


@lru_cache(maxsize=4096)
def _cpu_flash_tiles(q_len: float, kv_len: float, causal: bool) -> tuple[float, float]:
    q_len, kv_len = int(round(q_len)), int(round(kv_len))
    q_tile = max(1, min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len))
    exact = attention_pairs(q_len, kv_len, causal=True)
    causal = bool(causal) and q_len == kv_len and q_len * kv_len > exact  # square diagonal
    computed = keys_read = 0
    for start in range(0, q_len, q_tile):
        rows = min(q_tile, q_len - start)
        keys = kv_len
        if causal:
            keys = min(-(-(start + rows) // CPU_FLASH_KV_TILE) * CPU_FLASH_KV_TILE, kv_len)
        computed += rows * keys
        keys_read += keys
    fraction = (computed - exact) / (q_len * kv_len - exact) if causal else 1.0
    return fraction, float(keys_read)


def softmax_pairs(
    pairs: FloatOrArray, computed_masked_pairs: FloatOrArray, kernel: str | None
) -> FloatOrArray:
    """(query, key) pairs the softmax of `kernel` passes over: the unmasked `pairs`, plus on
    a kernel whose tiles are known (`cpu_flash`) the masked pairs it computes.

    The CPU flash kernel works on a computed tile's full width: forward it sets the masked
    scores to -inf and runs the row max, exp and sum over every column, backward it
    recomputes exp(score - lse) and the softmax gradient over every column and zeroes the
    masked ones; so a computed masked pair costs the same work that does not grow with
    head_dim as an unmasked one. Left out of this term, that work goes to the masked FLOPs
    (4·D per pair), which then overcharge causal blocks of a large head_dim and undercharge
    those of a small one. For other kernels what they compute of the masked pairs is
    unknown: the masked FLOPs' fitted rate stands for all of it."""
    if kernel != "cpu_flash":
        return pairs
    return np.add(pairs, computed_masked_pairs)


def element_bytes(dtype: str) -> int:
    """Bytes per element of `dtype`; ValueError naming the known ones otherwise."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def attention_bytes(
    q_tokens: FloatOrArray,
    kv_tokens: FloatOrArray,
    heads: FloatOrArray,
    head_dim: float,
    element_size: float,
    *,
    backward: bool,
) -> FloatOrArray:
    """Bytes a fused attention kernel reads and writes: forward q, k, v in and o out; backward
    q, k, v, o, dO in and dq, dk, dv out (one K/V head per query head, as profiled).
    `kv_tokens`: the key tokens read, which a tiled kernel reads once per query block."""
    per_token = 4.0 if backward else 2.0
    return element_size * head_dim * heads * per_token * (q_tokens + kv_tokens)


def gemm_features(
    flops: FloatOrArray,
    bytes_moved: FloatOrArray | None,
    calls: FloatOrArray,
    element_size: int,
    cache_bytes: Sequence[float] | None = None,
) -> tuple[FloatOrArray, ...]:
    """GEMM features; unknown bytes are those of `calls` square GEMMs doing `flops` in all."""
    if bytes_moved is None:
        bytes_moved = square_gemm_bytes(flops, calls, element_size)
    return (
        flops,
        bytes_moved,
        calls,
        *cache_terms(bytes_moved, calls, cache_bytes, streaming=False),
    )


def square_gemm_bytes(flops: FloatOrArray, calls: FloatOrArray, element_size: int):
    """Bytes of `calls` square GEMMs doing `flops` in all (3 n² elements per 2 n³ FLOPs)."""
    side = np.cbrt(np.divide(flops, np.multiply(2.0, calls)))
    return np.multiply(calls, 3.0 * element_size * side * side)


def memory_bound_features(
    bytes_moved: FloatOrArray, calls: FloatOrArray, cache_bytes: Sequence[float] | None = None
) -> tuple[FloatOrArray, ...]:
    """Elementwise features of `calls` equal calls moving `bytes_moved` in all."""
    return (bytes_moved, calls, *cache_terms(bytes_moved, calls, cache_bytes, streaming=True))


def attention_features(
    pairs: FloatOrArray,
    heads: FloatOrArray,
    head_dim: int,
    *,
    backward: bool,
    q_tokens: FloatOrArray | None,
    kv_tokens: FloatOrArray | None,
    calls: FloatOrArray,
    element_size: int,
    kernel: str | None = None,
) -> tuple[FloatOrArray, ...]:
    """Attention features of `calls` blocks of `q_tokens` x `kv_tokens` (each) doing `pairs`
    (query, key) pairs in all, on `kernel` (its tiles decide the masked pairs computed).
    Unknown token counts: square full blocks (nothing masked)."""
    if q_tokens is None or kv_tokens is None:
        q_tokens = kv_tokens = np.sqrt(pairs / calls)
    masked_pairs = np.maximum(calls * q_tokens * kv_tokens - pairs, 0.0)
    fraction, keys_read = kernel_tiles(q_tokens, kv_tokens, masked_pairs > 0, kernel)
    nbytes = calls * attention_bytes(
        q_tokens, keys_read, heads, head_dim, element_size, backward=backward
    )
    masked_pairs = masked_pairs * fraction
    return (
        _attention_flops(pairs, heads, head_dim, backward),
        _attention_flops(masked_pairs, heads, head_dim, backward),
        softmax_pairs(pairs, masked_pairs, kernel) * heads,
        nbytes,
        calls,
    )


def _attention_flops(
    pairs: FloatOrArray, heads: FloatOrArray, head_dim: int, backward: bool
) -> FloatOrArray:
    """FLOPs as hexiseq/flops.py counts them: 4·D per pair and head forward, 2.5x backward."""
    flops = attention_flops(pairs, heads, head_dim)
    return flops * ATTENTION_BACKWARD_FACTOR if backward else flops
