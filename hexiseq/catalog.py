"""The GPU catalog: datasheet peak compute, memory, bandwidth and their sources
(docs/design.md §2).

Attention efficiencies are per kernel backend (`hexiseq.kernels`): the datasheet cost model
prices attention at the efficiency of the kernel the runtime really calls on that device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from hexiseq._yaml import read_packaged_yaml
from hexiseq.errors import InputError

GiB = 1024**3
MiB = 1024**2


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
    attention_efficiency: dict[str, dict[str, float]]
    """kernel backend -> {"fwd": f, "bwd": b}: achieved fraction of the dense peak at head
    size 128 (FLOPs counted as in `hexiseq.flops`, backward 2.5x the forward)."""
    memory_bound_efficiency: float
    """Achieved fraction of `hbm_GBps` of large bandwidth-bound kernels (elementwise, foreach)."""
    special_function_tops: float | None = None
    """Exponentials per second (tera) of the special-function units; None: not modelled. The
    softmax takes one exp per (query, key) pair and head, which bounds small head sizes."""
    sm_count: int | None = None
    """Streaming multiprocessors: the slots a kernel's thread blocks fill in waves (the fitted
    GPU features, `hexiseq.costmodel._gpu_features`); None: not recorded."""
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

    def kernel_efficiency(self, kernel: str, *, backward: bool) -> float:
        """Attention efficiency of `kernel` (see `attention_efficiency`); `InputError` naming
        the kernels the catalog has for this GPU otherwise."""
        entry = self.attention_efficiency.get(kernel)
        if entry is None:
            known = ", ".join(self.attention_efficiency)
            raise InputError(
                f"GPU '{self.name}' has no attention efficiency for kernel '{kernel}'; "
                f"known: {known}"
            )
        return entry["bwd" if backward else "fwd"]

    @property
    def default_attention_kernel(self) -> str:
        """The kernel the runtime runs here in the training dtype at head size 128."""
        from hexiseq.kernels import attention_kernel, training_dtype

        return attention_kernel(self.name, training_dtype(self.name), 128)

    @property
    def attention_fwd_efficiency(self) -> float:
        """Forward efficiency of the kernel the runtime runs here (`default_attention_kernel`)."""
        return self.kernel_efficiency(self.default_attention_kernel, backward=False)

    @property
    def attention_bwd_efficiency(self) -> float:
        """Backward efficiency of the kernel the runtime runs here."""
        return self.kernel_efficiency(self.default_attention_kernel, backward=True)


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


# Ordered: the first rule whose words all appear in the driver's name wins.
_DRIVER_NAME_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("H100", "PCIE"), "H100-PCIe"),
    (("H100", "NVL"), "H100-PCIe"),
    (("H100",), "H100-SXM"),
    (("H800",), "H800"),
    (("H200",), "H200"),
    (("B200",), "B200"),
    (("A800",), "A800-80G"),
    (("V100",), "V100-32G"),
    (("L40S",), "L40S"),
    (("3090",), "RTX-3090"),
    (("4090",), "RTX-4090"),
    (("MI300X",), "MI300X"),
)
_A100_80G_MIN_GIB = 48  # the driver reports ~79 GiB for an 80 GB card, ~39 for a 40 GB one


def catalog_type_for(gpu_name: str, memory_GiB: float) -> str | None:
    """The catalog GPU type whose name `gpu_name` (as the driver reports it) matches."""
    upper = gpu_name.upper()
    if "A100" in upper:
        return "A100-80G" if memory_GiB >= _A100_80G_MIN_GIB else "A100-40G"
    for words, catalog_name in _DRIVER_NAME_RULES:
        if all(word in upper for word in words):
            return catalog_name
    return None
