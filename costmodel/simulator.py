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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel._ring import ring_pass
from hexiseq.costmodel._state import BREAKDOWN_KEYS, Ledger, SimContext
from hexiseq.costmodel._traffic import (
    BF16,
    FP32,
    all_to_all_bytes,
)
from hexiseq.costmodel.base import CostModel
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
    """
    _check_compatible(cluster, model, layout)
    fractions = list(state_fractions or even_state_fractions(layout.world_size))
    context = _make_context(cluster, model, train, layout, cost)
    layer_ledger = Ledger(layout.world_size)
    forward_s = _simulate_layer(context, layer_ledger, backward=False)
    backward_s = _simulate_layer(context, layer_ledger, backward=True)
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


def _make_context(
    cluster: Cluster, model: ModelSpec, train: TrainSpec, layout: AttentionLayout, cost: CostModel
) -> SimContext:
    devices = cluster.devices
    group_of = np.array([layout.group_of(r) for r in range(layout.world_size)])
    return SimContext(
        cluster=cluster,
        model=model,
        train=train,
        layout=layout,
        cost=cost,
        gpus=[d.gpu for d in devices],
        nodes=[d.node for d in devices],
        slowdown=np.array([d.emulation_slowdown for d in devices]),
        group_of=group_of,
    )


def _simulate_layer(context: SimContext, ledger: Ledger, *, backward: bool) -> float:
    """One layer's forward, or its backward (recompute included), from an in-step start.

    Returns the layer's duration (its slowest rank) and books every rank's time in `ledger`.
    """
    world = context.layout.world_size
    start = np.zeros(world)
    if backward and context.train.activation_checkpointing:
        start = _forward_events(context, ledger, start)
    end = _backward_events(context, ledger, start) if backward else None
    if end is None:
        end = _forward_events(context, ledger, start)
    duration = float(np.max(end))
    ledger.add("idle_s", duration - end)
    return duration


def _forward_events(context: SimContext, ledger: Ledger, start: np.ndarray) -> np.ndarray:
    pre, post = _linear_times(context)
    t = _book(ledger, "linear_s", start, pre)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=True)
    t = ring_pass(context, ledger, t, backward=False)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=False)
    return _book(ledger, "linear_s", t, post)


def _backward_events(context: SimContext, ledger: Ledger, start: np.ndarray) -> np.ndarray:
    pre, post = _linear_times(context)
    t = _book(ledger, "linear_s", start, 2.0 * post)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=False)
    t = ring_pass(context, ledger, t, backward=True)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=True)
    return _book(ledger, "linear_s", t, 2.0 * pre)


def _book(ledger: Ledger, key: str, start: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    ledger.add(key, seconds)
    return start + seconds


def _linear_times(context: SimContext) -> tuple[np.ndarray, np.ndarray]:
    """Forward time of the parts before attention (norm, q/k/v, RoPE) and after it
    (output projection, residual, norm, SwiGLU MLP), per rank."""
    model, layout = context.model, context.layout
    tokens = np.array([layout.num_tokens(r) for r in range(layout.world_size)], dtype=np.float64)
    qkv_flops = 2.0 * model.hidden * model.head_dim * (model.heads + 2 * model.kv_heads)
    after_flops = 2.0 * model.hidden * (model.heads * model.head_dim + 3 * model.ffn_hidden)
    # Bytes read + written by the bandwidth-bound kernels, per token (BF16): RMSNorm (2x hidden
    # in and out), RoPE on q and k, residual add, second RMSNorm, SwiGLU (gate, up in; out).
    qkv_bytes = BF16 * (2 * model.hidden + 2 * (model.heads + model.kv_heads) * model.head_dim)
    after_bytes = BF16 * (3 * model.hidden + 2 * model.hidden + 3 * model.ffn_hidden)
    pre = np.empty(layout.world_size)
    post = np.empty(layout.world_size)
    for rank, gpu in enumerate(context.gpus):
        cost, n = context.cost, tokens[rank]
        pre[rank] = cost.gemm_time_s(gpu, qkv_flops * n) + cost.memory_bound_time_s(
            gpu, qkv_bytes * n
        )
        post[rank] = cost.gemm_time_s(gpu, after_flops * n) + cost.memory_bound_time_s(
            gpu, after_bytes * n
        )
    return pre * context.slowdown, post * context.slowdown


def _all_to_all(
    context: SimContext, ledger: Ledger, ready: np.ndarray, *, q_heads: bool, kv: bool
) -> np.ndarray:
    """An all-to-all inside every HP group: it starts when the group's last member is ready."""
    done = ready.copy()
    for members in context.layout.groups:
        index = list(members)
        sync = float(np.max(ready[index]))
        duration = _all_to_all_duration(context, members, q_heads=q_heads, kv=kv)
        ledger.add("idle_s", _scatter(context, index, sync - ready[index]))
        ledger.add("all_to_all_s", _scatter(context, index, duration))
        done[index] = sync + duration
    return done


def _scatter(context: SimContext, index: list[int], values: np.ndarray | float) -> np.ndarray:
    full = np.zeros(context.layout.world_size)
    full[index] = values
    return full


