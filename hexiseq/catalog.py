"""The GPU catalog: datasheet peak compute, memory, bandwidth and their sources (DESIGN.md §2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from hexiseq._yaml import read_packaged_yaml
from hexiseq.errors import InputError

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's datasheet numbers (units in the names) and published efficiencies."""

    name: str
    vendor: str
    architecture: str
    dense_bf16_tflops: float
    memory_GiB: float
    hbm_GBps: float
    intra_node_link: str
    intra_node_GBps: float
    intra_node_latency_us: float
    gemm_efficiency: float
    attention_fwd_efficiency: float
    attention_bwd_efficiency: float
    measured: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def memory_bytes(self) -> int:
        """Datasheet memory capacity in bytes."""
        return int(self.memory_GiB * GiB)

    @property
    def peak_flops(self) -> float:
        """Dense BF16 peak in FLOP/s."""
        return self.dense_bf16_tflops * 1e12


@cache
def gpu_catalog() -> dict[str, GpuSpec]:
    """All GPU models of `hexiseq/data/gpus.yaml`, by name."""
    raw = read_packaged_yaml("gpus.yaml")["gpus"]
    return {name: GpuSpec(name=name, **entry) for name, entry in raw.items()}


def gpu_spec(name: str) -> GpuSpec:
    """The catalog entry for `name`; `InputError` listing the known names otherwise."""
    catalog = gpu_catalog()
    if name not in catalog:
        raise InputError(f"unknown GPU '{name}'; known GPUs: {', '.join(catalog)}")
    return catalog[name]
