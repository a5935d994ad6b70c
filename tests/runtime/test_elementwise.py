"""RMSNorm and SwiGLU as autograd functions saving only what their backward needs
(`runtime/_elementwise.py`): same values and gradients as autograd's, fewer saved bytes."""

import pytest
import torch
import torch.nn.functional as functional

from hexiseq.runtime._elementwise import (
    RMSNormFunction,
    SwiGLUFunction,
    compile_elementwise,
    elementwise_compiled,
)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def reference_rms_norm(x, weight, eps):
    """Float64 autograd reference."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rms_norm_case(dtype=torch.float32):
    x = torch.randn(2, 37, 64, dtype=dtype, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(64, dtype=dtype)).requires_grad_()
    return x, weight, torch.randn(2, 37, 64, dtype=dtype)


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream)


def test_rms_norm_matches_a_float64_reference():
    x, weight, dy = rms_norm_case()
    y = RMSNormFunction.apply(x, weight, 1e-5)
    want = reference_rms_norm(x, weight, 1e-5)
    assert relative_error(y, want) <= 1e-6
    for got, expected in zip(grads(y, (x, weight), dy), grads(want, (x, weight), dy.double())):
        assert relative_error(got, expected) <= 1e-5


def test_swiglu_matches_a_float64_reference():
    gate = torch.randn(3, 17, 48, requires_grad=True)
    up = torch.randn(3, 17, 48, requires_grad=True)
    d_product = torch.randn(3, 17, 48)
    product = SwiGLUFunction.apply(gate, up)
    want = functional.silu(gate.double()) * up.double()
    assert relative_error(product, want) <= 1e-6
    got = grads(product, (gate, up), d_product)
    for a, b in zip(got, grads(want, (gate, up), d_product.double())):
        assert relative_error(a, b) <= 1e-5


def test_bfloat16_gradients_are_as_close_as_autograds():
    x, weight, dy = rms_norm_case(torch.bfloat16)
    ours = grads(RMSNormFunction.apply(x, weight, 1e-5), (x, weight), dy)
    x32 = x.float()
    plain = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(
        x.dtype
    )
    theirs = grads(plain, (x, weight), dy)
    truth = grads(reference_rms_norm(x, weight, 1e-5), (x, weight), dy.double())
    for a, b, t in zip(ours, theirs, truth):
        assert relative_error(a, t) <= max(2 * relative_error(b, t), 1e-2)


def saved_bytes(function, *inputs) -> tuple[int, list[torch.Tensor]]:
    """Bytes of the storages `function` saves for its backward that its inputs do not hold."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        function(*inputs)
    owned = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    fresh = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in saved
        if t.untyped_storage().data_ptr() not in owned
    }
    return sum(fresh.values()), saved


def test_rms_norm_saves_only_its_input_weight_and_fp32_rstd():
    x = torch.randn(4, 100, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    fresh, saved = saved_bytes(lambda a, w: RMSNormFunction.apply(a, w, 1e-5), x, weight)
    assert fresh == 4 * 100 * 4  # rstd: one FP32 per token; x and weight are the inputs
    assert len(saved) == 3
    # autograd's own FP32 norm keeps the FP32 upcast and normalized input besides
    x32 = lambda a, w: a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True)) * w  # noqa: E731
    assert saved_bytes(x32, x, weight)[0] >= 2 * 4 * 100 * 64 * 4


def test_swiglu_saves_gate_and_up_only():
    gate = torch.randn(2, 50, 96, requires_grad=True)
    up = torch.randn(2, 50, 96, requires_grad=True)
    fresh, saved = saved_bytes(SwiGLUFunction.apply, gate, up)
    assert fresh == 0 and len(saved) == 2


def test_the_backward_leaves_the_incoming_gradient_unchanged():
    # autograd may hand one gradient tensor to two branches (a residual add): never write it
    x, weight, dy = rms_norm_case()
    before = dy.clone()
    grads(RMSNormFunction.apply(x, weight, 1e-5), (x, weight), dy)
    assert torch.equal(dy, before)
    gate, up = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    d_product = torch.randn(5, 8)
    kept = d_product.clone()
    grads(SwiGLUFunction.apply(gate, up), (gate, up), d_product)
    assert torch.equal(d_product, kept)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports (2.13)
