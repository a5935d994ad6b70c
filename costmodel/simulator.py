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
from dataclasses import asdict, dataclass, field

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel._traffic import (
    BF16,
    FP32,
    all_to_all_bytes,
    ring_hops,
    sender_kv_heads_out,
)
from hexiseq.costmodel.base import CostModel
from hexiseq.costmodel.memory import MemoryBreakdown, estimate_memory, even_state_fractions
from hexiseq.flops import head_flops_per_token
from hexiseq.layout import AttentionLayout, causal_pair_count
from hexiseq.model import ModelSpec, TrainSpec

ADAM_BYTES_PER_PARAM = 32  # reads FP32 param, grad, m, v; writes param, m, v and a BF16 copy
BREAKDOWN_KEYS = (
    "linear_s",
    "attention_s",
    "all_to_all_s",
    "ring_exposed_comm_s",
    "sharding_exposed_comm_s",
    "idle_s",
)


@dataclass(frozen=True, slots=True)
class RankTime:
    """Where one rank's step time goes, in seconds; the six parts add up to the step time."""

    linear_s: float
    attention_s: float
    all_to_all_s: float
    ring_exposed_comm_s: float
    sharding_exposed_comm_s: float
    idle_s: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class StepPrediction:
    """Predicted step time, throughput, per-rank time breakdown and memory."""

    step_time_s: float
    tokens_per_s: float
    rank_times: tuple[RankTime, ...]
    memory: tuple[MemoryBreakdown, ...]
    memory_capacity_bytes: tuple[int, ...]
    cost_model_labels: dict[str, str] = field(default_factory=dict)


@dataclass
class _Context:
    """Per-plan constants the layer simulation reads (arrays indexed by rank)."""

    cluster: Cluster
    model: ModelSpec
    train: TrainSpec
    layout: AttentionLayout
    cost: CostModel
    gpus: list[str]
    nodes: list[str]
    slowdown: np.ndarray
    group_of: np.ndarray


class _Ledger:
    """Per-rank accumulators of the breakdown categories."""

    def __init__(self, world_size: int) -> None:
        self.parts = {key: np.zeros(world_size) for key in BREAKDOWN_KEYS}

    def add(self, key: str, seconds: np.ndarray | float) -> None:
        self.parts[key] = self.parts[key] + seconds

    def scaled(self, factor: float) -> _Ledger:
        copy = _Ledger(len(self.parts["linear_s"]))
        copy.parts = {key: value * factor for key, value in self.parts.items()}
        return copy

    def merge(self, other: _Ledger) -> None:
        for key, value in other.parts.items():
            self.parts[key] = self.parts[key] + value


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
    layer_ledger = _Ledger(layout.world_size)
    forward_s = _simulate_layer(context, layer_ledger, backward=False)
    backward_s = _simulate_layer(context, layer_ledger, backward=True)
    _add_sharding_exposure(context, layer_ledger, fractions, forward_s, backward_s)
    ledger = layer_ledger.scaled(model.layers)
    ledger.merge(_head_and_loss(context))
    per_micro_batch = _ledger_total(ledger)
    ledger = ledger.scaled(train.micro_batches)
    ledger.merge(_optimizer(context, fractions))
    step_time_s = float(np.max(_ledger_total(ledger)))
    ledger.add("idle_s", step_time_s - _ledger_total(ledger))
    del per_micro_batch
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
) -> _Context:
    devices = cluster.devices
    group_of = np.array([layout.group_of(r) for r in range(layout.world_size)])
    return _Context(
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


def _simulate_layer(context: _Context, ledger: _Ledger, *, backward: bool) -> float:
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


def _forward_events(context: _Context, ledger: _Ledger, start: np.ndarray) -> np.ndarray:
    pre, post = _linear_times(context)
    t = _book(ledger, "linear_s", start, pre)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=True)
    t = _ring_pass(context, ledger, t, backward=False)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=False)
    return _book(ledger, "linear_s", t, post)


def _backward_events(context: _Context, ledger: _Ledger, start: np.ndarray) -> np.ndarray:
    pre, post = _linear_times(context)
    t = _book(ledger, "linear_s", start, 2.0 * post)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=False)
    t = _ring_pass(context, ledger, t, backward=True)
    t = _all_to_all(context, ledger, t, q_heads=True, kv=True)
    return _book(ledger, "linear_s", t, 2.0 * pre)


