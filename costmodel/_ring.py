"""Ring attention in the step simulator: every step's block compute and block transfer.

At step i group g computes on the block of group g - i. That block left group g - 1 when both
ranks began step i - 1 (communication is posted one step ahead) and crosses the real link
between the sending and the receiving rank. In the backward pass the block's FP32 dK/dV
accumulator travels behind it, as the runtime does: it starts at zero on the group after the
owner (step 1 waits for none), leaves a keeper only when its step is done and the boundary
partials of its group are folded in, goes keeper to keeper, and after the last step makes one
more hop, back to the group that owns the block.

The steps depend on each other, so they run in order, but every step is computed for all ranks
at once from [step, rank] tables that are built once per plan (`build_ring_tables`), step-major
from the start: on 1024 groups a table is a million entries, and a transposed copy of one
costs as much as computing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.costmodel._pairs import (
    causal_pair_matrix,
    steps_by_column,
    steps_of_sequence,
    zigzag_pair_matrix,
)
from hexiseq.costmodel._state import Ledger, SimContext, per_gpu_type_by_step
from hexiseq.costmodel._traffic import (
    FP32,
    FoldLinks,
    RingSenders,
    ring_traffic,
)
from hexiseq.kernels import attention_kernel, training_dtype


@dataclass(frozen=True)
class RingTables:
    """Per-plan constants of the ring passes, as [step, rank] tables (step 0: own block)."""

    senders: RingSenders | None  # None with one group (no ring hops)
    forward_s: np.ndarray  # [step, rank] forward attention compute
    backward_s: np.ndarray  # [step, rank] backward attention compute
    kv_time_s: np.ndarray  # [step, rank] arrival of the K/V block (compute dtype) once posted
    dkv_time_s: np.ndarray  # [step, rank] same for its FP32 dK/dV; step 0: the return hop
    dkv_senders: RingSenders | None = None  # keeper-to-keeper hops of dK/dV
    folds: FoldLinks | None = None  # boundary partials handed to the keeper in the group
    fold_time_s: np.ndarray | None = None  # [step, fold link]

    @property
    def step_count(self) -> int:
        return self.forward_s.shape[0]


def build_ring_tables(context: SimContext) -> RingTables:
    """Compute and transfer time of every rank at every ring step of `context`'s layout."""
    group_count = len(context.layout.groups)
    pairs = context.of_layout("ring pairs", _pairs_by_step)
    shapes = _block_shapes(context, pairs)
    forward_s, backward_s = _attention_times(context, pairs, shapes)
    if group_count == 1:
        nothing = np.zeros_like(forward_s)
        return RingTables(None, forward_s, backward_s, nothing, nothing)
    senders, dkv_senders, folds = context.structural("ring traffic", ring_traffic)
    block_tokens = steps_of_sequence(context.segment_lengths)  # [step, group] block in hand
    element = context.train.compute_dtype_bytes
    return RingTables(
        senders,
        forward_s,
        backward_s,
        _transfer_times(context, "K/V hops", senders, block_tokens, element),
        _transfer_times(context, "dK/dV hops", dkv_senders, block_tokens, FP32),
        dkv_senders,
        folds,
        _fold_times(context, folds, block_tokens),
    )


def _pairs_by_step(context: SimContext) -> np.ndarray:
    """[step, group] causal (query, key) pairs of the block group g holds at each step."""
    chunks = context.layout.zigzag_chunks
    if chunks is None:
        return steps_by_column(causal_pair_matrix(context.layout, context.group_of))
    return steps_by_column(zigzag_pair_matrix(np.asarray(chunks, dtype=np.int64)))


def ring_pass(
    tables: RingTables, ledger: Ledger, ring_start: np.ndarray, *, backward: bool
) -> np.ndarray:
    """All ring steps of one attention pass; returns each rank's finish time. At each step,
    for all ranks: the block was posted when sender and receiver began the previous step; it
    starts when the block is in and the previous step is done; in the backward pass it ends
    no earlier than the block's dK/dV accumulator arrives."""
    compute = tables.backward_s if backward else tables.forward_s
    compute_total = compute.sum(axis=0)
    ledger.add("attention_s", compute_total)
    start, end = ring_start.copy(), ring_start + compute[0]
    if tables.step_count > 1:
        senders, kv_time_s = tables.senders, tables.kv_time_s
        for step in range(1, tables.step_count):
            # Step 1 starts the travelling dK/dV at zero; later steps wait for it to arrive.
            ready = _dkv_ready(tables, step - 1, end) if backward and step > 1 else None
            posted = senders.latest(start)
            np.maximum(start, posted, out=posted)
            posted += kv_time_s[step]
            start = np.maximum(end, posted, out=posted)
            end = start + compute[step]
            if ready is not None:
                arrived = tables.dkv_senders.latest(ready)
                arrived += tables.dkv_time_s[step]
                np.maximum(end, arrived, out=end)
    if backward and tables.senders is not None:  # dK/dV go home once the last step is done
        ready = _dkv_ready(tables, tables.step_count - 1, end)
        end = np.maximum(end, tables.dkv_senders.latest(ready) + tables.dkv_time_s[0])
    exposed = np.maximum(0.0, end - ring_start - compute_total)  # no -1e-17 rounding
    ledger.add("ring_exposed_comm_s", exposed)
    return end


def _dkv_ready(tables: RingTables, step: int, end: np.ndarray) -> np.ndarray:
    """When each keeper may send on the dK/dV of the block it finished at `step`: its own
    step is done and its group's boundary partials of that step are folded in."""
    ready = end.copy()
    folds = tables.folds
    if folds is not None and len(folds.keepers):
        arrivals = end[folds.folders] + tables.fold_time_s[step]
        np.maximum.at(ready, folds.keepers, arrivals)
    return ready


