"""The step simulator's bandwidth-bound parts: elementwise, casts, loss, optimizer, launches.

What the runtime moves is counted in `_runtime_work`; here it becomes seconds per rank through
the cost model (`memory_bound_time_s`: a profile's fit where there is one, datasheet HBM
bandwidth x efficiency otherwise), one call per GPU type for all its ranks. Every time is split
into its work (the same bytes in one kernel, at most the total) and launch overhead (what the
kernel count adds on top: the datasheet model's per-kernel floor, a fit's per-call term),
booked as `launch_s`; the two add up to the cost model's time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hexiseq.costmodel._runtime_work import (
    ADAMW_BYTES_PER_PARAM,
    ADAMW_MEASURED_SLOWDOWN,
    FP32,
    FUSED_ADAMW_BYTES_PER_PARAM,
    GRAD_ACCUMULATE_BYTES_PER_PARAM,
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


def bandwidth_parts(context: SimContext, key: str, bytes_by_rank: np.ndarray, kernels) -> Parts:
    """{key: work, "launch_s": overhead} of bandwidth-bound kernels moving `bytes_by_rank`."""
    cost = context.cost

    def total(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        return cost.memory_bound_time_s(gpu, bytes_by_rank[ranks], calls=_at(kernels, ranks))

    def work(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        return cost.memory_bound_time_s(gpu, bytes_by_rank[ranks], calls=1)

    return _split(context, key, total, work)


def gemm_parts(
    context: SimContext,
    flops_by_rank: np.ndarray,
    bytes_by_rank: np.ndarray,
    calls: int | np.ndarray,
) -> Parts:
    """{"linear_s": work, "launch_s": overhead} of `calls` GEMMs per rank (or [rank])."""
    cost = context.cost

    def seconds(gpu: str, ranks: np.ndarray | slice, count) -> np.ndarray:
        return cost.gemm_time_s(
            gpu, flops_by_rank[ranks], bytes_moved=bytes_by_rank[ranks], calls=count
        )

    return _split(
        context,
        "linear_s",
        lambda g, r: seconds(g, r, _at(calls, r)),
        lambda g, r: seconds(g, r, 1),
    )


def _split(context: SimContext, key: str, total_of, work_of) -> Parts:
    total = per_gpu_type(context, total_of)
    work = np.minimum(per_gpu_type(context, work_of), total)
    return {key: work, "launch_s": total - work}


def _at(value, ranks: np.ndarray | slice):
    return value[ranks] if isinstance(value, np.ndarray) else value


def add_parts(*many: Parts) -> Parts:
    """Key-wise sum of several `Parts`."""
    summed: Parts = {}
    for parts in many:
        for key, seconds in parts.items():
            summed[key] = summed.get(key, 0.0) + seconds
    return summed


def layer_bandwidth_parts(
    context: SimContext, fractions: Sequence[float], *, backward: bool
) -> Parts:
    """One layer's elementwise kernels and casts, forward or backward, per rank."""
    tokens = context.tokens.astype(np.float64)
    model = context.model
    dtypes = runtime_dtypes(context.train)
    elementwise = block_elementwise_per_token(model, dtypes, backward=backward)
    activation_casts = block_activation_casts_per_token(model, dtypes, backward=backward)
    weight_casts = weight_casts_per_layer(dtypes, backward=backward)
    weight_cast_bytes = weight_casts.bytes * _cast_params(context, fractions, backward)
    return add_parts(
        bandwidth_parts(context, "elementwise_s", elementwise.bytes * tokens, elementwise.kernels),
        bandwidth_parts(
            context,
            "cast_s",
            activation_casts.bytes * tokens + weight_cast_bytes,
            activation_casts.kernels + weight_casts.kernels,
        ),
    )


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


def head_and_loss_parts(context: SimContext, fractions: Sequence[float]) -> Ledger:
    """Per micro-batch: the LM head's GEMMs and the loss kernels (both inside the chunked
    loss, `runtime/loss.py`: three GEMMs a chunk), the embedding and final norm's
    elementwise work, and the head weight's cast, per rank."""
    model, train = context.model, context.train
    tokens = context.tokens.astype(np.float64)
    element = train.compute_dtype_bytes
    head_matrix = float(model.vocab * model.hidden)
    dtypes = runtime_dtypes(train)
    head_flops, head_bytes, head_calls = head_gemm_work(model, dtypes, tokens)
    loss = loss_work(model, dtypes, tokens)
    head = head_elementwise_per_token(model, dtypes)
    # The loss copies an FP32 head weight to the compute dtype once and accumulates its
    # gradient in FP32 (no cast back); sharded, the weight comes gathered in the compute dtype.
    casts = (element + FP32) * head_matrix if dtypes.casts_weights else 0.0
    shares = np.asarray(fractions, dtype=np.float64)
    ledger = Ledger(context.layout.world_size)
    for parts in (
        gemm_parts(context, head_flops, head_bytes, head_calls),
        bandwidth_parts(context, "loss_s", loss.bytes, loss.kernels),
        bandwidth_parts(
            context,
            "elementwise_s",
            head.bytes * tokens + shares * embedding_gradient_bytes(model),
            head.kernels + 2,
        ),
        bandwidth_parts(context, "cast_s", np.full(len(tokens), casts), 1 if casts else 0),
    ):
        for key, seconds in parts.items():
            ledger.add(key, seconds)
    return ledger


def optimizer_parts(context: SimContext, fractions: Sequence[float]) -> Ledger:
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
    ledger = Ledger(context.layout.world_size)
    for key, seconds in bandwidth_parts(
        context, "optimizer_s", adam + accumulate, launches
    ).items():
        ledger.add(key, seconds)
    return ledger


def _parameter_tensors(model: ModelSpec) -> int:
    """Parameter tensors (one `.grad` accumulation kernel each): 7 matrices and 2 norms per
    block, the embedding, the final norm and an untied head."""
    return 9 * model.layers + 2 + (0 if model.tied_embeddings else 1)
