"""A tiny sweep grid shared by the profiler tests (a unique module name: test folders share
one import namespace)."""

from __future__ import annotations

TINY_GRID = """\
name: tiny
timing: {warmup_s: 0.0, samples: 10, input_sets: 2}
dtypes: {cpu: [float32]}
gemm: {ladder: [16, 32]}
attention: {q_lens: [16], kv_lens: [32], heads: [2], head_dims: [16], causal: [false, true]}
elementwise: {numels: [1024]}
links: {min_bytes: 1024, max_bytes: 2048}
"""
TINY_GRID_POINTS = 2 + 2 * 2 + 1  # gemm ladder; (full, causal) x (fwd, bwd); elementwise
