"""Event-level step simulator (DESIGN.md §7).

One training step = per micro-batch, every layer's forward and backward (with the recomputed
forward under activation checkpointing), the LM head and loss, then the optimizer step.
Inside a layer each rank's events are simulated in order:

    linear (norm, q/k/v) → all-to-all into head form (waits for its whole group)
    → G ring steps: compute on the block in hand while the next block travels from the
      previous group over the real link between the two ranks; a step starts when the block
      has arrived and the previous step is done (backward: dK/dV travel with their blocks and
      a step ends when the partial dK/dV of its block has arrived to be added to)
    → all-to-all back → linear (output projection, SwiGLU MLP).

The FSDP all-gather/reduce-scatter of the next layer's weights is a collective of the whole
domain, so every layer starts in step on all ranks; it overlaps the layer's compute and only
its excess is exposed. A layer therefore takes as long as its slowest rank, and the step is
layers x (forward + backward layer) + head + optimizer.

The plan search simulates many candidates on up to 1024 ranks and 1024 ring steps, so every
event is computed for all ranks at once: what depends on the plan only (linear, all-to-all
and per-step ring times) is tabulated once with one cost-model call per GPU type, and only the
ring steps, which wait on each other, run as a loop (benchmarks/simulator_speed.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hexiseq.catalog import gpu_spec
from hexiseq.cluster import Cluster
from hexiseq.costmodel._all_to_all import all_to_all, all_to_all_durations
from hexiseq.costmodel._ring import RingTables, build_ring_tables, ring_pass
from hexiseq.costmodel._state import (
    BREAKDOWN_KEYS,
    Ledger,
    SimContext,
    make_context,
    per_gpu_type,
)
from hexiseq.costmodel._traffic import FP32
from hexiseq.costmodel.base import CostModel, memory_calibrations
from hexiseq.costmodel.memory import MemoryBreakdown, estimate_memory, even_state_fractions
from hexiseq.flops import head_flops_per_token
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.plan import RankTime

ADAM_BYTES_PER_PARAM = 32  # reads FP32 param, grad, m, v; writes param, m, v and a BF16 copy


@dataclass(frozen=True)
class StepPrediction:
    """Predicted step time, throughput, per-rank time breakdown and memory."""

    step_time_s: float
    tokens_per_s: float
    rank_times: tuple[RankTime, ...]
    memory: tuple[MemoryBreakdown, ...]
    memory_capacity_bytes: tuple[int, ...]
    cost_model_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _LayerTables:
    """What every layer's events reuse: per-rank linear times, per-group all-to-all times and
    the ring tables (all depend on the plan only, not on when an event starts)."""

    before_attention_s: np.ndarray  # [rank] forward norm, q/k/v, RoPE
    after_attention_s: np.ndarray  # [rank] forward output projection, norm, MLP
    all_to_all_qkv_s: np.ndarray  # [group] q and K/V into head form (dq/dK/dV back)
    all_to_all_q_s: np.ndarray  # [group] the query-head part only (output, or dO)
    ring: RingTables


def simulate_step(
    cluster: Cluster,
    model: ModelSpec,
    train: TrainSpec,
    layout: AttentionLayout,
    cost: CostModel,
    state_fractions: Sequence[float] | None = None,
) -> StepPrediction:
    """Predict one training step of `layout` on `cluster` under `cost`.

    `state_fractions` is each rank's share of the sharded model states (even when None).
    Raises ValueError when the layout does not fit the cluster or the model.
    """
    _check_compatible(cluster, model, layout)
    fractions = list(state_fractions or even_state_fractions(layout.world_size))
    context = make_context(cluster, model, train, layout, cost)
    tables = _layer_tables(context)
    layer_ledger = Ledger(layout.world_size)
    forward_s = _simulate_layer(context, tables, layer_ledger, backward=False)
    backward_s = _simulate_layer(context, tables, layer_ledger, backward=True)
    _add_sharding_exposure(context, layer_ledger, fractions, forward_s, backward_s)
    ledger = layer_ledger.scaled(model.layers)
    ledger.merge(_head_and_loss(context))
    ledger = ledger.scaled(train.micro_batches)
    ledger.merge(_optimizer(context, fractions))
    step_time_s = float(np.max(ledger.total()))
    ledger.add("idle_s", step_time_s - ledger.total())
    return _prediction(context, ledger, step_time_s, fractions)


def _check_compatible(cluster: Cluster, model: ModelSpec, layout: AttentionLayout) -> None:
    if layout.world_size != cluster.world_size:
        raise ValueError(
            f"layout has {layout.world_size} ranks but cluster {cluster.name} has "
            f"{cluster.world_size} devices"
        )
    if (layout.num_heads, layout.num_kv_heads) != (model.heads, model.kv_heads):
        raise ValueError(
            f"layout has {layout.num_heads} heads / {layout.num_kv_heads} KV heads but model "
            f"{model.name} has {model.heads} / {model.kv_heads}"
        )


def _layer_tables(context: SimContext) -> _LayerTables:
    """Everything a layer's events take from the plan alone, computed once per step."""
    before_s, after_s = _linear_times(context)
    return _LayerTables(
        before_attention_s=before_s,
        after_attention_s=after_s,
        all_to_all_qkv_s=all_to_all_durations(context, q_heads=True, kv=True),
        all_to_all_q_s=all_to_all_durations(context, q_heads=True, kv=False),
        ring=build_ring_tables(context),
    )


