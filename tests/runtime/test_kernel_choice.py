"""Tier 0: the runtime picks its attention kernel with the rule the cost model prices."""

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
    with pytest.raises(NotImplementedError, match="cudnn"):
        kernels.forward_with("cudnn", q, q, q, causal=True, scale=0.3)
