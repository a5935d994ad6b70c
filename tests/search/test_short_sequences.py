"""A sequence too short for one mesh over the whole cluster (2 tokens per device) is still
planned where a batch lets data-parallel replicas of whole nodes take whole sequences."""

from __future__ import annotations

import pytest

from hexiseq import plan_search
from hexiseq.errors import InputError

CLUSTER = "h100x8-a100x8"  # two nodes of 8: one mesh needs 32 tokens, a node 16


def test_replicas_of_nodes_take_a_sequence_one_mesh_cannot():
    plan = plan_search(CLUSTER, "llama3.2-3b", 16, micro_batches=4).best
    assert plan.data_parallel and sum(r.sequences for r in plan.replicas) == 4
    for replica in plan.replicas:
        assert len(replica.ranks) <= 8  # no replica spans both nodes: 16 tokens over 16 ranks


@pytest.mark.parametrize(
    "seq_len, micro_batches, message",
    [
        (16, 1, r"at least 2 per device \(32\); or give a batch \(--micro-batches N >= 2\)"),
        (8, 4, r"cannot be split over a node of h100x8-a100x8 \(8 devices\).*\(16\)"),
        (17, 1, r"give an even number of tokens, at least 2 per device \(32\)$"),
    ],
)
def test_sequences_no_mesh_can_take_say_what_would(seq_len, micro_batches, message):
    with pytest.raises(InputError, match=message):
        plan_search(CLUSTER, "llama3.2-3b", seq_len, micro_batches=micro_batches)