def _book(ledger: _Ledger, key: str, start: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    ledger.add(key, seconds)
    return start + seconds


def _linear_times(context: _Context) -> tuple[np.ndarray, np.ndarray]:
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
    context: _Context, ledger: _Ledger, ready: np.ndarray, *, q_heads: bool, kv: bool
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


def _scatter(context: _Context, index: list[int], values: np.ndarray | float) -> np.ndarray:
    full = np.zeros(context.layout.world_size)
    full[index] = values
    return full


def _all_to_all_duration(
    context: _Context, members: tuple[int, ...], *, q_heads: bool, kv: bool
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
    context: _Context, rank: int, members: tuple[int, ...], bytes_by_member: np.ndarray
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


def _ring_pass(
    context: _Context, ledger: _Ledger, ring_start: np.ndarray, *, backward: bool
) -> np.ndarray:
    """All ring steps of one attention pass; returns each rank's finish time."""
    layout = context.layout
    group_count = len(layout.groups)
    compute = _ring_compute(context, backward=backward)  # [step, rank]
    ledger.add("attention_s", compute.sum(axis=0))
    start, end = ring_start.copy(), ring_start + compute[0]
    if group_count > 1:
        hops = ring_hops(layout)
        kv_time, dkv_time = _ring_transfer_times(context, hops)
        for step in range(1, group_count):
            start, end = _ring_step(
                context,
                hops,
                step,
                start,
                end,
                compute[step],
                kv_time[step],
                dkv_time[step] if backward else None,
            )
        if backward:
            end = _return_gradients(context, hops, end, dkv_time[0])
    ledger.add("ring_exposed_comm_s", end - ring_start - compute.sum(axis=0))
    return end


def _ring_step(
    context: _Context,
    hops: dict,
    step: int,
    prev_start: np.ndarray,
    prev_end: np.ndarray,
    compute: np.ndarray,
    kv_time: np.ndarray,
    dkv_time: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Step `step`: the block was posted when sender and receiver began the previous step."""
    world = context.layout.world_size
    start, end = np.empty(world), np.empty(world)
    for rank in range(world):
        senders = list(hops[rank].senders)
        posted = max(prev_start[rank], float(np.max(prev_start[senders])))
        start[rank] = max(prev_end[rank], posted + kv_time[rank])
        end[rank] = start[rank] + compute[rank]
        if dkv_time is not None:  # partial dK/dV leave the sender only when its step is done
            end[rank] = max(end[rank], float(np.max(prev_end[senders])) + dkv_time[rank])
    return start, end


def _return_gradients(
    context: _Context, hops: dict, end: np.ndarray, dkv_time: np.ndarray
) -> np.ndarray:
    """After the last step each block's dK/dV make one more hop, back to their owner group."""
    done = end.copy()
    for rank in range(context.layout.world_size):
        senders = list(hops[rank].senders)
        done[rank] = max(end[rank], float(np.max(end[senders])) + dkv_time[rank])
    return done


def _ring_compute(context: _Context, *, backward: bool) -> np.ndarray:
    """Attention time of every rank at every ring step: its heads, its group's queries and the
    causal (query, key) pairs against the block of the group `step` places back."""
    layout, model = context.layout, context.model
    group_count = len(layout.groups)
    segments = [layout.segment(g) for g in range(group_count)]
    compute = np.zeros((group_count, layout.world_size))
    for step in range(group_count):
        for rank, gpu in enumerate(context.gpus):
            group = int(context.group_of[rank])
            origin = (group - step) % group_count
            pairs = causal_pair_count(segments[group], segments[origin])
            heads = layout.num_heads_of(rank)
            seconds = context.cost.attention_time_s(
                gpu, pairs, heads, model.head_dim, backward=backward
            )
            compute[step, rank] = seconds * context.slowdown[rank]
    return compute


def _ring_transfer_times(context: _Context, hops: dict) -> tuple[np.ndarray, np.ndarray]:
    """[origin-offset step, rank] transfer time of the K/V block (BF16) and of its dK/dV (FP32)
    arriving at each rank; index 0 is the final return hop of the backward pass."""
    layout, model = context.layout, context.model
    group_count = len(layout.groups)
    lengths = [layout.segment_length(g) for g in range(group_count)]
    heads_out = sender_kv_heads_out(layout, hops)
    kv_time = np.zeros((group_count, layout.world_size))
    dkv_time = np.zeros((group_count, layout.world_size))
    for step in range(group_count):
        for rank in range(layout.world_size):
            origin = (int(context.group_of[rank]) - step) % group_count
            for table, element in ((kv_time, BF16), (dkv_time, FP32)):
                per_head = lengths[origin] * 2 * model.head_dim * element
                table[step, rank] = _hop_time(context, hops[rank], rank, heads_out, per_head)
    return kv_time, dkv_time


def _hop_time(context: _Context, hop, rank: int, heads_out: np.ndarray, per_head: float) -> float:
    """Receiving `hop.kv_heads_in` heads while each sender sends all its outgoing heads."""
    cluster, cost = context.cluster, context.cost
    slowest = 0.0
    for sender in hop.senders:
        node_a, node_b = context.nodes[sender], context.nodes[rank]
        bytes_moved = max(hop.kv_heads_in, heads_out[sender]) * per_head
        seconds = cost.transfer_time_s(
            bytes_moved, cluster.link_GBps(node_a, node_b), cluster.link_latency_s(node_a, node_b)
        )
        slowest = max(slowest, seconds)
    return slowest


def _add_sharding_exposure(
    context: _Context,
    ledger: _Ledger,
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
    context: _Context, total_bytes: float, fractions: list[float]
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


def _head_and_loss(context: _Context) -> _Ledger:
    """The LM head's matmul forward + backward (no recompute) and the loss, per rank."""
    model, layout = context.model, context.layout
    ledger = _Ledger(layout.world_size)
    flops = head_flops_per_token(model)
    seconds = np.zeros(layout.world_size)
    for rank, gpu in enumerate(context.gpus):
        tokens = layout.num_tokens(rank)
        seconds[rank] = 3.0 * context.cost.gemm_time_s(gpu, flops * tokens)
        seconds[rank] += context.cost.memory_bound_time_s(gpu, 3 * tokens * model.vocab * FP32)
    ledger.add("linear_s", seconds * context.slowdown)
    return ledger


def _optimizer(context: _Context, fractions: list[float]) -> _Ledger:
    """Adam on each rank's shard of the parameters (bandwidth-bound)."""
    ledger = _Ledger(context.layout.world_size)
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


def _ledger_total(ledger: _Ledger) -> np.ndarray:
    return sum(ledger.parts.values())


def _prediction(
    context: _Context, ledger: _Ledger, step_time_s: float, fractions: list[float]
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
