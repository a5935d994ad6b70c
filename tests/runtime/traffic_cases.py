"""Tier-2 worker that records the bytes the runtime moves and compares them with the
simulator's traffic model (`costmodel._traffic`) and with the runtime docstring."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch.distributed as dist
from attention_cases import HEAD_DIM, Case, full_inputs, token_index

from hexiseq.costmodel._traffic import BF16, all_to_all_bytes, ring_senders
from hexiseq.runtime._p2p import DKV_TAG, FOLD_TAG, KV_TAG
from hexiseq.runtime._routes import fold_transfers, lowest_holders

FP32 = 4


class TrafficRecorder:
    """Wraps the two communication calls the runtime makes and adds up received bytes."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.received: dict[tuple[str, int], int] = defaultdict(int)  # (phase, tag) -> bytes
        self.all_to_all_sent: list[tuple[str, list[int]]] = []  # (phase, bytes per peer)
        self._batch = dist.batch_isend_irecv
        self._all_to_all = dist.all_to_all_single

    def install(self, monkey) -> None:
        monkey.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)
        monkey.setattr(dist, "all_to_all_single", self.all_to_all_single)

    def batch_isend_irecv(self, ops):
        for op in ops:
            if op.op is dist.irecv:
                self.received[(self.phase, op.tag)] += op.tensor.numel() * op.tensor.element_size()
        return self._batch(ops)

    def all_to_all_single(self, output, flat, output_splits, input_splits, group):
        sent = [n * flat.element_size() for n in input_splits]
        self.all_to_all_sent.append((self.phase, sent))
        return self._all_to_all(output, flat, output_splits, input_splits, group=group)


def check_traffic(rank: int, world_size: int, case: Case) -> None:
    """Run one case with a recorder and compare every byte count with its formula."""
    import pytest

    from hexiseq.runtime import CPHPAttention

    layout, batch = case.layout, case.batch
    recorder = TrafficRecorder()
    with pytest.MonkeyPatch.context() as monkey:
        recorder.install(monkey)
        index = token_index(layout, rank)
        q, k, v, dout = (x[:, index].clone() for x in full_inputs(case))
        leaves = [x.requires_grad_() for x in (q, k, v)]
        out = CPHPAttention(layout)(*leaves, causal=case.causal)
        recorder.phase = "backward"
        out.backward(dout)
    _check_ring_bytes(layout, rank, batch, recorder.received)
    _check_all_to_all_bytes(layout, rank, batch, recorder.all_to_all_sent)


def _check_ring_bytes(layout, rank, batch, received) -> None:
    g, count = layout.group_of(rank), len(layout.groups)
    lengths = [layout.segment_length(b) for b in range(count)]
    per_head_token = 2 * HEAD_DIM * batch * FP32  # k and v (or dK and dV) of one head, fp32
    # K/V: the model's kv_heads_in heads per hop, blocks of steps 1..G-1 (owners g-1 ... g+1).
    kv_heads_in = int(ring_senders(layout).kv_heads_in[rank]) if count > 1 else 0
    kv_tokens = sum(lengths[(g - step) % count] for step in range(1, count))
    for phase in ("forward", "backward"):
        assert received[(phase, KV_TAG)] == kv_heads_in * kv_tokens * per_head_token
    # dK/dV: G-1 hops after steps 1..G-1, each bringing the block of the next step (the last
    # one this rank's own), only the heads it keeps.
    kept = sum(1 for keeper in lowest_holders(layout, layout.groups[g]).values() if keeper == rank)
    dkv_tokens = sum(lengths[(g - step - 1) % count] for step in range(1, count))
    assert (
        received[("backward", DKV_TAG)] == (kept if count > 1 else 0) * dkv_tokens * per_head_token
    )
    # Folds: after steps 1..G-1, the shared heads the other holders hand this keeper.
    folded = sum(t.num_heads for t in fold_transfers(layout, g) if t.receiver == rank)
    fold_tokens = sum(lengths[(g - step) % count] for step in range(1, count))
    assert received[("backward", FOLD_TAG)] == folded * fold_tokens * per_head_token
    assert received[("forward", DKV_TAG)] == received[("forward", FOLD_TAG)] == 0


def _check_all_to_all_bytes(layout, rank, batch, sent) -> None:
    members = layout.groups[layout.group_of(rank)]
    if len(members) == 1:
        assert sent == []
        return
    me = members.index(rank)
    to_fp32 = batch * FP32 / BF16  # the model counts one sequence in BF16
    qkv = all_to_all_bytes(layout, members, HEAD_DIM, q_heads=True, kv=True) * to_fp32
    q_only = all_to_all_bytes(layout, members, HEAD_DIM, q_heads=True, kv=False) * to_fp32
    # Sequence -> heads: row `me` of the matrix; heads -> sequence: column `me` (transpose).
    expected = [
        ("forward", qkv[me]),
        ("forward", q_only[:, me]),
        ("backward", q_only[me]),
        ("backward", qkv[:, me]),
    ]
    by_group_rank = sorted(range(len(members)), key=lambda i: members[i])
    assert [phase for phase, _ in sent] == [phase for phase, _ in expected]
    for (_, got), (_, want) in zip(sent, expected):
        got_by_member = np.zeros(len(members))
        got_by_member[by_group_rank] = got
        got_by_member[me] = 0.0  # the model leaves a rank's share to itself out
        np.testing.assert_array_equal(got_by_member, want)
