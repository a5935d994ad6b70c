"""Sweep points expanded from a grid, and their FLOP and byte counts (pure)."""

from __future__ import annotations

import pytest

from hexiseq.model import ModelSpec
from hexiseq.profiler import builtin_grid_path, load_grid
from hexiseq.profiler._points import (
    attention_point,
    compute_points,
    gemm_point,
    gemm_shapes,
    link_points,
)
from hexiseq.profiles import attention_pairs


def test_gemm_flops_and_bytes() -> None:
    point = gemm_point(64, 128, 256, "float32")
    assert point.flops == 2 * 64 * 128 * 256
    assert point.bytes_moved == 4 * (64 * 256 + 128 * 256 + 64 * 128)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "causal", "pairs"),
    [
        (4, 4, False, 16),
        (4, 4, True, 10),  # 1 + 2 + 3 + 4: the diagonal is computed
        (2, 4, True, 3),  # wide block stops at the diagonal
        (4, 2, True, 3 + 2 * 2),  # tall block: rows below the square see every key
        (3, 5, False, 15),
    ],
)
def test_attention_pairs(q_len: int, kv_len: int, causal: bool, pairs: int) -> None:
    assert attention_pairs(q_len, kv_len, causal=causal) == pairs


def test_attention_flops_forward_and_backward() -> None:
    forward = attention_point("attention_fwd", 128, 128, 8, 64, True, "bfloat16")
    backward = attention_point("attention_bwd", 128, 128, 8, 64, True, "bfloat16")
    assert forward.flops == 4 * 64 * (128 * 129 // 2) * 8
    assert backward.flops == 2.5 * forward.flops
    assert forward.params == {
        "q_len": 128, "kv_len": 128, "heads": 8, "head_dim": 64, "causal": True,
    }  # fmt: skip


def test_gemm_shapes_of_a_model_cover_every_linear_layer() -> None:
    model = ModelSpec.preset("llama3-8b")
    shapes = gemm_shapes(model, 1024)
    weights = sum(n * k for _, n, k in shapes)
    # q, o (4096 x 4096 each), k and v (one shape: 1024 x 4096), gate/up (one shape), down, head
    expected = 2 * 4096**2 + 1024 * 4096 + 2 * 14336 * 4096 + 128256 * 4096
    assert weights == expected
    assert all(m == 1024 for m, _, _ in shapes)


def test_causal_blocks_only_on_the_diagonal() -> None:
    grid = load_grid(builtin_grid_path(quick=True))
    points, _ = compute_points(grid, "cpu")
    causal = [p for p in points if p.op.startswith("attention") and p.params["causal"]]
    assert causal and all(p.params["q_len"] == p.params["kv_len"] for p in causal)


def test_max_gflop_per_call_leaves_out_big_points() -> None:
    grid = load_grid(builtin_grid_path(quick=False))
    cpu_points, left_out = compute_points(grid, "cpu")
    cuda_points, none_left_out = compute_points(grid, "cuda")
    assert left_out > 0 and none_left_out == 0
    assert max(p.flops for p in cpu_points) <= grid.max_gflop_per_call["cpu"] * 1e9
    assert len(cuda_points) == len(cpu_points) + left_out


def test_link_points_cover_each_op_and_both_p2p_directions() -> None:
    grid = load_grid(builtin_grid_path(quick=False))
    points = link_points(grid, world=4)
    sizes = grid.links.message_sizes()
    assert sizes[0] == 1024 and sizes[-1] == 256 * 1024**2 and len(sizes) == 19
    assert len(points) == len(sizes) * 5  # p2p next + prev, all_to_all, all_gather, reduce_scatter
    all_to_all = next(p for p in points if p.op == "all_to_all")
    assert all_to_all.bytes_moved == 3 * all_to_all.params["message_bytes"]
    directions = {p.params.get("direction") for p in points if p.op == "p2p"}
    assert directions == {"next", "prev"}
