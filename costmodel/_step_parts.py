"""The step simulator's bandwidth-bound parts: elementwise, casts, loss, optimizer, launches.

What the runtime moves is counted in `_runtime_work`; here it becomes seconds per rank through
the cost model (`memory_bound_time_s`: a profile's fit where there is one, datasheet HBM
bandwidth x efficiency otherwise), one call per GPU type for all its ranks and all the step's
bandwidth-bound kernels at once (`bandwidth_bound_parts`). Every time is split
into its work (the same bytes in one kernel, at most the total) and launch overhead (what the
kernel count adds on top: the datasheet model's per-kernel floor, a fit's per-call term),
booked as `launch_s`; the two add up to the cost model's time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hexiseq.costmodel._runtime_work import (
    ADAMW_BYTES_PER_PARAM,
    ADAMW_MEASURED_SLOWDOWN,
    FP32,
    FUSED_ADAMW_BYTES_PER_PARAM,
    GRAD_ACCUMULATE_BYTES_PER_PARAM,
    RankKernels,
    Work,
    adamw_launches,
    block_activation_casts_per_token,
    block_elementwise_per_token,
    embedding_gradient_bytes,
    head_elementwise_per_token,
    head_gemm_work,
    loss_work,
    matmul_params_per_layer,
    runtime_dtypes,
    weight_casts_per_layer,
)
from hexiseq.costmodel._state import Ledger, SimContext, per_gpu_type
from hexiseq.model import ModelSpec

Parts = dict[str, np.ndarray]
"""Breakdown key -> [rank] seconds."""


@dataclass(frozen=True)
class Kernels:
    """Bandwidth-bound kernels booked under one breakdown key: the bytes they move and how
    many of them run, per rank (or one count for every rank)."""

    key: str
    bytes_by_rank: np.ndarray
    launches: int | np.ndarray


@dataclass(frozen=True)
class Gemms:
    """GEMMs booked as "linear_s": their FLOPs, operand bytes and count, per rank (or one
    count for every rank)."""

    flops_by_rank: np.ndarray
    bytes_by_rank: np.ndarray
    calls: int | np.ndarray


def priced(context: SimContext, kernels: Sequence[Kernels]) -> list[Parts]:
    """{key: work, "launch_s": overhead} of each of `kernels`, all priced in one cost-model
    call per GPU type (the cost model is elementwise: stacking changes no value)."""
    cost = context.cost
    moved = _stacked(context, [k.bytes_by_rank for k in kernels])
    launches = _stacked(context, [k.launches for k in kernels])
    return _split(
        context,
        [k.key for k in kernels],
        lambda gpu, ranks: cost.memory_bound_time_s(gpu, moved[ranks], calls=launches[ranks]),
        lambda gpu, ranks: cost.memory_bound_time_s(gpu, moved[ranks], calls=1),
    )


def priced_gemms(context: SimContext, gemms: Sequence[Gemms]) -> list[Parts]:
    """{"linear_s": work, "launch_s": overhead} of each of `gemms`, all priced in one
    cost-model call per GPU type."""
    cost = context.cost
    flops = _stacked(context, [g.flops_by_rank for g in gemms])
    moved = _stacked(context, [g.bytes_by_rank for g in gemms])
    calls = _stacked(context, [g.calls for g in gemms])

    def seconds(gpu: str, ranks: np.ndarray | slice, count) -> np.ndarray:
        return cost.gemm_time_s(gpu, flops[ranks], bytes_moved=moved[ranks], calls=count)

    return _split(
        context,
        ["linear_s"] * len(gemms),
        lambda gpu, ranks: seconds(gpu, ranks, calls[ranks]),
        lambda gpu, ranks: seconds(gpu, ranks, 1),
    )


def _stacked(context: SimContext, columns: Sequence[np.ndarray | int]) -> np.ndarray:
    """[rank, column] float64 of per-rank arrays (or one value for every rank)."""
    table = np.empty((context.layout.world_size, len(columns)))
    for i, column in enumerate(columns):
        table[:, i] = column
    return table


def _split(context: SimContext, keys: list[str], total_of, work_of) -> list[Parts]:
    """Each column's work (the same bytes or FLOPs in one kernel, at most the total) under
    its key, and the launch overhead on top, from [rank, column] times."""
    shape = (len(keys),)
    total = per_gpu_type(context, total_of, shape)
    work = np.minimum(per_gpu_type(context, work_of, shape), total)
    return [{key: work[:, i], "launch_s": total[:, i] - work[:, i]} for i, key in enumerate(keys)]


@dataclass(frozen=True)
class BandwidthParts:
    """The step's bandwidth-bound parts, per rank: a layer's elementwise kernels and casts
    (forward, backward), the head's and loss's (loss, elementwise, cast) and the optimizer's."""

    forward: Parts
    backward: Parts
    head_and_loss: tuple[Parts, ...]
    optimizer: Parts


