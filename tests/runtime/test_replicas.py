"""Data-parallel replicas over CP-HP meshes (issue 15): the world split into replicas of
different sizes and layouts, each taking a different number of sequences per step; loss and
every gradient after the step equal the single-process float64 model on the whole batch
(fp32, fresh random tokens, relative error <= 1e-5)."""

from __future__ import annotations

import pytest
from distributed import run_distributed
from model_cases import ReplicaCase, check_replica_case, zigzag

from hexiseq import InputError
from hexiseq.runtime.replicas import Replica, check_replicas, sequence_indices

ONE = zigzag("tiny", [[0]], [40], [[1]], [[8]])
TWO = zigzag("tiny", [[1, 0]], [40], [[1, 3]], [[5, 3]])
THREE = zigzag("tiny", [[2, 0], [1]], [28, 12], [[2, 1], [1]], [[3, 5], [8]])


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "replicas",
    [
        # a 3-rank mesh taking one sequence beside a single rank taking two
        (Replica((0, 1, 3), THREE, 1), Replica((2,), ONE, 2)),
        # interleaved 2-rank meshes, uneven sequences, layout order not the global order
        (Replica((2, 0), TWO, 2), Replica((1, 3), TWO, 1)),
    ],
)
def test_replicas_train_as_one_process_on_the_whole_batch(replicas):
    run_distributed(check_replica_case, 4, ReplicaCase("tiny", replicas, 20261124))


def test_each_replica_takes_its_own_sequences():
    replicas = (Replica((0, 1, 3), THREE, 1), Replica((2,), ONE, 3))
    assert sequence_indices(replicas) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ((Replica((0, 1, 3), THREE, 1),), "every rank 0..3 exactly once"),
        ((Replica((0, 1, 3), THREE, 1), Replica((3,), ONE, 1)), "exactly once"),
        ((Replica((0, 1), THREE, 1), Replica((2, 3), TWO, 1)), "a layout for 3"),
        ((Replica((0, 1, 3), THREE, 0), Replica((2,), ONE, 1)), "at least 1"),
        (
            (
                Replica((0, 1, 3), THREE, 1),
                Replica((2,), zigzag("tiny", [[0]], [24], [[1]], [[8]]), 1),
            ),  # fmt: skip
            "layout covers 24 tokens",
        ),
    ],
)
def test_replicas_that_do_not_cover_the_world_once_are_refused(replicas, message):
    with pytest.raises(InputError, match=message):
        check_replicas(replicas, 4)
