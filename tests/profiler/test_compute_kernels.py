"""The profiler times the runtime's own attention kernels, not a copy of them."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import hexiseq.kernels
from hexiseq.profiler import _compute_ops
from hexiseq.profiler._points import Point
from hexiseq.runtime import kernels as runtime_kernels

COMPUTE_OPS = Path(_compute_ops.__file__)


def test_profiler_calls_the_runtime_kernel_module():
    assert _compute_ops.runtime_kernels is runtime_kernels
    # No kernel call of its own: every aten attention op is reached through the runtime.
    source = COMPUTE_OPS.read_text()
    assert "_scaled_dot_product" not in source
    tree = ast.parse(source)
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "hexiseq.runtime" in imported or "hexiseq.runtime.kernels" in imported


def test_profiler_names_the_kernel_by_the_shared_rule():
    device = torch.device("cpu")
    assert _compute_ops.attention_kernel(device, torch.float32, 64) == "cpu_flash"
    assert hexiseq.kernels.attention_kernel("cpu", "float32", 64) == "cpu_flash"


def test_attention_point_runs_the_runtime_forward():
    params = {"q_len": 16, "kv_len": 16, "heads": 2, "head_dim": 8, "causal": True}
    point = Point(op="attention_fwd", dtype="float32", params=params, flops=0.0, bytes_moved=0.0)
    calls, kernel = _compute_ops.build_calls(point, torch.device("cpu"), input_sets=1)
    assert kernel == "cpu_flash"
    out, lse = calls[0]()
    assert out.shape == (1, 2, 16, 8) and lse.dtype == torch.float32