def _fold_times(context: SimContext, folds: FoldLinks, block_tokens: np.ndarray) -> np.ndarray:
    """[step, fold link] time to hand the keeper the shared heads' FP32 partials of the block
    the group holds at that step, over the link between the two ranks."""
    if not len(folds.keepers):
        return np.zeros((block_tokens.shape[0], 0))
    links = context.on_cluster("fold links", lambda c: _Links(c, folds.folders, folds.keepers))
    tokens = np.take(block_tokens, links.receiver_groups, axis=1)  # [step, link]
    bytes_moved = folds.heads[None, :] * tokens * 2 * context.model.head_dim * FP32
    seconds = context.cost.transfer_time_s(bytes_moved, links.GBps, links.latency_s)
    return np.asarray(seconds, dtype=float)


class _Links:
    """Links from `senders` to `receivers` (rank arrays) in a layout: the receivers' groups
    and each link's bandwidth and latency ([1, link]), once per layout structure and cluster
    (`SimContext.on_cluster`)."""

    def __init__(self, context: SimContext, senders: np.ndarray, receivers: np.ndarray):
        self.receiver_groups = context.group_of[receivers]
        link_nodes = context.node_of[senders], context.node_of[receivers]
        self.GBps = context.bandwidth_GBps[link_nodes][None, :]
        self.latency_s = context.latency_s[link_nodes][None, :]


def _attention_times(
    context: SimContext, pairs: np.ndarray, shapes: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """[step, rank] forward and backward attention time: the rank's heads over the (query,
    key) pairs `pairs[step, group]` of its group, in one block of `shapes` = (query, key
    tokens). Each GPU model's ranks gather their groups' pairs once for both passes."""
    cost, head_dim = context.cost, context.model.head_dim
    q_tokens, kv_tokens = shapes
    gathered: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def blocks(gpu: str, ranks: np.ndarray | slice) -> tuple[np.ndarray, ...]:
        if gpu not in gathered:
            groups = context.group_of[ranks]
            rank_pairs = np.take(pairs, groups, axis=1)
            gathered[gpu] = (
                rank_pairs,
                np.broadcast_to(q_tokens[groups][None, :], rank_pairs.shape),
                np.take(kv_tokens, groups, axis=1),
            )
        return gathered[gpu]

    def seconds_of(backward: bool):
        def seconds(gpu: str, ranks: np.ndarray | slice) -> np.ndarray:
            rank_pairs, rank_q_tokens, rank_kv_tokens = blocks(gpu, ranks)
            return cost.attention_time_s(
                gpu,
                rank_pairs,
                context.heads[None, ranks],
                head_dim,
                backward=backward,
                q_tokens=rank_q_tokens,
                kv_tokens=rank_kv_tokens,
                kernel=recipe_kernel(context, gpu),
            )

        return seconds

    steps = pairs.shape[0]
    return (
        per_gpu_type_by_step(context, seconds_of(False), steps),
        per_gpu_type_by_step(context, seconds_of(True), steps),
    )


def _block_shapes(context: SimContext, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[group] query tokens and [step, group] key tokens of the one kernel call a ring step
    makes (the runtime's tiles, `runtime/_tiles.py`, for zigzag layouts): at step 0 the
    group's own block as a causal square (segment x segment, about half of it masked); at the
    other steps a mask-free rectangle of `pairs` pairs, counted here as the group's queries x
    pairs / them."""
    segments = np.asarray(context.segment_lengths, dtype=np.float64)
    q_tokens = segments
    kv_tokens = pairs / np.maximum(q_tokens, 1.0)[None, :]
    kv_tokens[0, :] = segments
    return q_tokens, kv_tokens


def _transfer_times(
    context: SimContext,
    name: str,
    senders: RingSenders,
    block_tokens: np.ndarray,
    element_bytes: int,
) -> np.ndarray:
    """[step, rank] time to receive the block of `block_tokens[step, group]` tokens (K/V, or
    dK/dV in FP32): `kv_heads_in` heads while each sender sends all its outgoing heads;
    the slowest sender sets the time. `name` tells the hops of `senders` apart."""
    links = context.on_cluster(name, lambda c: _Links(c, senders.senders, senders.receivers))
    bytes_per_token = context.on_cluster(
        f"{name} bytes per token {element_bytes}",
        lambda c: _bytes_per_token(c, senders, element_bytes),
    )
    bytes_moved = np.take(block_tokens, links.receiver_groups, axis=1)
    bytes_moved *= bytes_per_token[None, :]
    seconds = context.cost.transfer_time_s(bytes_moved, links.GBps, links.latency_s)
    if senders.one_per_rank:  # links are ranks already
        return seconds
    return np.maximum.reduceat(seconds, senders.first_link, axis=1)


def _bytes_per_token(context: SimContext, senders: RingSenders, element_bytes: int):
    """[link] bytes a block token takes on each link (integers)."""
    heads = np.maximum(senders.kv_heads_in[senders.receivers], senders.heads_out[senders.senders])
    return heads * 2 * context.model.head_dim * element_bytes


def recipe_kernel(context: SimContext, gpu: str) -> str | None:
    """The attention kernel of the plan's runtime recipe: None (the kernel rule's) for the
    runtime of today; the runtime before it (`autocast`) never ran cuDNN attention."""
    if context.train.runtime_recipe == "sharded":
        return None
    return attention_kernel(gpu, training_dtype(gpu), context.model.head_dim, cudnn_usable=False)