def _simulate_layer(
    context: SimContext, tables: _LayerTables, ledger: Ledger, *, backward: bool
) -> float:
    """One layer's forward, or its backward (recompute included), from an in-step start.

    Returns the layer's duration (its slowest rank) and books every rank's time in `ledger`.
    """
    start = np.zeros(context.layout.world_size)
    if backward and context.train.activation_checkpointing:
        start = _forward_events(context, tables, ledger, start)
    if backward:
        end = _backward_events(context, tables, ledger, start)
    else:
        end = _forward_events(context, tables, ledger, start)
    duration = float(np.max(end))
    ledger.add("idle_s", duration - end)
    return duration


def _forward_events(
    context: SimContext, tables: _LayerTables, ledger: Ledger, start: np.ndarray
) -> np.ndarray:
    t = _book(ledger, "linear_s", start, tables.before_attention_s)
    t = all_to_all(context, ledger, t, tables.all_to_all_qkv_s)
    t = ring_pass(tables.ring, ledger, t, backward=False)
    t = all_to_all(context, ledger, t, tables.all_to_all_q_s)
    return _book(ledger, "linear_s", t, tables.after_attention_s)


def _backward_events(
    context: SimContext, tables: _LayerTables, ledger: Ledger, start: np.ndarray
) -> np.ndarray:
    t = _book(ledger, "linear_s", start, 2.0 * tables.after_attention_s)
    t = all_to_all(context, ledger, t, tables.all_to_all_q_s)
    t = ring_pass(tables.ring, ledger, t, backward=True)
    t = all_to_all(context, ledger, t, tables.all_to_all_qkv_s)
    return _book(ledger, "linear_s", t, 2.0 * tables.before_attention_s)


