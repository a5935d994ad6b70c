"""Distributed checkpoints of the sharded model states, resharded on load, with no pickle.

A checkpoint holds every unit's FP32 master values and AdamW moments (`exp_avg`,
`exp_avg_sq`) as whole 1-D tensors of `unit.numel` elements, written in pieces: each rank
writes its own contiguous range (`sharding`), tagged with its offset in the unit. Loading
reads, for each rank of the *current* split, the overlap of its range with the saved pieces
(torch.distributed.checkpoint's load planner), so a checkpoint saved at one world size,
state fractions and replica count loads into any other split of the same model.

    directory/
      step-00000100/                       complete: renamed into place after every write
        hexiseq-checkpoint.json            format, step, units (names, sizes, AdamW step)
        shard-00001-model-00001-of-00001.safetensors   one per writing rank
        ...
      step-00000200.partial/               a save in progress (or one that crashed): ignored

No pickle anywhere: tensors are safetensors files (DCP's `HuggingFaceStorageWriter` in its
distributed mode: each file's JSON header names its tensors and their offsets), the rest is
the JSON manifest; DCP's default `.metadata` file (a pickle) is never written nor read.

Replicas of a data-parallel plan hold the same values split differently: exactly one
replica writes (`writes=True` on its ranks only); every rank of every replica loads.
AdamW's step count is one number per unit (the same on every rank) kept in the manifest.
Every rank must see the same directory (a shared file system across nodes).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hexiseq.errors import InputError
from hexiseq.runtime._checkpoint_files import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    build_manifest,
    check_same_model,
    check_tensor_files,
    checkpoint_name,
    fresh_folder,
    latest_checkpoint,
    publish,
    read_manifest,
    read_tensor_metadata,
    unit_names,
)
from hexiseq.runtime.sharding import ShardedUnit

__all__ = [
    "MANIFEST_NAME",
    "PARTIAL_SUFFIX",
    "checkpoint_name",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "sharded_units",
    "unit_names",
]

MOMENT_NAMES = ("exp_avg", "exp_avg_sq")
"""The AdamW states shaped like the master (amsgrad's `max_exp_avg_sq` is not supported)."""
# DCP warns when it runs without a process group; a one-process load or save is intended.
_NO_PROCESS_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    writes: bool = True,
) -> Path:
    """Save the sharded model states and AdamW states to `directory/step-{step:08d}`.

    Collective over the default group: every rank calls it, with its model sharded by
    `sharding.shard_model_states` and the optimizer over its master shards. `step` is the
    next step to run. Ranks with `writes=False` (every replica but one) write nothing. The
    tensors go to a `.partial` folder that rank 0 renames once every rank has written, so a
    crash never leaves a checkpoint that looks complete; an existing checkpoint of the same
    step is replaced. Returns the checkpoint's path. Raises InputError for a negative step.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputError(f"checkpoint step must be an integer >= 0 (got {step!r})")
    units = sharded_units(model)
    final = Path(directory) / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    _run_on_rank_zero(lambda: fresh_folder(partial), "prepare the checkpoint folder")
    adamw_steps = _agreed_adamw_steps(units, optimizer)
    state = _state_dict(units, optimizer, create_missing=False) if writes else {}
    writer = HuggingFaceStorageWriter(str(partial), save_distributed=True)
    with _single_process_allowed():
        dcp.save(state, storage_writer=writer, planner=_ShardSavePlanner(), process_group=None)
    manifest = build_manifest(step, units, adamw_steps)
    _run_on_rank_zero(lambda: publish(partial, final, manifest), "publish the checkpoint")
    return final


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Fill this rank's master shards and AdamW states from the checkpoint at `path`, for the
    model's current split (any world size, state fractions or replicas). Collective over the
    default group. Returns the step to run next.

    Raises InputError (one line) when `path` is not a complete hexiseq checkpoint (missing,
    foreign or corrupt files) or holds the states of another model (other units or sizes).
    """
    folder = Path(path)
    manifest = read_manifest(folder)
    units = sharded_units(model)
    check_same_model(manifest, units, folder)
    reader = HuggingFaceStorageReader(str(folder))
    check_tensor_files(folder, manifest, read_tensor_metadata(reader, folder))
    state = _state_dict(units, optimizer, create_missing=True)
    with _single_process_allowed():
        dcp.load(state, storage_reader=reader, planner=_ShardLoadPlanner(), process_group=None)
    for unit, saved in zip(units, manifest["units"], strict=True):
        optimizer.state[unit.master]["step"].fill_(float(saved["adamw_step"]))
    return int(manifest["step"])


def sharded_units(model: torch.nn.Module) -> list[ShardedUnit]:
    """The model's sharded units, root first (ValueError if the model is not sharded)."""
    states = getattr(model, "sharded_states", None)
    if states is None:
        raise ValueError(
            "checkpoints hold sharded model states: shard the model with "
            "runtime.sharding.shard_model_states first"
        )
    return states.units


