"""The profiler times the kernels the runtime runs: the same rule names them, and its calls
give the runtime's outputs exactly, on every kernel this machine can run.

The profiler may not import the runtime (DESIGN.md §1), so it makes the aten calls itself;
these tests (which may import everything) are what keeps the two from drifting apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hexiseq.kernels
from hexiseq.profiler import _compute_ops
from hexiseq.profiler._points import Point
from hexiseq.runtime import kernels as runtime_kernels

PROFILER = Path(_compute_ops.__file__).parent


def _devices_and_kernels() -> list[tuple[str, torch.dtype, str]]:
    cases = [("cpu", torch.float32, "cpu_flash"), ("cpu", torch.bfloat16, "cpu_flash")]
    if torch.cuda.is_available():
        cases += [("cuda", torch.bfloat16, "flash"), ("cuda", torch.float32, "efficient")]
    return cases


def test_profiler_does_not_import_the_runtime():
    for path in sorted(PROFILER.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            assert not any(n.startswith("hexiseq.runtime") for n in names), path.name


def test_profiler_names_the_kernel_by_the_shared_rule():
    for device, dtype, kernel in _devices_and_kernels():
        assert _compute_ops.attention_kernel(torch.device(device), dtype, 64) == kernel
        assert hexiseq.kernels.attention_kernel(device, str(dtype), 64) == kernel
        q = torch.randn(1, 2, 4, 64, dtype=dtype, device=device)
        assert runtime_kernels.kernel_for(q) == kernel


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("device", "dtype", "kernel"), _devices_and_kernels())
def test_profiler_calls_give_the_runtime_kernels_outputs(device, dtype, kernel, causal):
    generator = torch.Generator().manual_seed(7)

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = random(1, 3, 48, 32), random(1, 3, 48, 32), random(1, 3, 48, 32)
    scale = 32**-0.5
    out, lse = _compute_ops._forward(kernel, q, k, v, causal, scale)
    expected_out, expected_lse = runtime_kernels.forward_with(
        kernel, q, k, v, causal=causal, scale=scale
    )
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    dout = random(1, 3, 48, 32)
    grads = _compute_ops._backward(kernel, dout, q, k, v, out, lse, causal, scale)
    expected = runtime_kernels.backward_with(
        kernel, dout, q, k, v, out, lse, causal=causal, scale=scale
    )
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_attention_point_runs_the_named_kernel():
    params = {"q_len": 16, "kv_len": 16, "heads": 2, "head_dim": 8, "causal": True}
    point = Point(op="attention_fwd", dtype="float32", params=params, flops=0.0, bytes_moved=0.0)
    calls, kernel = _compute_ops.build_calls(point, torch.device("cpu"), input_sets=1)
    assert kernel == "cpu_flash"
    out, lse = calls[0]()
    assert out.shape == (1, 2, 16, 8) and lse.dtype == torch.float32
