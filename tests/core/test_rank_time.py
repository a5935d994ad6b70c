"""RankTime's parts: they add up, and a plan written before the newer parts still loads."""

from __future__ import annotations

import dataclasses

from hexiseq.plan import RankPrediction, RankTime, _prediction_from_dict

OLD_SIX = {
    "linear_s": 0.35,
    "attention_s": 0.09,
    "all_to_all_s": 0.0,
    "ring_exposed_comm_s": 0.0,
    "sharding_exposed_comm_s": 0.0,
    "idle_s": 0.005,
}
NEW_PARTS = ("elementwise_s", "cast_s", "loss_s", "optimizer_s", "launch_s")


def test_every_part_counts_in_the_step():
    names = [f.name for f in dataclasses.fields(RankTime)]
    assert names == [*OLD_SIX, *NEW_PARTS]
    parts = {name: float(i + 1) for i, name in enumerate(names)}
    assert RankTime(**parts).step_s == sum(parts.values())
    assert RankTime(**parts).busy_s == sum(parts.values()) - parts["idle_s"]


def test_ranks_without_the_new_parts_load_with_zeros():
    rank = {**OLD_SIX, "memory_bytes": 10, "memory_capacity_bytes": 20, "memory_terms": {}}
    prediction = _prediction_from_dict(
        {"step_time_s": 0.445, "tokens_per_s": 1.0, "cost_model": {}, "ranks": [rank]}
    )
    (loaded,) = prediction.ranks
    assert isinstance(loaded, RankPrediction)
    assert all(getattr(loaded, name) == 0.0 for name in NEW_PARTS)
    assert loaded.step_s == sum(OLD_SIX.values())
    assert loaded.memory_bytes == 10
