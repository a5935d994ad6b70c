"""Interleaved rounds (pure): a point's samples are split over rounds, and each round visits
the points of a group in its own shuffled order, computed alike on every rank."""

from __future__ import annotations

import random

_SEED = 4321


def samples_in_round(samples: int, rounds: int, round_index: int) -> int:
    """`samples` split over `rounds` as evenly as can be, the earlier rounds taking the rest."""
    return samples // rounds + (1 if round_index < samples % rounds else 0)


def visiting_order(count: int, round_index: int) -> list[int]:
    """Indices 0..count-1 shuffled by a seed every rank shares."""
    order = list(range(count))
    random.Random(_SEED + round_index).shuffle(order)
    return order
