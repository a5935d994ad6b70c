"""The link sweep's rounds (pure parts): samples split over rounds, a shuffled visiting order
that every rank computes alike, and ops grouped by ascending size."""

from __future__ import annotations

import pytest

from hexiseq.profiler._points import link_point
from hexiseq.profiler._rounds import samples_in_round, visiting_order
from hexiseq.profiler.links import _by_op


@pytest.mark.parametrize(("samples", "rounds"), [(10, 5), (40, 6), (11, 11), (10, 1), (13, 4)])
def test_samples_are_split_over_rounds_without_loss(samples: int, rounds: int) -> None:
    counts = [samples_in_round(samples, rounds, index) for index in range(rounds)]
    assert sum(counts) == samples
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1


def test_visiting_order_is_a_shuffle_shared_by_every_rank() -> None:
    orders = [visiting_order(19, index) for index in range(5)]
    assert all(sorted(order) == list(range(19)) for order in orders)
    assert len({tuple(order) for order in orders}) == 5  # each round its own order
    assert orders == [visiting_order(19, index) for index in range(5)]  # same seed, same order


def test_points_are_grouped_by_op_in_ascending_size() -> None:
    sizes = [4096, 1024, 2048]
    points = [link_point(op, 2, size, "float32") for size in sizes for op in ("all_to_all", "x")]
    groups = _by_op(points)
    assert [group[0].op for group in groups] == ["all_to_all", "x"]
    for group in groups:
        assert [p.params["message_bytes"] for p in group] == sorted(sizes)
