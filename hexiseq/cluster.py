"""Clusters: nodes of GPUs and the links between them, read from YAML, a dict or a preset.

The file format (docs/design.md §2) is validated by pydantic models so that bad input gets one line
naming the file, the field and what is allowed; inside the program a `Cluster` is a frozen
dataclass with one `Device` per global rank (ranks numbered node by node, in file order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hexiseq._yaml import format_validation_error, read_yaml_file
from hexiseq.catalog import GpuSpec, gpu_catalog, gpu_spec
from hexiseq.errors import InputError

DEFAULT_INTER_NODE_LATENCY_US = 10.0  # NCCL small-message latency over InfiniBand/RoCE, order of


MIN_LINK_GBPS, MAX_LINK_GBPS = 1e-6, 1e7
"""Link bandwidths a cluster file may give, GB/s per GPU one way: from 1 kB/s (slower than any
network; the simulator's tests use such links to expose every transfer) to far beyond any
NVLink generation. Outside that range a number is a typo or a unit mix-up: 1e-300 GB/s
planned a step of 1e300 seconds and saved it as 0.0 tokens/s."""
MAX_LATENCY_US = 1e6  # a second per message
MEASURED_SLOWDOWN_RANGE = (0.01, 100.0)
"""A device measured from 100x faster to 100x slower than its type's model: beyond that the
measurement, not the device, is wrong."""


class _Strict(BaseModel):
    # No infinities or NaN in any number; no silent bool -> int.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NodeFile(_Strict):
    """One node of the cluster file."""

    name: str = Field(min_length=1)
    gpu: str
    count: StrictInt = Field(ge=1, le=1024)
    intra_node_GBps: float | None = Field(default=None, ge=MIN_LINK_GBPS, le=MAX_LINK_GBPS)
    emulation_slowdown: float = Field(default=1.0, ge=1.0)
    memory_GiB: StrictFloat | None = None
    """Memory per device replacing the catalog's (gpu: cpu test clusters only): lets a CPU
    cluster stand in for cards too small for even model-state shares."""
    measured_slowdown: list[float] | None = None
    """Per device of the node, how many times slower than its GPU type's cost model the
    runtime measured it (a re-plan writes it, `hexiseq run --replan`): the cost model
    multiplies the device's compute by it; the runtime does not emulate it."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, name: str) -> str:
        if name not in gpu_catalog():
            raise ValueError(f"unknown GPU '{name}'; allowed: {', '.join(gpu_catalog())}")
        return name

    @field_validator("memory_GiB")
    @classmethod
    def _positive_memory(cls, memory_GiB: float | None, info: ValidationInfo) -> float | None:
        if memory_GiB is not None and memory_GiB <= 0:
            node = info.data.get("name", "?")
            raise ValueError(
                f"must be a positive number of GiB (node '{node}' has {memory_GiB:g})"
            )
        return memory_GiB

    @model_validator(mode="after")
    def _one_measured_slowdown_per_device(self) -> NodeFile:
        factors = self.measured_slowdown
        if factors is None:
            return self
        if len(factors) != self.count:
            raise ValueError(
                f"measured_slowdown gives {len(factors)} factor(s) for node '{self.name}' of "
                f"{self.count} device(s): give one per device"
            )
        low, high = MEASURED_SLOWDOWN_RANGE
        bad = [f for f in factors if not low <= f <= high]
        if bad:
            raise ValueError(
                f"measured_slowdown of node '{self.name}' must lie in {low:g}..{high:g} "
                f"(got {bad[0]:g})"
            )
        return self

    @model_validator(mode="after")
    def _emulation_only_on_cpu(self) -> NodeFile:
        if self.emulation_slowdown != 1.0 and self.gpu != "cpu":
            raise ValueError(
                f"emulation_slowdown is for gpu: cpu test clusters only (node '{self.name}' "
                f"has gpu {self.gpu})"
            )
        return self

    @model_validator(mode="after")
    def _memory_only_on_cpu(self) -> NodeFile:
        # A GPU's memory is its datasheet's; only an emulated (CPU) device may claim another.
        if self.memory_GiB is not None and self.gpu != "cpu":
            raise ValueError(
                f"memory_GiB is for gpu: cpu test clusters only (node '{self.name}' has gpu "
                f"{self.gpu}, whose memory is the catalog's {gpu_spec(self.gpu).memory_GiB:g} GiB)"
            )
        return self


class OverrideFile(_Strict):
    """Bandwidth of the link between two nodes, overriding `inter_node_GBps`."""

    a: str
    b: str
    GBps: float = Field(ge=MIN_LINK_GBPS, le=MAX_LINK_GBPS)


class NetworkFile(_Strict):
    """Inter-node network: per-GPU NIC bandwidth in one direction, optional per-pair overrides."""

    inter_node_GBps: float = Field(ge=MIN_LINK_GBPS, le=MAX_LINK_GBPS)
    inter_node_latency_us: float = Field(
        default=DEFAULT_INTER_NODE_LATENCY_US, ge=0, le=MAX_LATENCY_US
    )
    overrides: list[OverrideFile] = Field(default_factory=list)


class ClusterFile(_Strict):
    """The whole cluster YAML document."""

    name: str = Field(min_length=1)
    nodes: list[NodeFile] = Field(min_length=1)
    network: NetworkFile | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ClusterFile:
        names = [node.name for node in self.nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"node names must be unique; repeated: {', '.join(duplicates)}")
        if len(self.nodes) > 1 and self.network is None:
            raise ValueError("network is required when there is more than one node")
        _check_overrides(self.network.overrides if self.network else [], names)
        return self


def _check_overrides(overrides: list[OverrideFile], names: list[str]) -> None:
    seen: set[frozenset[str]] = set()
    for override in overrides:
        for end in (override.a, override.b):
            if end not in names:
                raise ValueError(
                    f"network.overrides names unknown node '{end}'; nodes: {', '.join(names)}"
                )
        pair = frozenset((override.a, override.b))
        if len(pair) == 1:
            raise ValueError(
                f"network.overrides: a node cannot override a link to itself ('{override.a}'); "
                "set intra_node_GBps on the node instead"
            )
        if pair in seen:
            raise ValueError(
                f"network.overrides: the link {override.a} - {override.b} is given twice"
            )
        seen.add(pair)


@dataclass(frozen=True, slots=True)
class Node:
    """A node: `count` GPUs of one model sharing an intra-node link."""

    name: str
    gpu: str
    count: int
    intra_node_GBps: float
    emulation_slowdown: float = 1.0
    memory_GiB: float | None = None  # None: the catalog's; set only on gpu: cpu test nodes
    measured_slowdown: tuple[float, ...] | None = None  # per device; None: all 1

    def device_slowdown(self, local_rank: int) -> float:
        """The measured slowdown of device `local_rank` of the node (1: as modelled)."""
        return 1.0 if self.measured_slowdown is None else self.measured_slowdown[local_rank]


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU: its global rank, GPU model, node name and rank inside the node."""

    rank: int
    gpu: str
    node: str
    local_rank: int
    emulation_slowdown: float = 1.0
    memory_GiB: float | None = None  # None: the catalog's (see `Cluster.gpu`)
    measured_slowdown: float = 1.0
    """How many times slower than its type's model the runtime measured it (a re-plan)."""

    @property
    def compute_slowdown(self) -> float:
        """What the cost model multiplies this device's compute by: its emulated slowdown
        (a CPU test device) times its measured one."""
        return self.emulation_slowdown * self.measured_slowdown


@dataclass(frozen=True)
class Cluster:
    """A heterogeneous cluster (contract: `from_yaml`, `from_dict`, `preset`, `devices`)."""

    name: str
    nodes: tuple[Node, ...]
    inter_node_GBps: float
    inter_node_latency_us: float
    overrides: tuple[tuple[str, str, float], ...] = ()

    @cached_property
    def devices(self) -> list[Device]:
        """One `Device` per global rank, node by node in file order (built once)."""
        devices: list[Device] = []
        for node in self.nodes:
            for local in range(node.count):
                devices.append(
                    Device(
                        len(devices),
                        node.gpu,
                        node.name,
                        local,
                        node.emulation_slowdown,
                        node.memory_GiB,
                        node.device_slowdown(local),
                    )
                )
        return devices

    @cached_property
    def world_size(self) -> int:
        return sum(node.count for node in self.nodes)

    @cached_property
    def rank_gpus(self) -> tuple[str, ...]:
        """Each rank's GPU model, built once."""
        return tuple(device.gpu for device in self.devices)

    @cached_property
    def memory_capacities_bytes(self) -> tuple[int, ...]:
        """Each rank's memory capacity (`gpu(rank).memory_bytes`), built once: a step
        simulation reports it for every rank."""
        return tuple(spec.memory_bytes for spec in self._specs)

    @cached_property
    def compute_slowdowns(self) -> tuple[float, ...]:
        """Each rank's `Device.compute_slowdown`, built once."""
        return tuple(device.compute_slowdown for device in self.devices)

    @cached_property
    def node_indices(self) -> tuple[int, ...]:
        """Each rank's node, as its index in `nodes`, built once."""
        index = {node.name: i for i, node in enumerate(self.nodes)}
        return tuple(index[device.node] for device in self.devices)

    @property
    def gpu_types(self) -> list[str]:
        """GPU models present, in order of first appearance."""
        return list(dict.fromkeys(node.gpu for node in self.nodes))

    def gpu(self, rank: int) -> GpuSpec:
        """Catalog entry of the GPU at `rank`, with its node's `memory_GiB` where the cluster
        sets one: read a rank's memory capacity here, never from the catalog by GPU type."""
        return self._specs[rank]

    @cached_property
    def _specs(self) -> tuple[GpuSpec, ...]:
        specs = []
        for device in self.devices:
            spec = gpu_spec(device.gpu)
            if device.memory_GiB is not None:
                spec = replace(spec, memory_GiB=device.memory_GiB)
            specs.append(spec)
        return tuple(specs)

    def subset(self, node_names: Sequence[str], name: str | None = None) -> Cluster:
        """The cluster of these nodes only (file order kept), their links as declared."""
        keep = set(node_names)
        unknown = keep - set(self._nodes_by_name)
        if unknown:
            self._node(sorted(unknown)[0])  # raises InputError naming the known nodes
        return Cluster(
            name or f"{self.name}[{','.join(n.name for n in self.nodes if n.name in keep)}]",
            tuple(node for node in self.nodes if node.name in keep),
            self.inter_node_GBps,
            self.inter_node_latency_us,
            tuple(o for o in self.overrides if o[0] in keep and o[1] in keep),
        )

    def with_measured_slowdowns(self, factors: Mapping[int, float]) -> Cluster:
        """The cluster with device rank r measured `factors[r]` times slower than before (its
        `measured_slowdown` multiplied): what a re-plan sees after a device drifted."""
        low, high = MEASURED_SLOWDOWN_RANGE
        for rank, factor in factors.items():
            if not 0 <= rank < self.world_size:
                raise InputError(
                    f"measured slowdown for rank {rank}: cluster {self.name} has ranks "
                    f"0..{self.world_size - 1}"
                )
            if not (math.isfinite(factor) and factor > 0):
                raise InputError(f"measured slowdown of rank {rank} must be > 0 (got {factor})")
        nodes, first = [], 0
        for node in self.nodes:
            old = [node.device_slowdown(local) for local in range(node.count)]
            new = [slow * factors.get(first + local, 1.0) for local, slow in enumerate(old)]
            for local, value in enumerate(new):
                if not low <= value <= high:
                    raise InputError(
                        f"measured slowdown of rank {first + local} would be {value:g}: "
                        f"allowed {low:g}..{high:g} (the measurement, not the device, is wrong)"
                    )
            measured = None if all(f == 1.0 for f in new) else tuple(new)
            nodes.append(replace(node, measured_slowdown=measured))
            first += node.count
        return replace(self, nodes=tuple(nodes))

    def without_ranks(self, ranks: Iterable[int]) -> Cluster:
        """The cluster without the devices at these ranks (lost): the other devices keep their
        order and are numbered again from 0; a node left empty goes, with its links."""
        lost = set(ranks)
        unknown = sorted(r for r in lost if not 0 <= r < self.world_size)
        if unknown:
            raise InputError(
                f"lost rank {unknown[0]}: cluster {self.name} has ranks 0..{self.world_size - 1}"
            )
        if len(lost) == self.world_size:
            raise InputError(f"cluster {self.name}: every device is lost, none left to plan")
        nodes, first = [], 0
        for node in self.nodes:
            kept = [local for local in range(node.count) if first + local not in lost]
            first += node.count
            if not kept:
                continue
            measured = None
            if node.measured_slowdown is not None:
                measured = tuple(node.measured_slowdown[local] for local in kept)
            nodes.append(replace(node, count=len(kept), measured_slowdown=measured))
        names = {node.name for node in nodes}
        overrides = tuple(o for o in self.overrides if o[0] in names and o[1] in names)
        return replace(self, nodes=tuple(nodes), overrides=overrides)

    def link_GBps(self, node_a: str, node_b: str) -> float:
        """One-direction bandwidth per GPU between two nodes (intra-node link if equal)."""
        if node_a == node_b:
            return self._node(node_a).intra_node_GBps
        self._node(node_a), self._node(node_b)  # unknown names raise InputError
        for a, b, gbps in self.overrides:
            if {a, b} == {node_a, node_b}:
                return gbps
        return self.inter_node_GBps

    def link_latency_s(self, node_a: str, node_b: str) -> float:
        """Per-message latency between two nodes in seconds."""
        if node_a == node_b:
            return gpu_spec(self._node(node_a).gpu).intra_node_latency_us * 1e-6
        return self.inter_node_latency_us * 1e-6

    @cached_property
    def _nodes_by_name(self) -> dict[str, Node]:
        return {node.name: node for node in self.nodes}

    def _node(self, name: str) -> Node:
        if name in self._nodes_by_name:
            return self._nodes_by_name[name]
        known = ", ".join(node.name for node in self.nodes)
        raise InputError(f"cluster {self.name} has no node '{name}'; nodes: {known}")

    def to_dict(self) -> dict[str, Any]:
        """The cluster as a document `from_dict` accepts (round-trips exactly)."""
        return {
            "name": self.name,
            "nodes": [_node_to_dict(node) for node in self.nodes],
            "network": {
                "inter_node_GBps": self.inter_node_GBps,
                "inter_node_latency_us": self.inter_node_latency_us,
                "overrides": [{"a": a, "b": b, "GBps": g} for a, b, g in self.overrides],
            },
        }

    @classmethod
    def from_dict(cls, document: Any, source: str = "cluster") -> Cluster:
        """Validate a cluster document; `InputError` with one line naming the field otherwise."""
        if not isinstance(document, dict):
            kind = type(document).__name__
            raise InputError(
                f"{source}: expected a mapping with keys name, nodes, network; got {kind}"
            )
        try:
            parsed = ClusterFile.model_validate(document)
        except ValidationError as exc:
            raise InputError(format_validation_error(exc, source, ClusterFile)) from None
        return _cluster_from_file(parsed)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Read and validate a cluster YAML file."""
        return cls.from_dict(read_yaml_file(path, "cluster"), source=f"cluster file {path}")

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A bundled cluster (`cluster_presets()` lists them)."""
        presets = cluster_presets()
        if name not in presets:
            raise InputError(f"unknown cluster preset '{name}'; presets: {', '.join(presets)}")
        return cls.from_yaml(presets[name])

    @classmethod
    def load(cls, path_or_preset: str) -> Cluster:
        """A preset name or a path to a YAML file (what the CLI's `--cluster` takes)."""
        if path_or_preset in cluster_presets():
            return cls.preset(path_or_preset)
        if Path(path_or_preset).suffix in {".yaml", ".yml"} or Path(path_or_preset).exists():
            return cls.from_yaml(path_or_preset)
        raise InputError(
            f"--cluster '{path_or_preset}' is neither a YAML file nor a preset; "
            f"presets: {', '.join(cluster_presets())}"
        )


def cluster_presets() -> dict[str, Path]:
    """Bundled cluster files by preset name (the file stem)."""
    folder = resources.files("hexiseq").joinpath("data", "clusters")
    files = sorted(Path(str(folder)).glob("*.yaml"))
    return {path.stem: path for path in files}


def _cluster_from_file(parsed: ClusterFile) -> Cluster:
    network = parsed.network or NetworkFile(inter_node_GBps=1.0)
    nodes = tuple(
        Node(
            name=node.name,
            gpu=node.gpu,
            count=node.count,
            intra_node_GBps=float(node.intra_node_GBps or gpu_spec(node.gpu).intra_node_GBps),
            emulation_slowdown=node.emulation_slowdown,
            memory_GiB=node.memory_GiB,
            measured_slowdown=(
                None if node.measured_slowdown is None else tuple(node.measured_slowdown)
            ),
        )
        for node in parsed.nodes
    )
    overrides = tuple((o.a, o.b, o.GBps) for o in network.overrides)
    return Cluster(
        parsed.name, nodes, network.inter_node_GBps, network.inter_node_latency_us, overrides
    )


def _node_to_dict(node: Node) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": node.name,
        "gpu": node.gpu,
        "count": node.count,
        "intra_node_GBps": node.intra_node_GBps,
    }
    if node.emulation_slowdown != 1.0:
        entry["emulation_slowdown"] = node.emulation_slowdown
    if node.memory_GiB is not None:
        entry["memory_GiB"] = node.memory_GiB
    if node.measured_slowdown is not None:
        entry["measured_slowdown"] = list(node.measured_slowdown)
    return entry
