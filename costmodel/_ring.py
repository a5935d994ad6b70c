"""Ring attention in the step simulator: every step's block compute and block transfer.

At step i group g computes on the block of group g - i. That block left group g - 1 when both
ranks began step i - 1 (communication is posted one step ahead) and crosses the real link
between the sending and the receiving rank. In the backward pass the block's partial dK/dV
travel with it: they leave a rank only when its step is done, and after the last step they
make one more hop, back to the group that owns the block.
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel._state import Ledger, SimContext
from hexiseq.costmodel._traffic import BF16, FP32, RingHop, ring_hops
from hexiseq.layout import causal_pair_count


def ring_pass(
    context: SimContext, ledger: Ledger, ring_start: np.ndarray, *, backward: bool
) -> np.ndarray:
    """All ring steps of one attention pass; returns each rank's finish time."""
    layout = context.layout
    group_count = len(layout.groups)
    compute = _ring_compute(context, backward=backward)  # [step, rank]
    ledger.add("attention_s", compute.sum(axis=0))
    start, end = ring_start.copy(), ring_start + compute[0]
    if group_count > 1:
        hops, heads_out = ring_hops(layout)
        kv_time, dkv_time = _ring_transfer_times(context, hops, heads_out)
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
    exposed = np.maximum(0.0, end - ring_start - compute.sum(axis=0))  # no -1e-17 rounding
    ledger.add("ring_exposed_comm_s", exposed)
    return end


def _ring_step(
    context: SimContext,
    hops: dict[int, RingHop],
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
    context: SimContext, hops: dict[int, RingHop], end: np.ndarray, dkv_time: np.ndarray
) -> np.ndarray:
    """After the last step each block's dK/dV make one more hop, back to their owner group."""
    done = end.copy()
    for rank in range(context.layout.world_size):
        senders = list(hops[rank].senders)
        done[rank] = max(end[rank], float(np.max(end[senders])) + dkv_time[rank])
    return done


def _ring_compute(context: SimContext, *, backward: bool) -> np.ndarray:
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


def _ring_transfer_times(
    context: SimContext, hops: dict[int, RingHop], heads_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """[origin-offset step, rank] transfer time of the K/V block (BF16) and of its dK/dV (FP32)
    arriving at each rank; index 0 is the final return hop of the backward pass."""
    layout, model = context.layout, context.model
    group_count = len(layout.groups)
    lengths = [layout.segment_length(g) for g in range(group_count)]
    kv_time = np.zeros((group_count, layout.world_size))
    dkv_time = np.zeros((group_count, layout.world_size))
    for step in range(group_count):
        for rank in range(layout.world_size):
            origin = (int(context.group_of[rank]) - step) % group_count
            for table, element in ((kv_time, BF16), (dkv_time, FP32)):
                per_head = lengths[origin] * 2 * model.head_dim * element
                table[step, rank] = _hop_time(context, hops[rank], rank, heads_out, per_head)
    return kv_time, dkv_time


def _hop_time(
    context: SimContext, hop: RingHop, rank: int, heads_out: np.ndarray, per_head: float
) -> float:
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
