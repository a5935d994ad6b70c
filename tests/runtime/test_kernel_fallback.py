"""Tier 0: the runtime's kernel dispatch without a GPU — a kernel that raises hands the tile to
its fallback once and for all (per dtype and head size), the kernels that really ran are
recorded, and cuDNN's calls are checked against torch's own schemas on meta tensors."""

from __future__ import annotations

import pytest
import torch

from hexiseq.runtime import kernels

SCALE = 0.3


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test starts with no kernel used and none retired."""
    monkeypatch.setattr(kernels, "_used_kernels", set())
    monkeypatch.setattr(kernels, "_failed_kernels", {})


def tile(rows=6, keys=6, head_dim=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, 2, n, head_dim, generator=generator).to(dtype) for n in (rows, keys, keys)
    )
    return q, k, v


class Recorder:
    """A kernel stand-in: counts its calls, raises `error` or runs the CPU flash kernel."""

    def __init__(self, real, error: Exception | None = None):
        self.real, self.error, self.calls = real, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.real(*args, **kwargs)


def route_tiles_to(monkeypatch, kernel: str) -> None:
    """Tiles on this CPU are named `kernel`, as a CUDA GPU's would be."""
    monkeypatch.setattr(kernels, "kernel_for", lambda q: kernel)


def stand_in(monkeypatch, name: str, error: Exception | None = None) -> tuple[Recorder, Recorder]:
    """`name`'s forward and backward replaced by recorders of the CPU flash kernel."""
    forward = Recorder(kernels.FORWARD_KERNELS["cpu_flash"], error)
    backward = Recorder(kernels.BACKWARD_KERNELS["cpu_flash"], error)
    monkeypatch.setitem(kernels.FORWARD_KERNELS, name, forward)
    monkeypatch.setitem(kernels.BACKWARD_KERNELS, name, backward)
    return forward, backward


def test_a_failing_cudnn_kernel_falls_back_to_flash_once_and_is_recorded(monkeypatch):
    route_tiles_to(monkeypatch, "cudnn")
    cudnn_forward, cudnn_backward = stand_in(
        monkeypatch, "cudnn", RuntimeError("cuDNN Frontend error: no engine supports this graph")
    )
    flash_forward, flash_backward = stand_in(monkeypatch, "flash")
    q, k, v = tile()
    with pytest.warns(RuntimeWarning, match="'cudnn' attention kernel failed for float32"):
        out, lse = kernels.block_forward(q, k, v, causal=True, scale=SCALE)
    again, _ = kernels.block_forward(q, k, v, causal=True, scale=SCALE)
    expected_out, expected_lse = kernels.forward_with(
        "cpu_flash", q, k, v, causal=True, scale=SCALE
    )
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert torch.equal(again, expected_out)
    assert (cudnn_forward.calls, flash_forward.calls) == (1, 2)  # retired: not tried again
    assert kernels.failed_kernels() == {
        ("cudnn", "float32", 8): "cuDNN Frontend error: no engine supports this graph"
    }
    grads = kernels.block_backward(out, q, k, v, out, lse, causal=True, scale=SCALE)
    expected = kernels.backward_with("cpu_flash", out, q, k, v, out, lse, causal=True, scale=SCALE)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert (cudnn_backward.calls, flash_backward.calls) == (0, 1)
    assert kernels.used_kernels() == {"flash"}
    assert kernels.take_used_kernels() == "flash"
    assert kernels.used_kernels() == frozenset()  # taken: the next step starts empty


def test_a_failure_retires_the_kernel_for_its_dtype_and_head_size_only(monkeypatch):
    route_tiles_to(monkeypatch, "cudnn")
    stand_in(monkeypatch, "cudnn", RuntimeError("unsupported"))
    stand_in(monkeypatch, "flash")
    with pytest.warns(RuntimeWarning):
        kernels.block_forward(*tile(head_dim=8), causal=False, scale=SCALE)
    cudnn_forward, _ = stand_in(monkeypatch, "cudnn")  # works for another head size
    kernels.block_forward(*tile(head_dim=16), causal=False, scale=SCALE)
    assert cudnn_forward.calls == 1
    assert kernels.used_kernels() == {"cudnn", "flash"}