def bandwidth_bound_parts(context: SimContext, fractions: Sequence[float]) -> BandwidthParts:
    """Every bandwidth-bound part of the step, priced at once."""
    sections = {
        "forward": _layer_kernels(context, fractions, backward=False),
        "backward": _layer_kernels(context, fractions, backward=True),
        "head_and_loss": _head_kernels(context, fractions),
        "optimizer": [_optimizer_kernels(context, fractions)],
    }
    parts = iter(priced(context, [k for kernels in sections.values() for k in kernels]))
    by_section = {name: [next(parts) for _ in kernels] for name, kernels in sections.items()}
    return BandwidthParts(
        forward=add_parts(*by_section["forward"]),
        backward=add_parts(*by_section["backward"]),
        head_and_loss=tuple(by_section["head_and_loss"]),
        optimizer=by_section["optimizer"][0],
    )


def add_parts(*many: Parts) -> Parts:
    """Key-wise sum of several `Parts`."""
    summed: Parts = {}
    for parts in many:
        for key, seconds in parts.items():
            summed[key] = summed.get(key, 0.0) + seconds
    return summed


def _layer_kernels(
    context: SimContext, fractions: Sequence[float], *, backward: bool
) -> list[Kernels]:
    """One layer's elementwise kernels and casts, forward or backward, per rank."""
    tokens = context.tokens.astype(np.float64)
    model = context.model
    dtypes = runtime_dtypes(context.train)
    elementwise = per_rank_work(
        context,
        lambda rank: block_elementwise_per_token(model, dtypes, backward=backward, rank=rank),
    )
    activation_casts = block_activation_casts_per_token(model, dtypes, backward=backward)
    weight_casts = weight_casts_per_layer(dtypes, backward=backward)
    weight_cast_bytes = weight_casts.bytes * _cast_params(context, fractions, backward)
    return [
        Kernels("elementwise_s", elementwise.bytes * tokens, elementwise.kernels),
        Kernels(
            "cast_s",
            activation_casts.bytes * tokens + weight_cast_bytes,
            activation_casts.kernels + weight_casts.kernels,
        ),
    ]


def per_rank_work(context: SimContext, work_of: Callable[[RankKernels], Work]) -> Work:
    """`work_of` each rank's `RankKernels` (fused RMSNorm unless a CPU rank; the ring's
    groups; whether its HP group is the rank alone), once per distinct kind: one `Work` when
    every rank is of one kind, else [rank] arrays."""
    kinds, kind_of = context.on_cluster("rank kinds", _rank_kinds)
    if kind_of is None:
        return work_of(kinds[0])
    works = [work_of(kind) for kind in kinds]
    return Work(
        np.array([w.bytes for w in works], dtype=np.float64)[kind_of],
        np.array([w.kernels for w in works], dtype=np.float64)[kind_of],
    )


def _rank_kinds(context: SimContext) -> tuple[list[RankKernels], np.ndarray | None]:
    """The distinct `RankKernels` of the ranks and [rank] the index of each rank's (None
    where all are of one kind)."""
    group_sizes = np.bincount(context.group_of)
    steps = len(group_sizes)
    cpu = context.ranks_by_gpu.get("cpu")
    if cpu is None and (group_sizes.min() > 1 or group_sizes.max() == 1):
        return [RankKernels(True, steps, bool(group_sizes.max() == 1))], None
    alone = group_sizes[context.group_of] == 1
    fused = np.ones(len(alone), dtype=bool)
    if cpu is not None:
        fused[cpu] = False
    keys = list(dict.fromkeys(zip(fused.tolist(), alone.tolist())))
    index = {key: i for i, key in enumerate(keys)}
    kind_of = np.array([index[key] for key in zip(fused.tolist(), alone.tolist())])
    kind_of.setflags(write=False)
    return [RankKernels(f, steps, a) for f, a in keys], kind_of


