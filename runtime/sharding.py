"""Model states sharded over the ranks in the plan's fractions, even or not (ZeRO-3 style).

The model's parameters are grouped into units: one per decoder block, and the root (embedding,
final norm, LM head). A unit's parameters, flattened in a fixed order, are cut into one
contiguous range per rank, of `shard_counts(unit size, plan's state fractions)` elements: rank
r keeps its range as an FP32 *master shard* (an `nn.Parameter`, the only parameter the
optimizer sees), with its gradient and AdamW states beside it. So each rank holds exactly the
plan's share of the model states (`RankPrediction.state_fraction`), whatever the split.

Mixed precision without autocast: before a unit's forward every rank casts its shard to the
compute dtype (bf16 on GPU) and all-gathers the unit's whole flat weight in it (`_Gather`); the
modules compute with views into that buffer. Gradients of those views are copied into one FP32
flat buffer and reduce-scattered (summed) onto the shards, so gradients are reduced and
accumulated in FP32. Each rank's loss share is already its part of the global mean
(`loss.sharded_next_token_loss`), so the sum is the full gradient.

When the gathered weight lives: a block's buffer is dropped after its forward; its saved
tensors (weights kept for the backward, e.g. by the linear layers) are packed as offsets into
the unit and, when the backward first asks for one, the unit is gathered again
(`saved_tensors_hooks`), then dropped once its gradient is reduce-scattered. Under activation
checkpointing the recompute gathers it instead. The root stays gathered from the forward until
its backward (it is used first and last). `costmodel.memory` counts exactly these buffers.

Collectives: an even split uses the flat `all_gather_single` / `reduce_scatter_single`; an uneven
one `all_gather` into uneven slices (NCCL runs it as grouped broadcasts; gloo, which rejects
uneven all-gathers, gets one broadcast per rank) and the uneven list form of `reduce_scatter`.
Every rank reaches the same collectives in the same order, the backward included, because
every rank runs the same graph.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hexiseq.runtime._emulation import communication_phase
from hexiseq.runtime.model import LlamaModel, initial_value

STATE_SHARDING = ("sharded", "replicated")
"""`sharded`: states split in the plan's fractions (this module); `replicated`: every rank holds
whole FP32 parameters, computes under autocast and all-reduces gradients (a reference mode)."""
LEGACY_STATE_SHARDING = {"fsdp2": "sharded"}
"""The former name of the sharded mode (scripts written before it)."""

# Even splits: torch 2.13 renames the flat collectives (the old names warn); older torch.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def shard_counts(total: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """Elements of a `total`-element flat unit per rank, in proportion to `fractions`
    (largest remainders, so the counts add up to `total` exactly)."""
    if not fractions or any(f < 0 for f in fractions) or sum(fractions) <= 0:
        raise ValueError(f"shard_counts: fractions must be >= 0 with a positive sum: {fractions}")
    exact = [f / sum(fractions) * total for f in fractions]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


@dataclass(frozen=True)
class _Place:
    """Where one parameter sits in its unit's flat buffer, and the modules that use it."""

    name: str  # fully qualified name in the unsharded model
    users: tuple[tuple[nn.Module, str], ...]  # (module, attribute) pairs; two when tied
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


class ShardedUnit:
    """The parameters of one module (block or root) as a flat buffer split across ranks."""

    def __init__(
        self,
        places: list[_Place],
        counts: tuple[int, ...],
        master: nn.Parameter,
        compute_dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        keep_gathered: bool,
    ) -> None:
        self.places = places
        self.counts = counts
        self.master = master
        self.compute_dtype = compute_dtype
        self.group = group
        self.keep_gathered = keep_gathered
        self.numel = sum(counts)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.gathers = 0  # all-gathers so far (a check for tests)
        self._buffer: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        """The unit's whole flat weight in the compute dtype (collective), kept until
        `release`."""
        if self._buffer is None:
            master = self.master.detach()
            buffer = torch.empty(self.numel, dtype=self.compute_dtype, device=master.device)
            if len(self.counts) == 1:  # the whole unit: cast straight into the buffer
                buffer.copy_(master)
            else:
                shard = master.to(self.compute_dtype)
                with communication_phase():  # an emulated slower device waits, not computes
                    _all_gather_uneven(buffer, shard, self.counts, self.rank, self.group)
            self._buffer = buffer
            self.gathers += 1
        return self._buffer

    def release(self) -> None:
        self._buffer = None

    @property
    def gathered(self) -> bool:
        return self._buffer is not None

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[p.offset : p.offset + p.numel].view(p.shape) for p in self.places]

    def bind(self, views: Sequence[torch.Tensor] | None) -> None:
        """Point every user module's attribute at its parameter's view (None: unbind)."""
        for index, place in enumerate(self.places):
            for module, attribute in place.users:
                setattr(module, attribute, None if views is None else views[index])

    def bind_gathered(self) -> None:
        """Gather the unit (differentiably) and bind its weights for a forward."""
        self.bind(_Gather.apply(self, self.master))

    def pack(self, tensor: torch.Tensor) -> object:
        """A saved tensor that views the gathered buffer becomes its offsets (see module)."""
        buffer = self._buffer
        if buffer is None or _storage_ptr(tensor) != _storage_ptr(buffer):
            return tensor
        return _SavedView(self, tensor.size(), tensor.stride(), tensor.storage_offset())

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        if not isinstance(packed, _SavedView):
            return packed
        buffer = packed.unit.gather()
        return buffer.as_strided(packed.size, packed.stride, packed.storage_offset)

    @contextmanager
    def materialized(self, pack_saved: bool) -> Iterator[None]:
        """A block's weights bound for its forward and dropped after it; with `pack_saved`
        the tensors its forward saves for the backward are packed as offsets (not needed
        under activation checkpointing, which drops them and gathers again to recompute)."""
        self.bind_gathered()
        try:
            if pack_saved:
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    yield
            else:
                yield
        finally:
            self.bind(None)
            self.release()


