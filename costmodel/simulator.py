"""Event-level step simulator (docs/design.md §7).

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

Besides GEMMs, attention and communication, each rank's time holds what the torch runtime
really runs between them (`_runtime_work`, `_step_parts`): the block's elementwise kernels
(norms, RoPE, SwiGLU, residual adds, attention's transposes and online-softmax merge) and
autocast's casts, the loss kernels, AdamW, and the launch overhead of many short kernels.

The plan search simulates many candidates on up to 1024 ranks and 1024 ring steps, so every
event is computed for all ranks at once: what depends on the plan only (linear, all-to-all
and per-step ring times) is tabulated once with one cost-model call per GPU type, and only the
ring steps, which wait on each other, run as a loop (benchmarks/simulator_speed.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel._all_to_all import all_to_all, all_to_all_durations
from hexiseq.costmodel._ring import RingTables, build_ring_tables, ring_pass
from hexiseq.costmodel._state import (
    BREAKDOWN_KEYS,
    LAYOUT_TABLES,
    Ledger,
    SimContext,
    make_context,
    pinned,
)
from hexiseq.costmodel._step_parts import (
    BandwidthParts,
    Gemms,
    Parts,
    bandwidth_bound_parts,
    head_and_loss_parts,
    head_gemms,
    optimizer_parts,
    priced_gemms,
)
from hexiseq.costmodel.base import CostModel, memory_calibrations
from hexiseq.costmodel.memory import MemoryBreakdown, estimate_memory, even_state_fractions
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.plan import RankTime


@dataclass(frozen=True)
class StepPrediction:
    """Predicted step time, throughput, per-rank time breakdown and memory."""

    step_time_s: float
    tokens_per_s: float
    seconds_by_part: dict[str, tuple[float, ...]] = field(repr=False)
    """Breakdown key (`RankTime`'s fields) -> [rank] seconds."""
    memory: tuple[MemoryBreakdown, ...]
    memory_capacity_bytes: tuple[int, ...]
    cost_model_labels: dict[str, str] = field(default_factory=dict)

    @cached_property
    def rank_times(self) -> tuple[RankTime, ...]:
        """Each rank's `RankTime`, made on first use: a search reads most of its predictions
        through `seconds_by_part` alone, and a frozen dataclass a rank costs about 2 us."""
        columns = [self.seconds_by_part[key] for key in BREAKDOWN_KEYS]
        return tuple(RankTime(**dict(zip(BREAKDOWN_KEYS, parts))) for parts in zip(*columns))


@dataclass(frozen=True)
class _LayerTables:
    """What every layer's events reuse: per-rank linear and bandwidth-bound times, per-group
    all-to-all times and the ring tables (all depend on the plan only, not on when an event
    starts). Parts are breakdown key -> [rank] seconds."""

    before_attention: Parts  # forward q/k/v GEMMs (and their launch overhead)
    after_attention: Parts  # forward output projection and SwiGLU GEMMs
    forward_bandwidth: Parts  # forward elementwise kernels and casts of the block
    backward_bandwidth: Parts  # their backward
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
    *,
    shared: dict | None = None,
) -> StepPrediction:
    """Predict one training step of `layout` on `cluster` under `cost`.

    `state_fractions` is each rank's share of the sharded model states (even when None).
    `shared` is a dict the caller keeps to reuse, between simulations of layouts with the
    same groups and heads, the tables that depend on nothing else (who sends which K/V
    heads to whom on the ring): a search passes one per search.
    Raises ValueError when the layout does not fit the cluster or the model.
    """
    _check_compatible(cluster, model, layout)
    fractions = list(state_fractions or even_state_fractions(layout.world_size))
    context = make_context(cluster, model, train, layout, cost, shared)
    bandwidth = bandwidth_bound_parts(context, fractions)
    before, after, head = priced_gemms(context, [*_linear_gemms(context), head_gemms(context)])
    tables = _layer_tables(context, before, after, bandwidth)
    layer_ledger = Ledger(layout.world_size)
    forward = _ForwardEvents(context, tables)
    forward_s = _simulate_layer(context, tables, layer_ledger, forward, backward=False)
    backward_s = _simulate_layer(context, tables, layer_ledger, forward, backward=True)
    _add_sharding_exposure(context, layer_ledger, fractions, forward_s, backward_s)
    ledger = layer_ledger.scaled(model.layers)
    ledger.merge(head_and_loss_parts(context, head, bandwidth))
    ledger = ledger.scaled(train.micro_batches)
    ledger.merge(optimizer_parts(context, bandwidth))
    step_time_s = float(np.max(ledger.total()))
    ledger.add("idle_s", step_time_s - ledger.total())
    return _prediction(context, ledger, step_time_s, fractions)