def _cast_params(context: SimContext, fractions: Sequence[float], backward: bool) -> np.ndarray:
    """[rank] matmul weights of a block whose copy one pass casts. `autocast` recipe: the
    whole block (every use casts). `sharded` (`runtime/sharding.py`): the forward casts the
    rank's shard before gathering it (the checkpoint's recompute is a forward); the backward
    copies the whole block's gradient into the FP32 reduce-scatter buffer and, without
    checkpointing, casts the shard again to gather the block back."""
    params = float(matmul_params_per_layer(context.model))
    world = context.layout.world_size
    if not runtime_dtypes(context.train).sharded:
        return np.full(world, params)
    shards = np.asarray(fractions, dtype=np.float64) * params
    if not backward:
        return shards
    regather = 0.0 if context.train.activation_checkpointing else 1.0
    return params + regather * shards


def _head_kernels(context: SimContext, fractions: Sequence[float]) -> list[Kernels]:
    """Per micro-batch: the loss kernels, the embedding and final norm's elementwise work, and
    the head weight's cast, per rank."""
    model, train = context.model, context.train
    tokens = context.tokens.astype(np.float64)
    element = train.compute_dtype_bytes
    head_matrix = float(model.vocab * model.hidden)
    dtypes = runtime_dtypes(train)
    loss = loss_work(model, dtypes, tokens)
    head = per_rank_work(context, lambda rank: head_elementwise_per_token(model, dtypes, rank))
    # The loss copies an FP32 head weight to the compute dtype once and accumulates its
    # gradient in FP32 (no cast back); sharded, the weight comes gathered in the compute dtype.
    casts = (element + FP32) * head_matrix if dtypes.casts_weights else 0.0
    shares = np.asarray(fractions, dtype=np.float64)
    return [
        Kernels("loss_s", loss.bytes, loss.kernels),
        Kernels(
            "elementwise_s",
            head.bytes * tokens + shares * embedding_gradient_bytes(model),
            head.kernels + 2,
        ),
        Kernels("cast_s", np.full(len(tokens), casts), 1 if casts else 0),
    ]


def head_gemms(context: SimContext) -> Gemms:
    """Per micro-batch: the LM head's GEMMs (inside the chunked loss, `runtime/loss.py`: three
    GEMMs a chunk), per rank."""
    tokens = context.tokens.astype(np.float64)
    dtypes = runtime_dtypes(context.train)
    return Gemms(*head_gemm_work(context.model, dtypes, tokens))


def head_and_loss_parts(context: SimContext, head: Parts, bandwidth: BandwidthParts) -> Ledger:
    """Per micro-batch: the LM head's GEMMs (`head`), then the loss kernels, the embedding and
    final norm's elementwise work and the head weight's cast (`bandwidth`), per rank."""
    ledger = Ledger(context.layout.world_size)
    for parts in (head, *bandwidth.head_and_loss):
        for key, seconds in parts.items():
            ledger.add(key, seconds)
    return ledger


def _optimizer_kernels(context: SimContext, fractions: Sequence[float]) -> Kernels:
    """Per step: AdamW on each rank's shard of the parameters, and the gradient accumulation
    of micro-batches after the first (both bandwidth-bound). AdamW's bytes are weighted by its
    measured slowdown against plain elementwise kernels (`ADAMW_MEASURED_SLOWDOWN`) in the
    `autocast` recipe (foreach); the fused AdamW of the `sharded` one at the elementwise rate."""
    params = np.asarray(fractions, dtype=np.float64) * context.model.params
    accumulations = context.train.micro_batches - 1
    fused = runtime_dtypes(context.train).sharded
    if fused:  # one flat master shard per unit: one accumulation kernel each
        adam = FUSED_ADAMW_BYTES_PER_PARAM * params
        tensors = context.model.layers + 1
    else:
        adam = ADAMW_MEASURED_SLOWDOWN * ADAMW_BYTES_PER_PARAM * params
        tensors = _parameter_tensors(context.model)
    accumulate = accumulations * GRAD_ACCUMULATE_BYTES_PER_PARAM * params
    launches = adamw_launches(params, fused) + accumulations * tensors
    return Kernels("optimizer_s", adam + accumulate, launches)


def optimizer_parts(context: SimContext, bandwidth: BandwidthParts) -> Ledger:
    """Per step: the optimizer's part (`bandwidth`) as a ledger."""
    ledger = Ledger(context.layout.world_size)
    for key, seconds in bandwidth.optimizer.items():
        ledger.add(key, seconds)
    return ledger


def _parameter_tensors(model: ModelSpec) -> int:
    """Parameter tensors (one `.grad` accumulation kernel each): 7 matrices and 2 norms per
    block, the embedding, the final norm and an untied head."""
    return 9 * model.layers + 2 + (0 if model.tied_embeddings else 1)