def _book(ledger: Ledger, key: str, start: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    ledger.add(key, seconds)
    return start + seconds


def _linear_times(context: SimContext) -> tuple[np.ndarray, np.ndarray]:
    """Forward time of the parts before attention (norm, q/k/v, RoPE) and after it
    (output projection, residual, norm, SwiGLU MLP), per rank."""
    model, cost = context.model, context.cost
    tokens = context.tokens.astype(np.float64)
    qkv_flops = 2.0 * model.hidden * model.head_dim * (model.heads + 2 * model.kv_heads)
    after_flops = 2.0 * model.hidden * (model.heads * model.head_dim + 3 * model.ffn_hidden)
    # The GEMMs as (k, n) of [tokens, k] @ [k, n], as runtime/model.py runs them: q, k and v
    # projections; output projection, SwiGLU gate, up and down.
    hidden = model.hidden
    q_width, kv_width = model.heads * model.head_dim, model.kv_heads * model.head_dim
    qkv_gemms = ((hidden, q_width), (hidden, kv_width), (hidden, kv_width))
    after_gemms = (
        (q_width, hidden),
        (hidden, model.ffn_hidden),
        (hidden, model.ffn_hidden),
        (model.ffn_hidden, hidden),
    )
    # Bytes read + written by the bandwidth-bound kernels, per token (compute dtype): RMSNorm
    # (2x hidden in and out), RoPE on q and k, residual add, second RMSNorm, SwiGLU (gate, up
    # in; out).
    element = context.train.compute_dtype_bytes
    qkv_bytes = element * (2 * model.hidden + 2 * (model.heads + model.kv_heads) * model.head_dim)
    after_bytes = element * (3 * model.hidden + 2 * model.hidden + 3 * model.ffn_hidden)

    def pre(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        n = tokens[ranks]
        gemm_bytes = _gemm_operand_bytes(n, qkv_gemms, element)
        return cost.gemm_time_s(
            gpu, qkv_flops * n, bytes_moved=gemm_bytes, calls=len(qkv_gemms)
        ) + cost.memory_bound_time_s(gpu, qkv_bytes * n, calls=3)  # norm, RoPE q, RoPE k

    def post(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        n = tokens[ranks]
        gemm_bytes = _gemm_operand_bytes(n, after_gemms, element)
        return cost.gemm_time_s(
            gpu, after_flops * n, bytes_moved=gemm_bytes, calls=len(after_gemms)
        ) + cost.memory_bound_time_s(gpu, after_bytes * n, calls=3)  # residual, norm, SwiGLU

    return per_gpu_type(context, pre), per_gpu_type(context, post)


def _gemm_operand_bytes(
    tokens: np.ndarray, shapes: Sequence[tuple[int, int]], element_bytes: int
) -> np.ndarray:
    """Bytes read and written by the GEMMs [tokens, k] @ [k, n], one per (k, n) of `shapes`:
    (m·k + k·n + m·n) elements of the compute dtype each, m = tokens."""
    return element_bytes * sum(tokens * k + k * n + tokens * n for k, n in shapes)


def _add_sharding_exposure(
    context: SimContext,
    ledger: Ledger,
    fractions: list[float],
    forward_s: float,
    backward_s: float,
) -> None:
    """FSDP gathers each layer's weights in the compute dtype (forward, and again for recompute
    + backward) and reduce-scatters its gradients; these overlap the neighbouring layer's
    compute."""
    layer_bytes = context.model.params_per_layer * context.train.compute_dtype_bytes
    gather_s = _domain_collective_time(context, layer_bytes, fractions)
    forward_exposed = max(0.0, gather_s - forward_s)
    backward_exposed = max(0.0, 2.0 * gather_s - backward_s)
    ledger.add("sharding_exposed_comm_s", forward_exposed + backward_exposed)


def _domain_collective_time(
    context: SimContext, total_bytes: float, fractions: list[float]
) -> float:
    """All-gather (or reduce-scatter) of `total_bytes` sharded by `fractions` over all ranks:
    each rank receives what it does not own; cross-node traffic goes through its NIC."""
    bandwidth, latency = context.bandwidth_GBps, context.latency_s
    if len(bandwidth) == 1:
        slowest_GBps, latency_s = bandwidth[0, 0], latency[0, 0]
    else:
        off_diagonal = ~np.eye(len(bandwidth), dtype=bool)
        slowest_GBps, latency_s = bandwidth[off_diagonal].min(), latency[0, 1]
    largest_missing = max(1.0 - f for f in fractions) * total_bytes
    return float(context.cost.transfer_time_s(largest_missing, slowest_GBps, latency_s))


def _head_and_loss(context: SimContext) -> Ledger:
    """The LM head's matmul forward + backward (no recompute) and the loss, per rank."""
    model, cost = context.model, context.cost
    flops = head_flops_per_token(model)

    def seconds_of(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        tokens = context.tokens[ranks]
        logits_bytes = 3 * tokens * model.vocab * FP32
        # Forward, input gradient and weight gradient: three GEMMs of the same size and bytes.
        gemm_bytes = _gemm_operand_bytes(
            tokens, ((model.hidden, model.vocab),), context.train.compute_dtype_bytes
        )
        return 3.0 * cost.gemm_time_s(
            gpu, flops * tokens, bytes_moved=gemm_bytes, calls=1
        ) + cost.memory_bound_time_s(gpu, logits_bytes, calls=3)  # logits written, read twice

    ledger = Ledger(context.layout.world_size)
    ledger.add("linear_s", per_gpu_type(context, seconds_of))
    return ledger


def _optimizer(context: SimContext, fractions: list[float]) -> Ledger:
    """Adam on each rank's shard of the parameters (bandwidth-bound)."""
    shares = np.asarray(fractions, dtype=np.float64)
    params = context.model.params

    def seconds_of(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
        return context.cost.memory_bound_time_s(gpu, shares[ranks] * params * ADAM_BYTES_PER_PARAM)

    ledger = Ledger(context.layout.world_size)
    ledger.add("linear_s", per_gpu_type(context, seconds_of))
    return ledger


def _prediction(
    context: SimContext, ledger: Ledger, step_time_s: float, fractions: list[float]
) -> StepPrediction:
    calibrations = memory_calibrations(context.cost, context.gpus)
    memory = estimate_memory(
        context.cluster, context.model, context.train, context.layout, fractions, calibrations
    )
    capacity = tuple(gpu_spec(gpu).memory_bytes for gpu in context.gpus)
    columns = [ledger.parts[key].tolist() for key in BREAKDOWN_KEYS]
    rank_times = tuple(RankTime(**dict(zip(BREAKDOWN_KEYS, parts))) for parts in zip(*columns))
    labels = {gpu: context.cost.label(gpu) for gpu in context.ranks_by_gpu}
    tokens = context.train.tokens_per_step
    return StepPrediction(
        step_time_s, tokens / step_time_s, rank_times, tuple(memory), capacity, labels
    )