def shared_tables(by_layout: bool = False) -> dict:
    """A fresh dict for `simulate_step(..., shared=)`; with `by_layout`, it also keeps the
    tables that depend on the whole layout, for simulations of the same layouts on other
    clusters of the same shape."""
    return {LAYOUT_TABLES: {}} if by_layout else {}


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


def _layer_tables(
    context: SimContext, before: Parts, after: Parts, bandwidth: BandwidthParts
) -> _LayerTables:
    """Everything a layer's events take from the plan alone, computed once per step."""
    qkv_s, q_s = all_to_all_durations(context)
    return _LayerTables(
        before_attention=before,
        after_attention=after,
        forward_bandwidth=bandwidth.forward,
        backward_bandwidth=bandwidth.backward,
        all_to_all_qkv_s=qkv_s,
        all_to_all_q_s=q_s,
        ring=build_ring_tables(context),
    )


class _ForwardEvents:
    """A layer's forward events from an in-step start: the same events for the forward pass
    and for the recompute ahead of the backward (activation checkpointing), so they are
    simulated once and their bookings replayed, in order, for the recompute."""

    def __init__(self, context: SimContext, tables: _LayerTables) -> None:
        self.bookings: list[tuple[str, np.ndarray]] = []
        start = np.zeros(context.layout.world_size)
        self.end = _forward_events(context, tables, _Recorder(self.bookings), start)

    def book(self, ledger: Ledger) -> np.ndarray:
        """Book the events in `ledger`; returns each rank's end."""
        for key, seconds in self.bookings:
            ledger.add(key, seconds)
        return self.end


class _Recorder:
    """A ledger that only keeps what is booked in it, in order."""

    def __init__(self, bookings: list[tuple[str, np.ndarray]]) -> None:
        self.bookings = bookings

    def add(self, key: str, seconds: np.ndarray | float) -> None:
        self.bookings.append((key, seconds))


def _simulate_layer(
    context: SimContext,
    tables: _LayerTables,
    ledger: Ledger,
    forward: _ForwardEvents,
    *,
    backward: bool,
) -> float:
    """One layer's forward, or its backward (recompute included), from an in-step start.

    Returns the layer's duration (its slowest rank) and books every rank's time in `ledger`.
    """
    if backward:
        start = np.zeros(context.layout.world_size)
        if context.train.activation_checkpointing:
            start = forward.book(ledger)
        end = _backward_events(context, tables, ledger, start)
    else:
        end = forward.book(ledger)
    duration = float(np.max(end))
    ledger.add("idle_s", duration - end)
    return duration


def _forward_events(
    context: SimContext, tables: _LayerTables, ledger: Ledger, start: np.ndarray
) -> np.ndarray:
    # The block's elementwise kernels and casts are booked as one piece ahead of its GEMMs:
    # the order inside a rank does not change its time, only when it joins the all-to-all.
    t = _book(ledger, start, tables.forward_bandwidth)
    t = _book(ledger, t, tables.before_attention)
    t = all_to_all(context, ledger, t, tables.all_to_all_qkv_s)
    t = ring_pass(tables.ring, ledger, t, backward=False)
    t = all_to_all(context, ledger, t, tables.all_to_all_q_s)
    return _book(ledger, t, tables.after_attention)


def _backward_events(
    context: SimContext, tables: _LayerTables, ledger: Ledger, start: np.ndarray
) -> np.ndarray:
    t = _book(ledger, start, tables.backward_bandwidth)
    t = _book(ledger, t, tables.after_attention, factor=2.0)
    t = all_to_all(context, ledger, t, tables.all_to_all_q_s)
    t = ring_pass(tables.ring, ledger, t, backward=True)
    t = all_to_all(context, ledger, t, tables.all_to_all_qkv_s)
    return _book(ledger, t, tables.before_attention, factor=2.0)