@dataclass(frozen=True)
class _SavedView:
    unit: ShardedUnit
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Gather(torch.autograd.Function):
    """master shard (FP32) -> the unit's parameters (compute dtype); backward: their
    gradients, in FP32, reduce-scattered onto the shard."""

    @staticmethod
    def forward(ctx, unit: ShardedUnit, master: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(unit.views(unit.gather()))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[None, torch.Tensor]:
        unit: ShardedUnit = ctx.unit
        if unit.keep_gathered:  # the root: its backward is the last use
            unit.bind(None)
        unit.release()  # before the FP32 buffer: the two never coexist
        every = all(grad is not None for grad in grads)  # then every element is written
        fill = torch.empty if every else torch.zeros
        flat = fill(unit.numel, dtype=torch.float32, device=unit.master.device)
        for place, grad in zip(unit.places, grads, strict=True):
            if grad is not None:
                flat[place.offset : place.offset + place.numel].copy_(grad.reshape(-1))
        with communication_phase():
            return None, _reduce_scatter_uneven(flat, unit.counts, unit.rank, unit.group)


def _all_gather_uneven(
    out: torch.Tensor,
    shard: torch.Tensor,
    counts: tuple[int, ...],
    rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    if len(counts) == 1:
        out.copy_(shard)
    elif len(set(counts)) == 1:
        _ALL_GATHER_SINGLE(out, shard, group=group)
    elif dist.get_backend(group) == "gloo":  # gloo has no uneven all-gather
        slices = out.split(list(counts))
        slices[rank].copy_(shard)
        for source, count in enumerate(counts):
            if count:
                global_source = source if group is None else dist.get_global_rank(group, source)
                dist.broadcast(slices[source], global_source, group=group)
    else:
        dist.all_gather(list(out.split(list(counts))), shard, group=group)


def _reduce_scatter_uneven(
    flat: torch.Tensor,
    counts: tuple[int, ...],
    rank: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if len(counts) == 1:
        return flat
    out = torch.empty(counts[rank], dtype=flat.dtype, device=flat.device)
    if len(set(counts)) == 1:
        _REDUCE_SCATTER_SINGLE(out, flat, group=group)
    else:
        dist.reduce_scatter(out, list(flat.split(list(counts))), group=group)
    return out


class ShardedStates:
    """Every unit of a sharded model (`shard_model_states`), with whole views for checks."""

    def __init__(self, units: list[ShardedUnit]) -> None:
        self.units = units

    def master_elements(self) -> int:
        """FP32 parameter elements this rank holds (its shards)."""
        return sum(u.master.numel() for u in self.units)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole FP32 gradient by its unsharded name (collective)."""
        return self._full(lambda unit: unit.master.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole FP32 value by its unsharded name (collective)."""
        return self._full(lambda unit: unit.master)

    def _full(self, shard_of) -> dict[str, torch.Tensor]:
        whole = {}
        for unit in self.units:
            shard = shard_of(unit)
            shard = torch.zeros_like(unit.master) if shard is None else shard.detach()
            flat = torch.empty(unit.numel, dtype=shard.dtype, device=shard.device)
            _all_gather_uneven(flat, shard, unit.counts, unit.rank, unit.group)
            for place, view in zip(unit.places, unit.views(flat), strict=True):
                whole[place.name] = view
        return whole


def shard_model_states(
    model: LlamaModel,
    fractions: Sequence[float] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    group: dist.ProcessGroup | None = None,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> ShardedStates:
    """Shard `model` in place over the ranks of `group` (the default group) in `fractions`
    (even when None): one unit per decoder block, the rest in the root.

    Each rank keeps its FP32 slice of every unit as the unit's master shard (registered on
    the unit's module as `sharded_state`, on `device`) and the original parameters are
    removed; the model then computes in `compute_dtype`. The slices hold the parameters'
    current values (every rank must hold the same) or, with a `seed`,
    `model.initial_value(name, shape, seed)` drawn for this rank's slices only: build the
    model on the meta device and no rank ever holds more than its shares and one parameter."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    fractions = list(fractions) if fractions is not None else [1.0 / world] * world
    if len(fractions) != world:
        raise ValueError(f"shard_model_states: {len(fractions)} fractions for {world} ranks")
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    options = {
        "fractions": fractions,
        "rank": rank,
        "compute_dtype": compute_dtype,
        "group": group,
        "seed": seed,
        "device": device,
    }
    units = [
        _shard_unit(block, f"blocks.{i}.", keep_gathered=False, **options)
        for i, block in enumerate(model.blocks)
    ]
    root = _shard_unit(model, "", keep_gathered=True, skip=model.blocks, **options)
    for unit, block in zip(units, model.blocks, strict=True):
        block.register_forward_pre_hook(_enter(unit, pack_saved=not model.checkpointing))
        block.register_forward_hook(_exit, always_call=True)
    model.before_forward = root.bind_gathered  # the root is bound until its backward
    states = ShardedStates([root, *units])
    model.sharded_states = states
    return states


def _enter(unit: ShardedUnit, pack_saved: bool):
    def hook(module: nn.Module, args: tuple) -> None:
        context = unit.materialized(pack_saved)
        context.__enter__()
        module._hexiseq_unit_contexts = [*getattr(module, "_hexiseq_unit_contexts", []), context]

    return hook


def _exit(module: nn.Module, args: tuple, output: object) -> None:
    contexts = getattr(module, "_hexiseq_unit_contexts", [])
    if contexts:
        contexts.pop().__exit__(None, None, None)


def _shard_unit(
    module: nn.Module,
    prefix: str,
    *,
    fractions: Sequence[float],
    rank: int,
    compute_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    keep_gathered: bool,
    seed: int | None,
    device: torch.device | str | None,
    skip: nn.Module | None = None,
) -> ShardedUnit:
    places, parameters = _places(module, prefix, skip)
    counts = shard_counts(sum(p.numel for p in places), fractions)
    start = sum(counts[:rank])
    end = start + counts[rank]
    if device is None:
        device = parameters[0].device if parameters else "cpu"
    master = torch.empty(counts[rank], dtype=torch.float32, device=device)
    for place, parameter in zip(places, parameters, strict=True):
        low, high = max(start, place.offset), min(end, place.offset + place.numel)
        if low >= high:
            continue  # no part of this parameter is in this rank's shard
        if seed is not None:
            values = initial_value(place.name, place.shape, seed)
        else:
            values = parameter.detach()
        piece = values.reshape(-1)[low - place.offset : high - place.offset]
        master[low - start : high - start].copy_(piece)
    for place in places:
        for owner, attribute in place.users:
            del owner._parameters[attribute]
            setattr(owner, attribute, None)
    master = nn.Parameter(master)
    module.register_parameter("sharded_state", master)
    return ShardedUnit(places, counts, master, compute_dtype, group, keep_gathered)


def _places(
    module: nn.Module, prefix: str, skip: nn.Module | None
) -> tuple[list[_Place], list[nn.Parameter]]:
    """The unit's parameters (each once, a tied one with all its users) in a fixed order."""
    skipped = {id(p) for p in skip.parameters()} if skip is not None else set()
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for module_name, owner in module.named_modules(remove_duplicate=False):
        for attribute, parameter in owner.named_parameters(recurse=False):
            if id(parameter) in skipped:
                continue
            users.setdefault(id(parameter), []).append((owner, attribute))
            qualified = f"{module_name}.{attribute}" if module_name else attribute
            first.setdefault(id(parameter), (prefix + qualified, parameter))
    places, parameters, offset = [], [], 0
    for key, (name, parameter) in first.items():
        places.append(_Place(name, tuple(users[key]), parameter.shape, offset))
        parameters.append(parameter)
        offset += parameter.numel()
    return places, parameters


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on this rank (gathered from the shards if sharded)."""
    states = getattr(model, "sharded_states", None)
    if states is not None:
        return states.full_gradients()
    return {name: parameter.grad for name, parameter in model.named_parameters()}


def canonical_state_sharding(name: str) -> str:
    """`name` with its former spelling (`fsdp2`) mapped to the current one."""
    return LEGACY_STATE_SHARDING.get(name, name)
