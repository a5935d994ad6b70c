"""Tier 0: the runtime picks its attention kernel with the rule the cost model prices, and asks
the live GPU and cuDNN whether cuDNN attention is usable (no GPU needed: torch's answers are
stood in for)."""

from __future__ import annotations

import pytest
import torch

import hexiseq.kernels
from hexiseq.costmodel import datasheet
from hexiseq.runtime import kernels


def test_runtime_and_cost_model_share_one_kernel_rule():
    assert kernels.attention_kernel is hexiseq.kernels.attention_kernel
    assert datasheet.attention_kernel is hexiseq.kernels.attention_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tiles_run_the_cpu_flash_kernel(dtype):
    q = torch.randn(1, 2, 4, 8, dtype=dtype)
    assert kernels.kernel_for(q) == "cpu_flash"


def test_a_kernel_the_runtime_does_not_call_fails_loudly():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="tensorrt"):
        kernels.forward_with("tensorrt", q, q, q, causal=True, scale=0.3)
    with pytest.raises(NotImplementedError, match="tensorrt"):
        kernels.backward_with("tensorrt", q, q, q, q, q, q[..., 0], causal=True, scale=0.3)


@pytest.mark.parametrize(
    ("capability", "cudnn_version", "usable"),
    [
        ((9, 0), 91501, True),  # H100/H200, cuDNN 9.15.1
        ((10, 0), 92000, True),  # B200
        ((9, 0), 91500, False),  # before the fix for lengths not a multiple of 128
        ((8, 0), 92000, False),  # A100: torch keeps FlashAttention-2 first
        ((8, 9), 92000, False),  # L40S, RTX 4090
        ((12, 0), 92000, False),  # consumer Blackwell
        ((9, 0), None, False),  # no cuDNN (ROCm)
        (None, 92000, False),
    ],
)
def test_cudnn_attention_needs_hopper_or_blackwell_and_a_recent_cudnn(
    capability, cudnn_version, usable
):
    assert hexiseq.kernels.cudnn_attention_usable(capability, cudnn_version) is usable


def stand_in_cuda(monkeypatch, *, capability=(9, 0), cudnn_version=91600, hip=None):
    """torch's answers for a CUDA GPU of `capability` with cuDNN `cudnn_version`."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn_version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    kernels._cudnn_hardware_usable.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_hardware_cache():
    kernels._cudnn_hardware_usable.cache_clear()
    yield
    kernels._cudnn_hardware_usable.cache_clear()


CUDA0 = torch.device("cuda", 0)


def test_cudnn_is_usable_on_a_hopper_gpu_with_a_recent_cudnn(monkeypatch):
    stand_in_cuda(monkeypatch)
    assert kernels.cudnn_usable(CUDA0)
    rule = hexiseq.kernels.attention_kernel
    assert rule("cuda", "torch.bfloat16", 128, cudnn_usable=kernels.cudnn_usable(CUDA0)) == (
        "cudnn"
    )


@pytest.mark.parametrize(
    "facts",
    [
        {"capability": (8, 0)},
        {"cudnn_version": 91002},  # CUDA 12.x wheels' cuDNN 9.10
        {"hip": "6.2"},  # ROCm: torch's cudnn is MIOpen
    ],
    ids=["ampere", "old-cudnn", "rocm"],
)
def test_cudnn_is_not_usable_elsewhere(monkeypatch, facts):
    stand_in_cuda(monkeypatch, **facts)
    assert not kernels.cudnn_usable(CUDA0)
    assert hexiseq.kernels.attention_kernel("cuda", "bfloat16", 128, cudnn_usable=False) == (
        "flash"
    )


def test_the_user_can_switch_cudnn_attention_off_as_for_torch_sdpa(monkeypatch):
    stand_in_cuda(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert not kernels.cudnn_usable(CUDA0)


def test_strict_determinism_keeps_cudnn_attention_off(monkeypatch):
    # cuDNN's attention backward is not deterministic; warn-only determinism still runs it.
    stand_in_cuda(monkeypatch)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
    assert not kernels.cudnn_usable(CUDA0)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: True)
    assert kernels.cudnn_usable(CUDA0)


def test_a_cpu_device_never_asks_for_cudnn():
    assert not kernels.cudnn_usable(torch.device("cpu"))
