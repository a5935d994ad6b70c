"""The attention kernel rule (hexiseq.kernels) and the catalog's per-backend efficiencies."""

from __future__ import annotations

import pytest

from hexiseq import InputError
from hexiseq.catalog import gpu_catalog, gpu_spec
from hexiseq.kernels import ATTENTION_KERNELS, attention_kernel, canonical_kernel_name


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "kernel"),
    [
        ("cpu", "float32", 128, "cpu_flash"),
        ("cpu", "bfloat16", 100, "cpu_flash"),
        ("cuda", "bfloat16", 128, "cudnn"),
        ("cuda", "torch.float16", 64, "cudnn"),
        ("cuda", "bfloat16", 192, "flash"),  # above cuDNN's 128
        ("cuda", "bfloat16", 256, "flash"),
        ("cuda", "float32", 128, "efficient"),
        ("cuda", "float64", 128, "explicit"),
        ("cuda", "bfloat16", 100, "explicit"),  # not a multiple of 8
        ("cuda", "bfloat16", 512, "explicit"),  # above the CUDA kernels' 256
        ("mps", "bfloat16", 128, "explicit"),
        ("H100-SXM", "bfloat16", 128, "cudnn"),  # a catalog GPU runs the CUDA kernels
        ("B200", "bfloat16", 64, "cudnn"),
        ("A100-80G", "bfloat16", 128, "flash"),  # Ampere: torch keeps FA2 first too
        ("RTX-4090", "bfloat16", 128, "flash"),
        ("MI300X", "bfloat16", 128, "flash"),  # ROCm: no cuDNN
    ],
)
def test_attention_kernel_rule(device, dtype, head_dim, kernel):
    assert attention_kernel(device, dtype, head_dim) == kernel
    assert kernel in ATTENTION_KERNELS


def test_former_profiler_names_map_to_the_current_ones():
    assert canonical_kernel_name("cuda_flash") == "flash"
    assert canonical_kernel_name("cuda_efficient") == "efficient"
    assert canonical_kernel_name("cpu_flash") == "cpu_flash"


@pytest.mark.parametrize("name", sorted(gpu_catalog()))
def test_every_gpu_prices_the_kernel_it_runs_and_cites_it(name):
    spec = gpu_spec(name)
    kernel = spec.default_attention_kernel
    assert kernel in spec.attention_efficiency
    assert spec.attention_fwd_efficiency == spec.kernel_efficiency(kernel, backward=False)
    assert spec.attention_bwd_efficiency == spec.kernel_efficiency(kernel, backward=True)
    for entry in spec.attention_efficiency.values():
        assert 0 < entry["bwd"] <= entry["fwd"] <= 1
    assert 0 < spec.memory_bound_efficiency <= 1
    assert spec.sources["attention"].strip() and spec.sources["memory_bound"].strip()


def test_h100_backends_follow_the_measured_rates():
    # ../shared/data/h100-sdpa-gemm-rates.json: cuDNN 1.7-1.9x flash (FA2), efficient ~0.5x.
    spec = gpu_spec("H100-SXM")
    assert spec.default_attention_kernel == "cudnn"
    flash, cudnn, efficient = (
        spec.kernel_efficiency(k, backward=False) for k in ("flash", "cudnn", "efficient")
    )
    assert 1.7 <= cudnn / flash <= 1.9
    assert efficient < flash
    assert flash * spec.dense_bf16_tflops == pytest.approx(328, rel=0.01)  # median causal 8K-32K


def test_unknown_kernel_for_a_gpu_is_a_clear_error():
    with pytest.raises(InputError, match="no attention efficiency for kernel 'cudnn'"):
        gpu_spec("MI300X").kernel_efficiency("cudnn", backward=False)
