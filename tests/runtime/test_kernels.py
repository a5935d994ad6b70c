"""Tier 0: block kernels with log-sum-exp, and the online-softmax merge (no process group).

A query set attends to two key blocks; each block's forward is merged, each block's backward
is given the merged (global) out and lse; the sums must equal plain attention over both."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hexiseq.runtime._block import OnlineSoftmax
from hexiseq.runtime.kernels import (
    backward_with,
    block_backward,
    block_forward,
    cudnn_usable,
    explicit_backward,
    explicit_forward,
    forward_with,
)

SCALE = 0.3


def two_blocks(device="cpu", dtype=torch.float32, rows=6, keys=(9, 6), seed=0):
    """q (B, H, rows, D) and two K/V blocks; the second block is square so it can be causal."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = randn(2, 3, rows, 8)
    blocks = [(randn(2, 3, n, 8), randn(2, 3, n, 8)) for n in keys]
    return q, blocks, randn(2, 3, rows, 8)


def plain_attention(q, blocks, causal_last):
    """Reference in float64: q over the concatenated keys; the last block causal (square)."""
    k = torch.cat([b[0] for b in blocks], dim=2).double()
    v = torch.cat([b[1] for b in blocks], dim=2).double()
    scores = q.double() @ k.transpose(-1, -2) * SCALE
    if causal_last:
        rows, last = q.shape[2], blocks[-1][0].shape[2]
        hidden = torch.zeros(rows, k.shape[2], dtype=torch.bool)
        hidden[:, -last:] = torch.ones(rows, last, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden.to(q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def merged_and_grads(forward, backward, q, blocks, dout):
    merged = OnlineSoftmax(q)
    causal = [False, True]
    for (k, v), is_causal in zip(blocks, causal):
        out, lse = forward(q, k, v, causal=is_causal, scale=SCALE)
        merged.merge(slice(None), out, lse)
    out = merged.out_BHLD.to(q.dtype)
    grads = [
        backward(dout, q, k, v, out, merged.lse_BHL, causal=is_causal, scale=SCALE)
        for (k, v), is_causal in zip(blocks, causal)
    ]
    dq = sum(g[0].double() for g in grads)
    return merged.out_BHLD, dq, [(g[1], g[2]) for g in grads]


def reference_grads(q, blocks, dout):
    """Float64 gradients, computed on the CPU (a float64 backward on a GPU runs cuBLAS in
    autograd's device thread, which warned of a missing CUDA context) and returned to q's
    device."""

    def leaf(x):
        return x.detach().cpu().double().requires_grad_()

    q_ = leaf(q)
    leaves = [(leaf(k), leaf(v)) for k, v in blocks]
    plain_attention(q_, leaves, causal_last=True).backward(dout.detach().cpu().double())
    back = q.device
    return q_.grad.to(back), [(k.grad.to(back), v.grad.to(back)) for k, v in leaves]


def assert_close(actual, expected, tolerance):
    error = ((actual.double() - expected).norm() / expected.norm()).item()
    assert error <= tolerance, error


@pytest.mark.parametrize(
    "forward,backward",
    [(block_forward, block_backward), (explicit_forward, explicit_backward)],
    ids=["cpu-flash", "explicit"],
)
def test_blocks_merged_with_global_lse_equal_plain_attention(forward, backward):
    q, blocks, dout = two_blocks()
    out, dq, dkv = merged_and_grads(forward, backward, q, blocks, dout)
    assert_close(out, plain_attention(q, blocks, causal_last=True), 1e-6)
    want_dq, want_dkv = reference_grads(q, blocks, dout)
    assert_close(dq, want_dq, 1e-5)
    for (dk, dv), (want_dk, want_dv) in zip(dkv, want_dkv):
        assert_close(dk, want_dk, 1e-5)
        assert_close(dv, want_dv, 1e-5)


def test_merge_leaves_rows_no_block_reached_empty_without_nan():
    q, ((k, v), _), _ = two_blocks()
    merged = OnlineSoftmax(q)
    out, lse = block_forward(q[:, :, 2:], k, v, causal=False, scale=SCALE)
    merged.merge(slice(2, None), out, lse)
    assert not torch.isnan(merged.out_BHLD).any()
    assert torch.equal(merged.out_BHLD[:, :, :2], torch.zeros_like(merged.out_BHLD[:, :, :2]))
    assert torch.isinf(merged.lse_BHL[:, :, :2]).all()
    assert torch.isfinite(merged.lse_BHL[:, :, 2:]).all()


def test_bfloat16_cpu_kernel_is_close_to_reference():
    q, blocks, dout = two_blocks(dtype=torch.bfloat16)
    out, _, _ = merged_and_grads(block_forward, block_backward, q, blocks, dout)
    assert_close(out, plain_attention(q, blocks, causal_last=True), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype,tolerance",
    [(torch.float16, 5e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-5)],
    ids=["fp16-rule", "bf16-rule", "fp32-efficient"],  # rule: cudnn or flash
)
def test_cuda_kernels_match_plain_attention(dtype, tolerance):
    q, blocks, dout = two_blocks(device="cuda", dtype=dtype, rows=40, keys=(70, 40))
    out, dq, dkv = merged_and_grads(block_forward, block_backward, q, blocks, dout)
    assert_close(out, plain_attention(q, blocks, causal_last=True), tolerance)
    want_dq, want_dkv = reference_grads(q, blocks, dout)
    assert_close(dq, want_dq, tolerance)
    for (dk, dv), (want_dk, want_dv) in zip(dkv, want_dkv):
        assert_close(dk, want_dk, tolerance)
        assert_close(dv, want_dv, tolerance)


def _cuda_kernel_or_skip(kernel: str) -> None:
    if kernel == "cudnn" and not cudnn_usable(torch.device("cuda")):
        pytest.skip("cuDNN attention is not usable on this GPU/cuDNN (hexiseq.kernels)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"]
)
def test_each_cuda_kernel_merged_with_global_lse_matches_plain_attention(kernel, dtype, tolerance):
    # Lengths that are not multiples of 64 or 128, as uneven ring tiles are.
    _cuda_kernel_or_skip(kernel)
    q, blocks, dout = two_blocks(device="cuda", dtype=dtype, rows=40, keys=(70, 40))
    forward, backward = partial(forward_with, kernel), partial(backward_with, kernel)
    out, dq, dkv = merged_and_grads(forward, backward, q, blocks, dout)
    assert_close(out, plain_attention(q, blocks, causal_last=True), tolerance)
    want_dq, want_dkv = reference_grads(q, blocks, dout)
    assert_close(dq, want_dq, tolerance)
    for (dk, dv), (want_dk, want_dv) in zip(dkv, want_dkv):
        assert_close(dk, want_dk, tolerance)
        assert_close(dv, want_dv, tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cudnn_forward_and_a_flash_backward_mix_exactly():
    # Every kernel's lse is the natural-log log-sum-exp, so a fallback between the forward and
    # the backward of a block changes nothing.
    _cuda_kernel_or_skip("cudnn")
    q, blocks, dout = two_blocks(device="cuda", dtype=torch.bfloat16, rows=40, keys=(70, 40))
    forward, backward = partial(forward_with, "cudnn"), partial(backward_with, "flash")
    out, dq, _ = merged_and_grads(forward, backward, q, blocks, dout)
    assert_close(out, plain_attention(q, blocks, causal_last=True), 2e-2)
    want_dq, _ = reference_grads(q, blocks, dout)
    assert_close(dq, want_dq, 2e-2)


def test_efficient_lse_layout_pads_rows_to_32_with_inf():
    from hexiseq.runtime.kernels import efficient_lse_layout

    lse = torch.randn(2, 3, 40)
    padded = efficient_lse_layout(lse)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous()
    assert torch.equal(padded[..., :40], lse)
    assert torch.isinf(padded[..., 40:]).all() and (padded[..., 40:] > 0).all()
    exact = torch.randn(1, 2, 64)
    assert torch.equal(efficient_lse_layout(exact), exact)