def test_the_fallbacks_go_cudnn_flash_efficient_and_the_last_error_is_raised(monkeypatch):
    route_tiles_to(monkeypatch, "cudnn")
    recorders = [stand_in(monkeypatch, name, RuntimeError(f"{name} failed"))[0]
                 for name in ("cudnn", "flash", "efficient")]  # fmt: skip
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="efficient failed"):
        kernels.block_forward(*tile(), causal=True, scale=SCALE)
    assert [r.calls for r in recorders] == [1, 1, 1]
    assert set(kernels.failed_kernels()) == {("cudnn", "float32", 8), ("flash", "float32", 8)}
    assert kernels.used_kernels() == frozenset()


def test_out_of_memory_is_raised_not_taken_for_a_kernel_failure(monkeypatch):
    route_tiles_to(monkeypatch, "cudnn")
    stand_in(monkeypatch, "cudnn", torch.OutOfMemoryError("CUDA out of memory"))
    flash_forward, _ = stand_in(monkeypatch, "flash")
    with pytest.raises(torch.OutOfMemoryError):
        kernels.block_forward(*tile(), causal=True, scale=SCALE)
    assert flash_forward.calls == 0 and kernels.failed_kernels() == {}


def test_a_single_key_block_skips_cudnn_without_retiring_it(monkeypatch):
    # cuDNN's SDPA does not take a key length of 1 (sdp_utils.cpp, check_cudnn_tensor_shapes).
    route_tiles_to(monkeypatch, "cudnn")
    cudnn_forward, _ = stand_in(monkeypatch, "cudnn")
    flash_forward, _ = stand_in(monkeypatch, "flash")
    kernels.block_forward(*tile(rows=4, keys=1), causal=False, scale=SCALE)
    kernels.block_forward(*tile(rows=4, keys=5), causal=False, scale=SCALE)
    assert (cudnn_forward.calls, flash_forward.calls) == (1, 1)
    assert kernels.failed_kernels() == {}
    assert kernels.take_used_kernels() == "cudnn,flash"


def test_cpu_tiles_record_the_cpu_flash_kernel():
    q, k, v = tile()
    out, lse = kernels.block_forward(q, k, v, causal=True, scale=SCALE)
    kernels.block_backward(out, q, k, v, out, lse, causal=True, scale=SCALE)
    assert kernels.used_kernels() == {"cpu_flash"}
    kernels.reset_used_kernels()
    assert kernels.take_used_kernels() == ""


# --- cuDNN's calls, on meta tensors (torch's own shape functions of the two ops) ---------------


def meta_tile(rows, keys, head_dim=64, dtype=torch.bfloat16):
    def meta(*shape):
        return torch.empty(*shape, dtype=dtype, device="meta")

    return meta(2, 3, rows, head_dim), meta(2, 3, keys, head_dim), meta(2, 3, keys, head_dim)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_forward_gives_out_and_a_bhl_fp32_lse(causal):
    q, k, v = meta_tile(16, 16 if causal else 24)
    out, lse = kernels.forward_with("cudnn", q, k, v, causal=causal, scale=SCALE)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 3, 16) and lse.dtype == torch.float32  # from cuDNN's (B, H, L, 1)


def test_cudnn_takes_strided_tiles_and_its_backward_gives_input_shaped_gradients():
    # The ring's tiles are row slices of (B, H, L, D) tensors: not contiguous.
    whole_q, whole_k, _ = meta_tile(40, 56)
    q, k = whole_q[:, :, 8:24], whole_k[:, :, 16:40]
    v = whole_k[:, :, :24]
    assert not q.is_contiguous()
    out, lse = kernels.forward_with("cudnn", q, k, v, causal=False, scale=SCALE)
    assert out.is_contiguous() and lse.shape == (2, 3, 16)
    dq, dk, dv = kernels.backward_with("cudnn", out, q, k, v, out, lse, causal=False, scale=SCALE)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {torch.bfloat16}


def test_without_cuda_the_cudnn_op_raises_a_runtime_error_the_fallback_catches():
    # What a CPU-only or ROCm build of torch does: the error class `_run_with_fallback` takes.
    q, k, v = tile(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        kernels.forward_with("cudnn", q, k, v, causal=True, scale=SCALE)
