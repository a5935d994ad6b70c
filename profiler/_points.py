"""The points of a sweep, expanded from a grid, with their FLOPs and bytes (pure, no torch).

Conventions (docs/design.md §2, §5; `hexiseq.flops` cites the sources):
- gemm: 2·m·n·k FLOPs; bytes = (m·k + n·k + m·n) elements read or written once.
- attention_fwd: 4·head_dim·pairs·heads FLOPs, pairs the exact count of computed (query, key)
  pairs (`hexiseq.profiles.attention_pairs`: causal blocks are square, diagonal included);
  bytes = q, k, v read, out written, fp32 log-sum-exp written.
- attention_bwd: 2.5x the forward FLOPs (FlashAttention's recompute); bytes = dout, q, k, v,
  out and the log-sum-exp read, dq, dk, dv written.
- elementwise: c = a + b, 0 FLOPs (bandwidth-bound); bytes = 3·numel elements.
- links: bytes_moved is what one rank sends: the message for p2p, (world - 1) messages for
  all_to_all and (world - 1) shards for all_gather / reduce_scatter (ring algorithms).
"""

from __future__ import annotations

from dataclasses import dataclass

from hexiseq.flops import ATTENTION_BACKWARD_FACTOR, attention_flops
from hexiseq.model import ModelSpec
from hexiseq.profiles import ProfileKey, attention_pairs, profile_key

from ._grid import AttentionSpec, DeviceKind, GemmSpec, Grid

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
LSE_BYTES = 4  # the kernels return the log-sum-exp in fp32
P2P_DIRECTIONS = ("next", "prev")


@dataclass(frozen=True)
class Point:
    """One point to measure: op, shape, dtype and the work one call does."""

    op: str
    params: dict[str, int | float | bool | str]
    dtype: str
    flops: float
    bytes_moved: float

    def key(self, device_type: str, link_class: str | None, slowdown: float = 1.0) -> ProfileKey:
        """The point's identity in the store (`hexiseq.profiles.ProfileKey`)."""
        return profile_key(device_type, self.op, self.params, self.dtype, link_class, slowdown)


def compute_points(grid: Grid, device_kind: DeviceKind) -> tuple[list[Point], int]:
    """All compute points of `grid` for one device kind, and how many were left out for
    exceeding `max_gflop_per_call`. Each family is ordered by size, smallest first, so a
    failing size comes after everything smaller has been written."""
    points: list[Point] = []
    for dtype in grid.dtypes.get(device_kind, []):
        if grid.gemm is not None:
            points += sorted(gemm_points(grid.gemm, dtype), key=_size)
        if grid.attention is not None:
            points += sorted(attention_points(grid.attention, dtype), key=_size)
        if grid.elementwise is not None:
            points += [elementwise_point(n, dtype) for n in sorted(set(grid.elementwise.numels))]
    limit_gflop = grid.max_gflop_per_call.get(device_kind)
    if limit_gflop is None:
        return points, 0
    kept = [p for p in points if p.flops <= limit_gflop * 1e9]
    return kept, len(points) - len(kept)


def _size(point: Point) -> tuple[float, float]:
    return (point.flops, point.bytes_moved)


def gemm_shapes(model: ModelSpec, tokens: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of one layer's linear layers and the LM head for `tokens` tokens."""
    q_width, kv_width = model.heads * model.head_dim, model.kv_heads * model.head_dim
    return [
        (tokens, q_width, model.hidden),  # q projection
        (tokens, kv_width, model.hidden),  # k and v projections
        (tokens, model.hidden, q_width),  # o projection
        (tokens, model.ffn_hidden, model.hidden),  # SwiGLU gate and up
        (tokens, model.hidden, model.ffn_hidden),  # SwiGLU down
        (tokens, model.vocab, model.hidden),  # LM head
    ]


def gemm_points(spec: GemmSpec, dtype: str) -> list[Point]:
    """Model shapes for every (model, tokens) plus the square ladder, each shape once."""
    shapes = {(size, size, size) for size in spec.ladder}
    for name in spec.models:
        model = ModelSpec.preset(name)
        for tokens in spec.tokens:
            shapes.update(gemm_shapes(model, tokens))
    return [gemm_point(m, n, k, dtype) for m, n, k in sorted(shapes)]


def gemm_point(m: int, n: int, k: int, dtype: str) -> Point:
    bytes_moved = (m * k + n * k + m * n) * DTYPE_BYTES[dtype]
    return Point("gemm", {"m": m, "n": n, "k": k}, dtype, 2.0 * m * n * k, bytes_moved)


def attention_points(spec: AttentionSpec, dtype: str) -> list[Point]:
    """Full blocks over q_lens x kv_lens, causal blocks on the diagonal (q_len = kv_len)."""
    blocks = set()
    for causal in spec.causal:
        for q_len in spec.q_lens:
            kv_lens = [q_len] if causal else spec.kv_lens
            blocks.update((q_len, kv_len, causal) for kv_len in kv_lens)
    ops = ("attention_fwd", "attention_bwd") if spec.backward else ("attention_fwd",)
    return [
        attention_point(op, q_len, kv_len, heads, head_dim, causal, dtype)
        for op in ops
        for q_len, kv_len, causal in sorted(blocks)
        for heads in sorted(set(spec.heads))
        for head_dim in sorted(set(spec.head_dims))
    ]


def attention_point(
    op: str, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool, dtype: str
) -> Point:
    pairs = attention_pairs(q_len, kv_len, causal=causal)
    forward_flops = attention_flops(pairs, heads, head_dim)
    q_elements, kv_elements = heads * q_len * head_dim, heads * kv_len * head_dim
    lse_bytes = heads * q_len * LSE_BYTES
    if op == "attention_fwd":
        flops, elements = forward_flops, 2 * q_elements + 2 * kv_elements  # q, out; k, v
    else:  # dout, q, out, dq; k, v, dk, dv
        flops, elements = ATTENTION_BACKWARD_FACTOR * forward_flops, 4 * (q_elements + kv_elements)
    params = {"q_len": q_len, "kv_len": kv_len, "heads": heads, "head_dim": head_dim}
    params["causal"] = causal
    return Point(op, params, dtype, flops, elements * DTYPE_BYTES[dtype] + lse_bytes)


def elementwise_point(numel: int, dtype: str) -> Point:
    return Point("elementwise", {"numel": numel}, dtype, 0.0, 3.0 * numel * DTYPE_BYTES[dtype])


def link_points(grid: Grid, world: int) -> list[Point]:
    """Every link op of the grid at every message size for `world` ranks, by size."""
    spec = grid.links
    if spec is None:
        return []
    points = []
    for message_bytes in spec.message_sizes():
        for op in spec.ops:
            directions = P2P_DIRECTIONS if op == "p2p" else (None,)
            points += [link_point(op, world, message_bytes, spec.dtype, d) for d in directions]
    return points


def link_point(
    op: str, world: int, message_bytes: int, dtype: str, direction: str | None = None
) -> Point:
    params: dict[str, int | float | bool | str] = {"world": world, "message_bytes": message_bytes}
    if direction is not None:
        params["direction"] = direction
    peers_sent_to = 1 if op == "p2p" else world - 1
    return Point(op, params, dtype, 0.0, float(peers_sent_to * message_bytes))
