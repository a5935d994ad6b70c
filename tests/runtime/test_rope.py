"""RoPE's explicit backward (`runtime/model.py` `RotaryEmbedding`) against autograd through the
rotate-half form it replaced, on fresh random inputs."""

import pytest
import torch

from hexiseq.runtime.model import apply_rope, rope_tables


def rotate_half_reference(x_BTHD, cos_TD, sin_TD):
    half = x_BTHD.shape[-1] // 2
    rotated = torch.cat([-x_BTHD[..., half:], x_BTHD[..., :half]], dim=-1)
    return x_BTHD * cos_TD[None, :, None, :] + rotated * sin_TD[None, :, None, :]


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_rope_and_its_gradient_match_autograd_of_the_rotate_half_form(seed):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(4096, generator=generator)[:37]  # any order, large positions
    cos, sin = rope_tables(positions, 16, torch.float32, 500000.0)
    x = torch.randn(2, 37, 5, 16, generator=generator, requires_grad=True)
    dy = torch.randn(2, 37, 5, 16, generator=generator)
    ours, reference = apply_rope(x, cos, sin), rotate_half_reference(x, cos, sin)
    assert relative_error(ours, reference) <= 1e-6
    (grad,) = torch.autograd.grad(ours, x, dy)
    (want,) = torch.autograd.grad(reference, x, dy)
    assert relative_error(grad, want) <= 1e-6


def test_a_bf16_input_with_fp32_tables_gets_an_fp32_output_and_a_bf16_gradient():
    """As under autocast (replicated states): the tables promote the output, and the input's
    gradient comes back in the input's dtype."""
    generator = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(torch.arange(11), 8, torch.float32, 10000.0)
    x = torch.randn(1, 11, 2, 8, generator=generator).bfloat16().requires_grad_()
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.float32
    assert relative_error(out, rotate_half_reference(x.float(), cos, sin)) <= 1e-6
    (grad,) = torch.autograd.grad(out, x, torch.randn(out.shape, generator=generator))
    assert grad.dtype == torch.bfloat16