def test_compiled_math_gives_the_eager_results():
    x, weight, dy = rms_norm_case()
    gate, up = torch.randn(3, 9, 40, requires_grad=True), torch.randn(3, 9, 40, requires_grad=True)
    d_product = torch.randn(3, 9, 40)

    def run():
        y = RMSNormFunction.apply(x, weight, 1e-5)
        p = SwiGLUFunction.apply(gate, up)
        return [y, p, *grads(y, (x, weight), dy), *grads(p, (gate, up), d_product)]

    eager = run()
    compile_elementwise()
    try:
        assert elementwise_compiled()
        compiled = run()
    finally:
        compile_elementwise(False)
    assert not elementwise_compiled()
    for a, b in zip(compiled, eager):
        assert relative_error(a, b) <= 1e-5


def test_train_takes_compile_as_an_option():
    from hexiseq.runtime import train

    assert train.parse_args(["--plan", "p.json", "--compile"]).compile_elementwise is True
    assert train.parse_args(["--plan", "p.json"]).compile_elementwise is False


def test_the_former_recipe_keeps_autograds_norm_and_swiglu_with_the_same_values():
    from hexiseq import ModelSpec
    from hexiseq.runtime.model import (
        LocalAttention,
        RMSNorm,
        SwiGLU,
        build_model,
        use_autograd_elementwise,
    )

    spec = ModelSpec.preset("tiny")
    tokens = torch.randint(0, spec.vocab, (1, 24))
    positions = torch.arange(24)
    ours = build_model(spec, LocalAttention(), seed=3)
    former = build_model(spec, LocalAttention(), seed=3)
    use_autograd_elementwise(former)
    flags = [m.autograd_math for m in former.modules() if isinstance(m, (RMSNorm, SwiGLU))]
    assert flags and all(flags)
    assert not any(m.autograd_math for m in ours.modules() if isinstance(m, (RMSNorm, SwiGLU)))
    a, b = ours(tokens, positions), former(tokens, positions)
    assert relative_error(a, b) <= 1e-6
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(ours.named_parameters(), former.parameters()):
        assert relative_error(p.grad, q.grad) <= 1e-5, name


def test_rms_norm_falls_back_to_the_math_where_no_fused_backward_runs():
    from hexiseq.runtime import _elementwise

    assert _elementwise.fused_rms_norm_available("cpu") is False  # torch's CPU build: forward only
    x, weight, _ = rms_norm_case()
    fused_if_any = _elementwise.rms_norm_forward(x, weight, 1e-5)
    math = _elementwise.rms_norm_forward_math(x, weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(fused_if_any, math))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_on_cuda_matches_the_math(dtype):
    from hexiseq.runtime import _elementwise

    if not torch.cuda.is_available() or not _elementwise.fused_rms_norm_available("cuda"):
        pytest.skip("no CUDA device, or this torch has no fused RMSNorm kernels on it")
    generator = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(2, 301, 3072, generator=generator) + 1).to("cuda", dtype)
    weight = (1 + 0.3 * torch.randn(3072, generator=generator)).to("cuda", dtype)
    dy = torch.randn(2, 301, 3072, generator=generator).to("cuda", dtype)
    y, rstd = _elementwise.rms_norm_forward(x, weight, 1e-5)
    y_math, rstd_math = _elementwise.rms_norm_forward_math(x, weight, 1e-5)
    dx, dweight = _elementwise.rms_norm_backward(dy, x, weight, rstd)
    dx_math, dweight_math = _elementwise.rms_norm_backward_math(dy, x, weight, rstd_math)
    bound = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 outputs: one rounding apart
    assert (y.dtype, dx.dtype, rstd.dtype) == (dtype, dtype, torch.float32)
    assert relative_error(rstd, rstd_math) <= 1e-6
    for got, want in ((y, y_math), (dx, dx_math), (dweight, dweight_math)):
        assert relative_error(got, want) <= bound
