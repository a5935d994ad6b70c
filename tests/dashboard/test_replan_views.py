"""The re-plans views: one row per re-plan with its plans' shapes, predicted and measured gains
(blank while unknown), and the figure of predicted vs measured gain."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pandas as pd
import pytest

from hexiseq.dashboard.views import replans as views
from hexiseq.store import ReplanRecord


@pytest.fixture(scope="module")
def records(tiny_result) -> list[ReplanRecord]:
    """Newest first, as the store lists them: a lost device (gain not measured), then a drift
    re-plan of the tiny plan to its ring-only baseline, measured."""
    best, ring = tiny_result.best, tiny_result.baselines["ring-only"]
    drift = ReplanRecord(
        id=1,
        created_at=datetime(2025, 3, 1, 12, 0, 5, tzinfo=timezone.utc),
        launch_id="launch-a",
        step=12,
        reason="drift",
        detail="rank 2 (node0 #2, A100-80G) measured 2.01x slower than at the start",
        old_plan_json=best.to_json_text(),
        new_plan_json=ring.to_json_text(),
        measured_slowdowns={2: 2.01},
        predicted_old_step_s=3.0,
        predicted_new_step_s=2.0,
        planning_s=0.25,
        measured_before_step_s=3.3,
        measured_after_step_s=2.75,
    )
    lost = dataclasses.replace(
        drift,
        id=2,
        created_at=datetime(2025, 3, 1, 12, 30, 0, tzinfo=timezone.utc),
        launch_id="launch-b",
        step=40,
        reason="lost",
        detail="rank 3 lost",
        old_plan_json=ring.to_json_text(),
        new_plan_json='{"not": "a plan"}',
        measured_slowdowns={},
        lost_ranks=(3,),
        predicted_old_step_s=None,
        measured_before_step_s=None,
        measured_after_step_s=None,
    )
    return [lost, drift]


def test_one_row_per_replan_in_the_order_given(records):
    frame = views.replans_frame(records)
    assert list(frame.columns) == views.REPLAN_COLUMNS
    assert list(frame["replan"]) == [2, 1]
    assert list(frame["when_utc"]) == ["2025-03-01 12:30:00", "2025-03-01 12:00:05"]
    assert list(frame["launch"]) == ["launch-b", "launch-a"]
    assert list(frame["step"]) == [40, 12]
    assert list(frame["reason"]) == ["lost", "drift"]
    assert frame["detail"][1].startswith("rank 2 (node0 #2, A100-80G)")


def test_predicted_and_measured_gains(records):
    lost, drift = views.replans_frame(records).to_dict("records")
    assert (drift["predicted_old_step_s"], drift["predicted_new_step_s"]) == (3.0, 2.0)
    assert drift["predicted_gain"] == pytest.approx(1.5)
    assert (drift["measured_before_step_s"], drift["measured_after_step_s"]) == (3.3, 2.75)
    assert drift["measured_gain"] == pytest.approx(1.2)
    assert drift["planning_s"] == 0.25
    for column in (
        "predicted_old_step_s",
        "predicted_gain",
        "measured_before_step_s",
        "measured_after_step_s",
        "measured_gain",
    ):
        assert pd.isna(lost[column]), column  # blank, not zero


def test_the_plan_change_names_each_plans_shape(records, tiny_result):
    lost, drift = views.replans_frame(records)["plan_change"]
    best = views.plan_shape(tiny_result.best.to_json_text())
    ring = views.plan_shape(tiny_result.baselines["ring-only"].to_json_text())
    assert drift == f"{best} -> {ring}"
    assert ring == "4 ranks, 4 HP groups of 1"  # ring-only: every rank a group of its own
    assert best.startswith("4 ranks, ")
    old, new = lost.split(" -> ")
    assert old == ring and new.startswith("unreadable plan (plan: ")


def test_a_replica_plan_shows_each_replicas_groups():
    from hexiseq.search import plan_search

    plan = plan_search("cpu-emulated-2type", "tiny", 256, micro_batches=3).best
    # each replica one HP group of both its ranks (before the model counted the runtime's
    # one-step ring and one-member all-to-all, two groups of one)
    assert [[len(g) for g in r.layout.groups] for r in plan.replicas] == [[2], [2]]
    expected = "4 ranks, 2 replicas: 1 HP group of 2 | 1 HP group of 2"
    assert views.plan_shape(plan.to_json_text()) == expected


def test_one_group_and_uneven_groups_are_named_as_such(tiny_result):
    ulysses = tiny_result.baselines["ulysses-only"].to_json_text()
    assert views.plan_shape(ulysses) == "4 ranks, 1 HP group of 4"
    assert views._groups_text([4, 3]) == "2 HP groups (4+3)"  # ring order
    assert views._groups_text([2] + [1] * 9) == "10 HP groups (2+1+1+1+1+1+1+1+...)"


@pytest.mark.parametrize("text", ["", "[]", "{", '{"schema_version": 99}'])
def test_text_that_is_not_a_plan_is_said_so_without_raising(text):
    assert views.plan_shape(text).startswith("unreadable plan (")


def test_no_replans_is_an_empty_frame_with_the_columns():
    frame = views.replans_frame([])
    assert frame.empty and list(frame.columns) == views.REPLAN_COLUMNS


def test_the_gain_figure_has_a_predicted_and_a_measured_bar_per_replan(records):
    figure = views.replan_gain_figure(views.replans_frame(records))
    predicted, measured = figure.data
    assert list(predicted.x) == ["#1 step 12 (drift)", "#2 step 40 (lost)"]  # oldest first
    assert list(predicted.y) == pytest.approx([1.5, 0.0])  # the old plan lost a device
    assert list(predicted.text) == ["1.50x", "old plan lost a device"]
    assert list(measured.y) == pytest.approx([1.2, 0.0])
    assert list(measured.text) == ["1.20x", "not measured"]
    assert figure.layout.shapes[0].y0 == 1.0  # the line of no gain