def _book(ledger: Ledger, start: np.ndarray, parts: Parts, factor: float = 1.0) -> np.ndarray:
    """Book `factor` x each of `parts`, one after the other from `start`; returns the end."""
    end = start
    for key, seconds in parts.items():
        if factor != 1.0:
            seconds = factor * seconds
        ledger.add(key, seconds)
        end = end + seconds
    return end


def _linear_gemms(context: SimContext) -> tuple[Gemms, Gemms]:
    """The forward GEMMs of the parts before attention (q/k/v projections) and after it
    (output projection, SwiGLU gate, up and down), per rank, to be priced (`priced_gemms`)."""
    model = context.model
    tokens = context.tokens.astype(np.float64)
    qkv_flops = 2.0 * model.hidden * model.head_dim * (model.heads + 2 * model.kv_heads)
    after_flops = 2.0 * model.hidden * (model.heads * model.head_dim + 3 * model.ffn_hidden)
    # The GEMMs as (k, n) of [tokens, k] @ [k, n], as runtime/model.py runs them.
    hidden = model.hidden
    q_width, kv_width = model.heads * model.head_dim, model.kv_heads * model.head_dim
    qkv_gemms = ((hidden, q_width), (hidden, kv_width), (hidden, kv_width))
    after_gemms = (
        (q_width, hidden),
        (hidden, model.ffn_hidden),
        (hidden, model.ffn_hidden),
        (model.ffn_hidden, hidden),
    )
    element = context.train.compute_dtype_bytes
    before = Gemms(qkv_flops * tokens, _gemm_operand_bytes(tokens, qkv_gemms, element), 3)
    after = Gemms(after_flops * tokens, _gemm_operand_bytes(tokens, after_gemms, element), 4)
    return before, after


def _gemm_operand_bytes(
    tokens: np.ndarray, shapes: Sequence[tuple[int, int]], element_bytes: int
) -> np.ndarray:
    """Bytes read and written by the GEMMs [tokens, k] @ [k, n], one per (k, n) of `shapes`:
    (m·k + k·n + m·n) elements of the compute dtype each, m = tokens. Whole numbers far
    below 2**53: gathered as m·Σ(k + n) + Σk·n, the float64 sums are exact all the same."""
    widths = sum(k + n for k, n in shapes)
    weights = sum(k * n for k, n in shapes)
    return element_bytes * (tokens * widths + weights)


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
    slowest_GBps, latency_s = pinned(
        context.shared, "domain link", (context.cluster, context.cost), _domain_link
    )
    largest_missing = (1.0 - min(fractions)) * total_bytes  # = max(1 - f): 1 - f is monotone
    return float(context.cost.transfer_time_s(largest_missing, slowest_GBps, latency_s))


def _domain_link(cluster: Cluster, cost: CostModel) -> tuple[float, float]:
    """The bandwidth and latency of the domain's collectives: the slowest link between two
    nodes (the node's own link on one node)."""
    bandwidth, latency = cost.link_parameters(cluster)
    if len(bandwidth) == 1:
        return bandwidth[0, 0], latency[0, 0]
    off_diagonal = ~np.eye(len(bandwidth), dtype=bool)
    return bandwidth[off_diagonal].min(), latency[0, 1]


def _prediction(
    context: SimContext, ledger: Ledger, step_time_s: float, fractions: list[float]
) -> StepPrediction:
    calibrations = memory_calibrations(context.cost, context.ranks_by_gpu)
    memory = estimate_memory(
        context.cluster, context.model, context.train, context.layout, fractions, calibrations
    )
    # By rank, not by GPU type: a CPU test node may set its own `memory_GiB` (Cluster.gpu).
    capacity = context.cluster.memory_capacities_bytes
    seconds_by_part = dict(zip(BREAKDOWN_KEYS, map(tuple, ledger.table.tolist())))
    labels = {gpu: context.cost.label(gpu) for gpu in context.ranks_by_gpu}
    tokens = context.train.tokens_per_step
    return StepPrediction(
        step_time_s,
        tokens / step_time_s,
        seconds_by_part,
        tuple(memory),
        capacity,
        labels,
    )
