"""What the fitted op-time regressions are linear in, for a profiled point and for a prediction.

One formula per op family serves both the fit (a `ProfileMeasurement`) and the prediction (the
`CostModel` arguments), so the two cannot drift apart. Time = Σ coefficient x feature, with:
- gemm: FLOPs, bytes read + written, kernel calls;
- attention_fwd, attention_bwd: FLOPs, masked FLOPs, (query, key) pairs x heads, bytes,
  kernel calls;
- elementwise: bytes read + written, kernel calls.
The calls term is the fixed cost of a launch (dispatch, synchronization, small-size overhead).
The pairs x heads term is attention's work that does not grow with head_dim: the softmax's
exponentials and rescaling, which FlashAttention-2 (arXiv:2307.08691, §3.1) counts apart from
the matmul FLOPs; without it one line cannot fit several head dims. The masked FLOPs are
those of the pairs a causal mask removes from the block's q_len x kv_len box: a kernel that
skips fully masked tiles (FlashAttention on GPU) spends little on them, one that computes the
box and masks it (the CPU flash kernel nearly does) the full rate; the fit finds out which.
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel.base import FloatOrArray
from hexiseq.flops import ATTENTION_BACKWARD_FACTOR, attention_flops
from hexiseq.profiles import ProfileMeasurement, attention_pairs

OP_FEATURES: dict[str, tuple[str, ...]] = {
    "gemm": ("flops", "bytes", "calls"),
    "attention_fwd": ("flops", "masked_flops", "pair_heads", "bytes", "calls"),
    "attention_bwd": ("flops", "masked_flops", "pair_heads", "bytes", "calls"),
    "elementwise": ("bytes", "calls"),
}
"""Features of each compute op family, in coefficient order."""

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Element size of the dtypes a profile may be taken in."""

_ATTENTION_PARAMS = ("q_len", "kv_len", "heads", "head_dim", "causal")


def size_key(op: str, measurement: ProfileMeasurement) -> float:
    """The size the extrapolation split sorts by: FLOPs for matmul-like ops, else bytes."""
    return measurement.flops if "flops" in OP_FEATURES.get(op, ()) else measurement.bytes_moved


def measurement_features(measurement: ProfileMeasurement) -> tuple[float, ...]:
    """The features of one timed call of a compute op (see the module docstring).

    Attention pairs and bytes are recomputed from the shape (`attention_pairs`,
    `attention_bytes`), as the prediction computes them; FLOPs and GEMM / elementwise bytes
    are the profiler's counts.
    Raises ValueError when an attention point lacks its shape or the dtype is unknown.
    """
    op, m = measurement.op, measurement
    if op == "elementwise":
        return (m.bytes_moved, 1.0)
    if op == "gemm":
        return (m.flops, m.bytes_moved, 1.0)
    missing = [name for name in _ATTENTION_PARAMS if name not in m.params]
    if missing:
        raise ValueError(f"attention point lacks params {', '.join(missing)}")
    q_len, kv_len, heads, head_dim = (int(m.params[name]) for name in _ATTENTION_PARAMS[:4])
    backward = op == "attention_bwd"
    pairs = attention_pairs(q_len, kv_len, causal=bool(m.params["causal"]))
    masked_flops = _attention_flops(q_len * kv_len - pairs, heads, head_dim, backward)
    nbytes = attention_bytes(
        q_len, kv_len, heads, head_dim, element_bytes(m.dtype), backward=backward
    )
    return (m.flops, float(masked_flops), float(pairs * heads), float(nbytes), 1.0)


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
    q, k, v, o, dO in and dq, dk, dv out (one K/V head per query head, as profiled)."""
    per_token = 4.0 if backward else 2.0
    return element_size * head_dim * heads * per_token * (q_tokens + kv_tokens)


def gemm_features(
    flops: FloatOrArray, bytes_moved: FloatOrArray | None, calls: FloatOrArray, element_size: int
) -> tuple[FloatOrArray, ...]:
    """GEMM features; unknown bytes are those of `calls` square GEMMs doing `flops` in all."""
    if bytes_moved is None:
        side = np.cbrt(flops / (2.0 * calls))  # 2·n³ FLOPs per n x n x n GEMM
        bytes_moved = calls * 3.0 * element_size * side * side
    return (flops, bytes_moved, calls)


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
) -> tuple[FloatOrArray, ...]:
    """Attention features of `calls` blocks of `q_tokens` x `kv_tokens` (each) doing `pairs`
    (query, key) pairs in all. Unknown token counts: square full blocks (nothing masked)."""
    if q_tokens is None or kv_tokens is None:
        q_tokens = kv_tokens = np.sqrt(pairs / calls)
    masked_pairs = np.maximum(calls * q_tokens * kv_tokens - pairs, 0.0)
    nbytes = calls * attention_bytes(
        q_tokens, kv_tokens, heads, head_dim, element_size, backward=backward
    )
    return (
        _attention_flops(pairs, heads, head_dim, backward),
        _attention_flops(masked_pairs, heads, head_dim, backward),
        pairs * heads,
        nbytes,
        calls,
    )


def _attention_flops(
    pairs: FloatOrArray, heads: FloatOrArray, head_dim: int, backward: bool
) -> FloatOrArray:
    """FLOPs as hexiseq/flops.py counts them: 4·D per pair and head forward, 2.5x backward."""
    flops = attention_flops(pairs, heads, head_dim)
    return flops * ATTENTION_BACKWARD_FACTOR if backward else flops
