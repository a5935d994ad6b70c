"""The profiler times the kernels the runtime runs: the same rule names them, and its calls
give the runtime's outputs exactly, on every kernel this machine can run.

The profiler may not import the runtime (docs/design.md §1), so it makes the aten calls itself;
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
        half = "cudnn" if runtime_kernels.cudnn_usable(torch.device("cuda")) else "flash"
        cases += [("cuda", torch.bfloat16, half), ("cuda", torch.float32, "efficient")]
    return cases


@pytest.fixture(autouse=True)
def _fresh_kernel_state(monkeypatch):
    """No kernel retired and no cached hardware answer leaks between tests."""
    monkeypatch.setattr(_compute_ops, "_failed_kernels", {})
    for probe in (_compute_ops._cudnn_hardware_usable, runtime_kernels._cudnn_hardware_usable):
        probe.cache_clear()
    yield
    for probe in (_compute_ops._cudnn_hardware_usable, runtime_kernels._cudnn_hardware_usable):
        probe.cache_clear()


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


@pytest.mark.parametrize(
    ("capability", "cudnn_version", "hip", "sdp_enabled"),
    [
        ((9, 0), 91600, None, True),
        ((10, 0), 91900, None, True),
        ((8, 0), 91600, None, True),
        ((9, 0), 91002, None, True),
        ((9, 0), 91600, "6.2", True),
        ((9, 0), 91600, None, False),
    ],
)
def test_profiler_and_runtime_agree_when_cudnn_is_usable(
    monkeypatch, capability, cudnn_version, hip, sdp_enabled
):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn_version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: sdp_enabled)
    device = torch.device("cuda", 0)
    usable = runtime_kernels.cudnn_usable(device)
    assert _compute_ops._cudnn_usable(device) is usable
    assert usable is (capability[0] in (9, 10) and cudnn_version >= 91501 and hip is None
                      and sdp_enabled)  # fmt: skip
    expected = "cudnn" if usable else "flash"
    assert _compute_ops.attention_kernel(device, torch.bfloat16, 128) == expected


@pytest.mark.parametrize("causal", [True, False])
def test_profiler_cudnn_calls_are_the_runtimes(causal):
    # No cuDNN here: torch's meta functions of the two ops check the calls' arguments and
    # give their shapes, dtypes and strides.
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    q, k, v = meta(1, 3, 48, 64), meta(1, 3, 48, 64), meta(1, 3, 48, 64)
    scale = 64**-0.5
    out, lse = _compute_ops._forward("cudnn", q, k, v, causal, scale)
    expected = runtime_kernels.forward_with("cudnn", q, k, v, causal=causal, scale=scale)
    for got, want in zip((out, lse), expected, strict=True):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert lse.shape == (1, 3, 48) and lse.dtype == torch.float32
    grads = _compute_ops._backward("cudnn", out, q, k, v, out, lse, causal, scale)
    expected = runtime_kernels.backward_with(
        "cudnn", out, q, k, v, out, lse, causal=causal, scale=scale
    )
    for got, want in zip(grads, expected, strict=True):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_a_failing_kernel_is_profiled_as_its_fallback_and_named_so(monkeypatch):
    # As on a GPU whose cuDNN rejects the graph: cudnn raises, flash (here the CPU kernel
    # standing in) runs, and the point records "flash", as the runtime would run it.
    real_forward, real_backward, tried = _compute_ops._forward, _compute_ops._backward, []

    def forward(kernel, *args):
        tried.append(kernel)
        if kernel == "cudnn":
            raise RuntimeError("cuDNN Frontend error: [cudnn_frontend] No valid engine configs")
        return real_forward("cpu_flash" if kernel == "flash" else kernel, *args)

    def backward(kernel, *args):
        return real_backward("cpu_flash" if kernel == "flash" else kernel, *args)

    monkeypatch.setattr(_compute_ops, "_forward", forward)
    monkeypatch.setattr(_compute_ops, "_backward", backward)
    monkeypatch.setattr(_compute_ops, "attention_kernel", lambda device, dtype, head_dim: "cudnn")
    params = {"q_len": 16, "kv_len": 16, "heads": 2, "head_dim": 8, "causal": True}
    for op in ("attention_fwd", "attention_bwd"):
        point = Point(op=op, dtype="float32", params=params, flops=0.0, bytes_moved=0.0)
        calls, kernel = _compute_ops.build_calls(point, torch.device("cpu"), input_sets=2)
        assert kernel == "flash" and len(calls) == 2
        outputs = calls[1]()  # (out, lse) forward, (dq, dk, dv) backward
        assert len(outputs) == (3 if op == "attention_bwd" else 2)
    assert tried.count("cudnn") == 1  # retired for float32 head_dim 8 after the first failure
    assert set(_compute_ops._failed_kernels) == {("cudnn", "float32", 8)}
