"""The communication volume of one training step, rank by rank, as the simulator counts it.

The step simulator times every all-to-all and ring hop from the byte counts of
`costmodel._traffic`; this module adds those counts up over a whole step (every layer, every
micro-batch, forward, recompute and backward) so they can be compared with what the runtime
really sends (`benchmarks/runtime.py` measures it).
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel._traffic import FP32, all_to_all_bytes, fold_links, ring_senders
from hexiseq.layout import AttentionLayout, kv_keepers
from hexiseq.model import ModelSpec, TrainSpec

TRAFFIC_KINDS = ("all_to_all_sent", "ring_kv_received", "ring_dkv_received", "fold_received")


def step_traffic_bytes(
    layout: AttentionLayout, model: ModelSpec, train: TrainSpec
) -> dict[str, np.ndarray]:
    """[rank] bytes of each kind in TRAFFIC_KINDS for one training step:

    - all_to_all_sent: what the rank sends to the other members of its HP group in the four
      all-to-alls of a layer (q/K/V into head form, output back; dO in, dq/dK/dV back);
    - ring_kv_received: K/V blocks received on the ring (once per forward pass, the recompute
      included, and once more in the backward);
    - ring_dkv_received: FP32 dK/dV accumulators received from the previous group's keepers;
    - fold_received: FP32 partials of GQA boundary heads handed in by holders in its group.
    """
    element = train.compute_dtype_bytes
    forward_passes = 2 if train.activation_checkpointing else 1
    per_layer = _layer_traffic(layout, model.head_dim, element, forward_passes)
    repeats = model.layers * train.micro_batches
    return {kind: bytes_by_rank * repeats for kind, bytes_by_rank in per_layer.items()}


def _layer_traffic(
    layout: AttentionLayout, head_dim: int, element: int, forward_passes: int
) -> dict[str, np.ndarray]:
    world = layout.world_size
    traffic = {kind: np.zeros(world) for kind in TRAFFIC_KINDS}
    for members in layout.groups:
        _add_all_to_all(
            traffic["all_to_all_sent"], layout, members, head_dim, element, forward_passes
        )
    count = len(layout.groups)
    if count == 1:
        return traffic
    lengths = [layout.segment_length(g) for g in range(count)]
    per_head_token = 2 * head_dim  # k and v (or dK and dV) of one head
    kv_in = ring_senders(layout).kv_heads_in
    folds = fold_links(layout)
    for rank in range(world):
        g = layout.group_of(rank)
        arriving = sum(lengths[(g - step) % count] for step in range(1, count))
        returning = sum(lengths[(g - step - 1) % count] for step in range(1, count))
        kept = sum(1 for k in kv_keepers(layout, layout.groups[g]).values() if k == rank)
        folded = int(folds.heads[folds.keepers == rank].sum())
        kv_passes = forward_passes + 1  # the backward sends the K/V blocks round again
        traffic["ring_kv_received"][rank] = (
            kv_passes * kv_in[rank] * arriving * per_head_token * element
        )
        traffic["ring_dkv_received"][rank] = kept * returning * per_head_token * FP32
        traffic["fold_received"][rank] = folded * arriving * per_head_token * FP32
    return traffic


def _add_all_to_all(
    sent: np.ndarray,
    layout: AttentionLayout,
    members: tuple[int, ...],
    head_dim: int,
    element: int,
    forward_passes: int,
) -> None:
    """Forward (each pass): q/K/V rows out, the output's column back; backward: dO rows out
    (the output's reverse), dq/dK/dV columns back. Rank i sends row i going in, column i
    coming back."""
    if len(members) == 1:
        return
    shape = dict(head_dim=head_dim, element_bytes=element)
    qkv = all_to_all_bytes(layout, members, q_heads=True, kv=True, **shape)
    q_only = all_to_all_bytes(layout, members, q_heads=True, kv=False, **shape)
    forward = qkv.sum(axis=1) + q_only.sum(axis=0)
    backward = q_only.sum(axis=1) + qkv.sum(axis=0)
    per_member = forward_passes * forward + backward
    sent[list(members)] += per_member
