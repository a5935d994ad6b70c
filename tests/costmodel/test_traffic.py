"""The simulator's per-step communication volume, by hand on small layouts (the runtime's real
bytes are compared with it in tests/runtime and benchmarks/runtime.py)."""

from __future__ import annotations

import numpy as np

from hexiseq import ModelSpec, TrainSpec, build_uniform_layout
from hexiseq.costmodel.traffic import step_traffic_bytes

TINY = ModelSpec.preset("tiny")  # 2 layers, 8 heads, 2 K/V heads, head_dim 16


def test_ring_of_four_receives_three_blocks_per_pass_and_dkv_on_the_way_back():
    layout = build_uniform_layout(1024, 8, 2, [1, 1, 1, 1])
    train = TrainSpec(seq_len=1024, activation_checkpointing=True, compute_dtype_bytes=2)
    traffic = step_traffic_bytes(layout, TINY, train)
    block = 2 * 256 * 2 * 16  # 2 K/V heads x 256 tokens x (k, v) x head_dim
    # forward, recompute and backward each bring 3 blocks (bf16), on each of 2 layers
    np.testing.assert_array_equal(traffic["ring_kv_received"], 2 * 3 * 3 * block * 2)
    # dK/dV accumulators (fp32) come back on 3 hops
    np.testing.assert_array_equal(traffic["ring_dkv_received"], 2 * 3 * block * 4)
    assert not traffic["all_to_all_sent"].any() and not traffic["fold_received"].any()


def test_one_group_of_four_sends_the_other_members_their_heads_in_four_all_to_alls():
    layout = build_uniform_layout(1024, 8, 2, [4])
    train = TrainSpec(seq_len=1024, activation_checkpointing=False, compute_dtype_bytes=4)
    traffic = step_traffic_bytes(layout, TINY, train)
    # rank: 256 tokens; to each of 3 peers 2 query heads + K/V head (boundary: 1 head each);
    # in: q (2 heads) + k, v (1 head each) = 4 head-columns; out: 2; dO in: 2; dq/dk/dv: 4
    per_peer = 256 * (4 + 2 + 2 + 4) * 16 * 4
    np.testing.assert_array_equal(traffic["all_to_all_sent"], 2 * 3 * per_peer)
    assert not traffic["ring_kv_received"].any()
