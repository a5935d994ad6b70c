"""Tests of the GPU catalog (hexiseq/data/gpus.yaml, docs/design.md §2)."""

from __future__ import annotations

import pytest

from hexiseq import InputError, gpu_catalog, gpu_spec
from hexiseq.catalog import GiB

DESIGN_GPUS = [
    "V100-32G",
    "A100-40G",
    "A100-80G",
    "A800-80G",
    "H100-SXM",
    "H100-PCIe",
    "H800",
    "H200",
    "L40S",
    "RTX-3090",
    "RTX-4090",
    "B200",
    "MI300X",
    "cpu",
]

EFFICIENCIES = ("gemm_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency")


def test_every_design_gpu_is_in_the_catalog():
    missing = [name for name in DESIGN_GPUS if name not in gpu_catalog()]
    assert missing == []


@pytest.mark.parametrize("name", sorted(gpu_catalog()))
def test_entry_has_a_source_for_each_number(name):
    spec = gpu_spec(name)
    assert spec.name == name
    assert set(spec.sources) >= {"peak", "memory", "link", "efficiency"}
    for key in ("peak", "memory", "link", "efficiency"):
        assert isinstance(spec.sources[key], str)
        assert spec.sources[key].strip(), f"{name}: empty source for {key}"


@pytest.mark.parametrize("name", sorted(gpu_catalog()))
def test_entry_numbers_are_in_range(name):
    spec = gpu_spec(name)
    for field_name in EFFICIENCIES:
        value = getattr(spec, field_name)
        assert 0 < value <= 1, f"{name}.{field_name} = {value}"
    for field_name in (
        "dense_bf16_tflops",
        "memory_GiB",
        "hbm_GBps",
        "intra_node_GBps",
        "intra_node_latency_us",
    ):
        assert getattr(spec, field_name) > 0, f"{name}.{field_name}"
    # A backward pass does more, less regular work than the forward: never a higher efficiency.
    assert spec.attention_bwd_efficiency <= spec.attention_fwd_efficiency


def test_only_cpu_is_measured_and_says_so():
    measured = [name for name, spec in gpu_catalog().items() if spec.measured]
    assert measured == ["cpu"]
    assert gpu_spec("cpu").sources["peak"].startswith("measured")


@pytest.mark.parametrize(
    ("name", "tflops", "memory_GiB", "hbm_GBps"),
    [
        ("H100-SXM", 989.4, 80, 3350),  # 1,979 TFLOPS with sparsity / 2
        ("H800", 989.4, 80, 3350),
        ("H200", 989.4, 139.8, 4800),
        ("A100-40G", 312.0, 40, 1555),
        ("A100-80G", 312.0, 80, 2039),
        ("A800-80G", 312.0, 80, 2039),
        ("H100-PCIe", 756.0, 80, 2000),
        ("MI300X", 1307.4, 192, 5300),
        ("L40S", 362.05, 48, 864),
        ("RTX-4090", 165.2, 24, 1008),
    ],
)
def test_datasheet_numbers(name, tflops, memory_GiB, hbm_GBps):
    spec = gpu_spec(name)
    assert spec.dense_bf16_tflops == tflops
    assert spec.memory_GiB == memory_GiB
    assert spec.hbm_GBps == hbm_GBps


def test_nvlink_figures_are_one_direction():
    # Datasheets quote NVLink bidirectional; the catalog stores one direction (half).
    assert gpu_spec("H100-SXM").intra_node_GBps == 900 / 2
    assert gpu_spec("A100-80G").intra_node_GBps == 600 / 2
    assert gpu_spec("B200").intra_node_GBps == 1800 / 2


def test_derived_units():
    h100 = gpu_spec("H100-SXM")
    assert h100.peak_flops == pytest.approx(989.4e12)
    assert h100.memory_bytes == 80 * 1024**3 == 80 * GiB
    assert isinstance(h100.memory_bytes, int)
    assert gpu_spec("H200").memory_bytes == int(139.8 * GiB)  # measured by torch


def test_unknown_gpu_lists_known_names():
    with pytest.raises(InputError, match=r"^unknown GPU 'H300'; known GPUs: V100-32G, .*, cpu$"):
        gpu_spec("H300")