class _FlatShard:
    """One rank's contiguous range of a 1-D tensor of `total_numel` elements, starting at
    `offset`, as DCP's `_Checkpointable` protocol describes a piece of a whole tensor: its
    save planner writes the piece with its offset, its load planner reads the overlap of the
    saved pieces with it. An empty range takes part in neither."""

    def __init__(self, local: torch.Tensor, offset: int, total_numel: int) -> None:
        self.local = local
        self.offset = offset
        self.total_numel = total_numel

    def size(self) -> torch.Size:
        """The whole tensor's size (DCP checks it against the saved one)."""
        return torch.Size([self.total_numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(
            offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()])
        )

    def __create_write_items__(self, fqn: str, value: object) -> list[WriteItem]:
        if self.local.numel() == 0:
            return []
        data = TensorWriteData(
            chunk=self._chunk(),
            properties=TensorProperties.create_from_tensor(self.local),
            size=self.size(),
        )
        index = MetadataIndex(fqn, torch.Size([self.offset]))
        return [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


class _ShardSavePlanner(DefaultSavePlanner):
    """DCP's save planner for a flat state dict of `_FlatShard`s (its default lookup
    accepts only tensors)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for a flat state dict of `_FlatShard`s. Its default set-up would
    replace every value it does not know (meta-tensor initialization) by None."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self,
        state_dict: dict[str, _FlatShard],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


def _state_dict(
    units: list[ShardedUnit], optimizer: torch.optim.Optimizer, create_missing: bool
) -> dict[str, _FlatShard]:
    """This rank's piece of every saved tensor, by key `{unit}.{master|exp_avg|exp_avg_sq}`.
    Moments AdamW has not made yet are zeros: new tensors on save, created in the optimizer
    (as its first step would) with `create_missing`, to be filled by a load."""
    state = {}
    for name, unit in zip(unit_names(units), units, strict=True):
        offset = sum(unit.counts[: unit.rank])
        tensors = {"master": unit.master.detach(), **_moments(optimizer, unit, create_missing)}
        for kind, tensor in tensors.items():
            state[f"{name}.{kind}"] = _FlatShard(tensor, offset, unit.numel)
    return state


def _moments(
    optimizer: torch.optim.Optimizer, unit: ShardedUnit, create_missing: bool
) -> dict[str, torch.Tensor]:
    group = _param_group(optimizer, unit.master)
    if group.get("amsgrad", False):
        raise ValueError("checkpoints hold AdamW without amsgrad (its max_exp_avg_sq is not kept)")
    adamw = optimizer.state[unit.master]
    if not adamw and create_missing:
        on_device = group.get("fused") or group.get("capturable")
        device = unit.master.device if on_device else torch.device("cpu")
        adamw["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for name in MOMENT_NAMES:
            adamw[name] = torch.zeros_like(unit.master, memory_format=torch.preserve_format)
    if not adamw:
        return {name: torch.zeros_like(unit.master.detach()) for name in MOMENT_NAMES}
    return {name: adamw[name] for name in MOMENT_NAMES}


def _param_group(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    for group in optimizer.param_groups:
        if any(parameter is master for parameter in group["params"]):
            return group
    raise ValueError("the optimizer does not hold the model's master shards")


def _adamw_step(optimizer: torch.optim.Optimizer, unit: ShardedUnit) -> float:
    step = optimizer.state[unit.master].get("step")
    return 0.0 if step is None else float(step)


def _agreed_adamw_steps(units: list[ShardedUnit], optimizer: torch.optim.Optimizer) -> list[int]:
    """Each unit's AdamW step count, checked to be the same on every rank (collective)."""
    steps = torch.tensor([_adamw_step(optimizer, unit) for unit in units], dtype=torch.float64)
    highest, negated_lowest = steps.clone(), -steps
    if dist.is_initialized():
        device = _collective_device()
        highest, negated_lowest = highest.to(device), negated_lowest.to(device)
        dist.all_reduce(highest, dist.ReduceOp.MAX)
        dist.all_reduce(negated_lowest, dist.ReduceOp.MAX)
    if not torch.equal(highest, -negated_lowest):
        raise ValueError(f"AdamW step counts differ across ranks: {steps.tolist()} on this one")
    return [int(step) for step in highest.tolist()]


def _run_on_rank_zero(action: Callable[[], None], what: str) -> None:
    """Run `action` on rank 0; every rank returns once it did, or raises if it failed there
    (rank 0 with its own error), so no rank waits forever on a rank that gave up."""
    failed = torch.zeros(1)
    error: BaseException | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            action()
        except Exception as raised:  # reported to every rank, then re-raised here
            error, failed[0] = raised, 1.0
    if dist.is_initialized():
        failed = failed.to(_collective_device())
        dist.broadcast(failed, src=0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank 0 could not {what} (see its error)")


def _collective_device() -> torch.device:
    """Where the default group's collectives take tensors: the current CUDA device on NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def _single_process_allowed() -> Iterator[None]:
    """DCP without a process group (one process) warns that it assumes one process: meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_WARNING)
        yield