def _all_to_all_duration(
    context: SimContext, members: tuple[int, ...], *, q_heads: bool, kv: bool
) -> float:
    """Slowest member's send or receive time; same-node and cross-node traffic use their links."""
    if len(members) == 1:
        return 0.0
    matrix = all_to_all_bytes(
        context.layout, members, context.model.head_dim, q_heads=q_heads, kv=kv
    )
    longest = 0.0
    for i, rank in enumerate(members):
        for direction in (matrix[i, :], matrix[:, i]):
            longest = max(longest, _fan_time(context, rank, members, direction))
    return longest


def _fan_time(
    context: SimContext, rank: int, members: tuple[int, ...], bytes_by_member: np.ndarray
) -> float:
    """Time for one rank to send (or receive) its share to every other member of its group."""
    node = context.nodes[rank]
    local = sum(b for m, b in zip(members, bytes_by_member) if context.nodes[m] == node)
    remote = [(m, b) for m, b in zip(members, bytes_by_member) if context.nodes[m] != node]
    cluster, cost = context.cluster, context.cost
    time_s = cost.transfer_time_s(
        local, cluster.link_GBps(node, node), cluster.link_latency_s(node, node)
    )
    if remote:
        slowest = min(cluster.link_GBps(node, context.nodes[m]) for m, _ in remote)
        latency = cluster.link_latency_s(node, context.nodes[remote[0][0]])
        time_s = max(time_s, cost.transfer_time_s(sum(b for _, b in remote), slowest, latency))
    return time_s


def _add_sharding_exposure(
    context: SimContext,
    ledger: Ledger,
    fractions: list[float],
    forward_s: float,
    backward_s: float,
) -> None:
    """FSDP gathers each layer's BF16 weights (forward, and again for recompute + backward) and
    reduce-scatters its BF16 gradients; these overlap the neighbouring layer's compute."""
    layer_bytes = context.model.params_per_layer * BF16
    gather_s = _domain_collective_time(context, layer_bytes, fractions)
    forward_exposed = max(0.0, gather_s - forward_s)
    backward_exposed = max(0.0, 2.0 * gather_s - backward_s)
    ledger.add("sharding_exposed_comm_s", forward_exposed + backward_exposed)


def _domain_collective_time(
    context: SimContext, total_bytes: float, fractions: list[float]
) -> float:
    """All-gather (or reduce-scatter) of `total_bytes` sharded by `fractions` over all ranks:
    each rank receives what it does not own; cross-node traffic goes through its NIC."""
    cluster, cost = context.cluster, context.cost
    if len(cluster.nodes) == 1:
        node = cluster.nodes[0].name
        bandwidth, latency = cluster.link_GBps(node, node), cluster.link_latency_s(node, node)
    else:
        names = [n.name for n in cluster.nodes]
        bandwidth = min(cluster.link_GBps(a, b) for a in names for b in names if a != b)
        latency = cluster.link_latency_s(names[0], names[1])
    largest_missing = max(1.0 - f for f in fractions) * total_bytes
    return cost.transfer_time_s(largest_missing, bandwidth, latency)


def _head_and_loss(context: SimContext) -> Ledger:
    """The LM head's matmul forward + backward (no recompute) and the loss, per rank."""
    model, layout = context.model, context.layout
    ledger = Ledger(layout.world_size)
    flops = head_flops_per_token(model)
    seconds = np.zeros(layout.world_size)
    for rank, gpu in enumerate(context.gpus):
        tokens = layout.num_tokens(rank)
        seconds[rank] = 3.0 * context.cost.gemm_time_s(gpu, flops * tokens)
        seconds[rank] += context.cost.memory_bound_time_s(gpu, 3 * tokens * model.vocab * FP32)
    ledger.add("linear_s", seconds * context.slowdown)
    return ledger


def _optimizer(context: SimContext, fractions: list[float]) -> Ledger:
    """Adam on each rank's shard of the parameters (bandwidth-bound)."""
    ledger = Ledger(context.layout.world_size)
    seconds = np.array(
        [
            context.cost.memory_bound_time_s(
                gpu, fractions[r] * context.model.params * ADAM_BYTES_PER_PARAM
            )
            for r, gpu in enumerate(context.gpus)
        ]
    )
    ledger.add("linear_s", seconds * context.slowdown)
    return ledger


def _prediction(
    context: SimContext, ledger: Ledger, step_time_s: float, fractions: list[float]
) -> StepPrediction:
    memory = estimate_memory(
        context.cluster, context.model, context.train, context.layout, fractions
    )
    capacity = tuple(context.cluster.gpu(r).memory_bytes for r in range(context.layout.world_size))
    rank_times = tuple(
        RankTime(**{key: float(ledger.parts[key][r]) for key in BREAKDOWN_KEYS})
        for r in range(context.layout.world_size)
    )
    labels = {gpu: context.cost.label(gpu) for gpu in dict.fromkeys(context.gpus)}
    tokens = context.train.tokens_per_step
    return StepPrediction(
        step_time_s, tokens / step_time_s, rank_times, tuple(memory), capacity, labels
    )
