"""What a measurement ran on: device type and name, clocks, software versions, host.

The device type is the GPU catalog's name (`hexiseq/data/gpus.yaml`), because the cost model
joins profiles to clusters by it: `cpu` for CPUs, and for a GPU the catalog entry its driver
name matches. An unknown GPU is refused rather than guessed; `--device-type` names it.
"""

from __future__ import annotations

import platform
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hexiseq.catalog import catalog_type_for, gpu_catalog, gpu_spec
from hexiseq.errors import InputError

_CUDA_DEVICE = re.compile(r"^cuda(?::(\d+))?$")
_NVIDIA_SMI_TIMEOUT_S = 5.0
_SYSFS_CPU0_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class DeviceIdentity:
    device_type: str
    device_name: str
    clocks: str | None
    torch_version: str
    cuda_version: str | None
    host: str
    cache_bytes: dict[str, int] = field(default_factory=dict)
    """Cache capacities the cost model's cache terms use (`read_cache_bytes`): `l2_bytes`
    (a core's private cache on a CPU) and `llc_bytes` (the last-level cache); empty where the
    machine does not say."""


def parse_device(text: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:I` as a torch device; InputError otherwise."""
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA_DEVICE.match(text)
    if match is None:
        raise InputError(f"--device {text!r} is not allowed; allowed: cpu, cuda, cuda:INDEX")
    return torch.device("cuda", int(match.group(1) or 0))


def check_device_available(device: torch.device) -> None:
    """InputError unless a CUDA device with that index exists (CPU always does)."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index >= count:
        raise InputError(
            f"--device cuda:{device.index}: this machine has {count} CUDA device(s) "
            f"(torch {torch.__version__}); use --device cpu"
        )


def set_threads(threads: int | None) -> None:
    """`torch.set_num_threads(threads)` for the sweep; None leaves torch's own choice."""
    if threads is not None:
        torch.set_num_threads(threads)


def check_cuda_ranks(nproc: int) -> None:
    """A CUDA link sweep runs rank i on cuda:i: refuse when there are fewer devices."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < nproc:
        raise InputError(f"--nproc {nproc} on cuda needs {nproc} CUDA devices; this has {count}")


def describe_device(device: torch.device, device_type: str | None = None) -> DeviceIdentity:
    """Identity of `device`; `device_type` overrides the catalog match (GPUs only)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory_GiB = torch.cuda.get_device_properties(device).total_memory / 1024**3
        resolved = _resolve_gpu_type(name, memory_GiB, device_type)
        clocks = nvidia_smi_clocks(_nvidia_smi_id(device))
    else:
        if device_type not in (None, "cpu"):
            raise InputError(f"--device-type {device_type!r}: a CPU profile is of type cpu")
        name, resolved, clocks = cpu_model_name(), "cpu", cpu_clock()
    return DeviceIdentity(
        device_type=resolved,
        device_name=name,
        clocks=clocks,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        host=socket.gethostname(),
        cache_bytes=read_cache_bytes(device),
    )


def read_cache_bytes(device: torch.device, sysfs: Path = _SYSFS_CPU0_CACHE) -> dict[str, int]:
    """{"l2_bytes": ..., "llc_bytes": ...} of `device`, or {} where they are unknown.

    CPU: the data / unified caches of cpu0 in sysfs (`index*/level`, `type`, `size`, as
    `lscpu` reads them): level 2 and the highest level. CUDA: the GPU's L2, which is its last
    level (both keys). In a VM the sizes are the host's as the hypervisor reports them.
    """
    if device.type == "cuda":
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        return {"l2_bytes": l2, "llc_bytes": l2} if l2 > 0 else {}
    levels: dict[int, int] = {}
    for index in sorted(sysfs.glob("index*")):
        try:
            kind = (index / "type").read_text(encoding="utf-8").strip()
            level = int((index / "level").read_text(encoding="utf-8"))
            size = parse_cache_size((index / "size").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            levels[level] = max(levels.get(level, 0), size)
    if not levels:
        return {}
    return {"l2_bytes": levels.get(2, levels[min(levels)]), "llc_bytes": levels[max(levels)]}


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size: "48K", "2048K", "480M", "1G" or plain bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a cache size: {text!r}")
    power = " KMG".index(match.group(2).upper() or " ")
    return int(match.group(1)) * 1024**power


def _resolve_gpu_type(name: str, memory_GiB: float, device_type: str | None) -> str:
    if device_type is not None:
        return gpu_spec(device_type).name  # InputError listing the catalog if unknown
    matched = catalog_type_for(name, memory_GiB)
    if matched is None:
        raise InputError(
            f"GPU {name!r} matches no catalog type; name it with --device-type "
            f"({', '.join(gpu_catalog())})"
        )
    return matched


def cpu_model_name() -> str:
    """`model name` from /proc/cpuinfo, else what `platform` knows."""
    value = _cpuinfo_field("model name")
    return value or platform.processor() or platform.machine() or "unknown CPU"


def cpu_clock() -> str | None:
    """The first core's current clock from /proc/cpuinfo (it varies with load), if known."""
    value = _cpuinfo_field("cpu MHz")
    return f"cpu {float(value):.0f} MHz (current)" if value else None


def _cpuinfo_field(name: str) -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name and value.strip():
            return value.strip()
    return None


def _nvidia_smi_id(device: torch.device) -> str:
    """The GPU's UUID as nvidia-smi writes it (torch's index differs from nvidia-smi's under
    CUDA_VISIBLE_DEVICES), else the index."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else str(device.index)


def nvidia_smi_clocks(gpu_id: str) -> str | None:
    """SM and memory clocks (current and max) from nvidia-smi, or None without it."""
    query = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"
    command = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", f"--id={gpu_id}"]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in result.stdout.strip().split(",")]
    if len(values) != 4:
        return None
    return f"sm {values[0]}, mem {values[1]} (max sm {values[2]}, max mem {values[3]})"
