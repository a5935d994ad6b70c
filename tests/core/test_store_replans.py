"""Re-plans of `hexiseq run` launches in the store: round trip, the measured gain filled in
later, bad values refused with one line, filtering by launch, and stores written before the
table existed (which open with it and keep every row)."""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3
from datetime import timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from hexiseq import migrations
from hexiseq.errors import InputError
from hexiseq.store import Replan, ReplanRecord, Store

VERSION_1_STORE = Path(__file__).with_name("data") / "store-v1.db"
"""A store written by hexiseq cde2901 (schema version 1, before migrations)."""
OLD_PLAN = '{"name": "old", "world": 4}'
NEW_PLAN = '{"name": "new", "world": 3}'


def drift(**changes) -> Replan:
    """A drift re-plan: rank 2 measured 2.01x slower, the new plan predicted 1.6x faster."""
    fields = dict(
        launch_id="launch-a",
        step=12,
        reason="drift",
        detail="rank 2 (node0 #2, A100-80G) measured 2.01x slower than at the start",
        old_plan_json=OLD_PLAN,
        new_plan_json=NEW_PLAN,
        measured_slowdowns={0: 1.0, 2: 2.01},
        predicted_old_step_s=3.2,
        predicted_new_step_s=2.0,
        planning_s=0.75,
        measured_before_step_s=3.4,
    )
    return Replan(**(fields | changes))


def lost(**changes) -> Replan:
    """A lost-device re-plan: rank 3 gone, nothing measured before it."""
    fields = dict(
        reason="lost",
        detail="rank 3 (node1 #1, H100-SXM) lost",
        measured_slowdowns={},
        lost_ranks=(3,),
        measured_before_step_s=None,
        launch_id="launch-b",
    )
    return drift(**(fields | changes))


@pytest.fixture()
def store(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as opened:
        yield opened


def test_a_replan_reads_back_with_every_field_id_and_time(store):
    replan_id = store.save_replan(drift())
    (record,) = store.list_replans()
    assert isinstance(record, ReplanRecord)
    assert record.id == replan_id and record.created_at.tzinfo is timezone.utc
    stored = {f.name: getattr(record, f.name) for f in dataclasses.fields(Replan)}
    assert Replan(**stored) == drift()
    assert record.measured_slowdowns == {0: 1.0, 2: 2.01}  # int keys again, not JSON's text
    assert record.old_plan_json == OLD_PLAN and record.new_plan_json == NEW_PLAN
    assert record.predicted_gain == pytest.approx(1.6)
    assert record.measured_gain is None  # the new plan's steps are not measured yet


def test_the_new_plans_measured_step_time_is_filled_in_later(store):
    replan_id = store.save_replan(drift())
    store.set_replan_measured_after(replan_id, 2.125)
    (record,) = store.list_replans()
    assert record.measured_after_step_s == 2.125
    assert record.measured_gain == pytest.approx(3.4 / 2.125)


def test_a_lost_device_replan_keeps_its_lost_ranks_and_unknown_gain(store):
    store.save_replan(lost(lost_ranks=[3, 1]))
    (record,) = store.list_replans()
    assert record.lost_ranks == (3, 1) and record.measured_slowdowns == {}
    assert record.measured_before_step_s is None
    store.set_replan_measured_after(record.id, 1.0)
    assert store.list_replans()[0].measured_gain is None  # nothing measured before


def test_replans_are_listed_newest_first_and_by_launch(store):
    first = store.save_replan(drift())
    second = store.save_replan(lost())
    third = store.save_replan(drift(step=40))
    assert [r.id for r in store.list_replans()] == [third, second, first]
    assert [r.id for r in store.list_replans("launch-a")] == [third, first]
    assert [r.id for r in store.list_replans("launch-b")] == [second]
    assert store.list_replans("launch-c") == []


def test_a_replan_saved_in_a_failed_transaction_is_not_kept(store):
    with pytest.raises(RuntimeError), store.transaction():
        store.save_replan(drift())
        raise RuntimeError("the launcher died")
    assert store.list_replans() == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"reason": "slow"}, r"reason is 'drift' or 'lost', not 'slow'"),
        ({"step": -1}, r"step must be an integer >= 0, got -1"),
        ({"step": 2.5}, r"step must be an integer >= 0"),
        ({"step": True}, r"step must be an integer >= 0"),
        ({"launch_id": " "}, r"launch_id must be a non-empty string"),
        ({"detail": "two\nlines"}, r"detail must be one non-empty line"),
        ({"old_plan_json": "{not json"}, r"old_plan_json is not valid JSON"),
        ({"new_plan_json": None}, r"new_plan_json must be a JSON string"),
        ({"predicted_new_step_s": 0.0}, r"predicted_new_step_s must be a finite number > 0"),
        ({"predicted_old_step_s": float("inf")}, r"predicted_old_step_s must be a finite"),
        ({"planning_s": float("nan")}, r"planning_s must be a finite number >= 0, got nan"),
        ({"planning_s": -0.1}, r"planning_s must be a finite number >= 0"),
        ({"measured_before_step_s": float("nan")}, r"measured_before_step_s must be a finite"),
        ({"measured_after_step_s": -2.0}, r"measured_after_step_s must be a finite number > 0"),
        ({"measured_slowdowns": {2: 0.0}}, r"measured_slowdowns\[2\] must be a finite number"),
        ({"measured_slowdowns": {2: float("inf")}}, r"measured_slowdowns\[2\] must be a fin"),
        ({"measured_slowdowns": {-1: 2.0}}, r"measured_slowdowns: rank -1 is not an integer"),
        ({"measured_slowdowns": {"2": 2.0}}, r"measured_slowdowns: rank '2' is not an integer"),
        ({"measured_slowdowns": [2.0]}, r"measured_slowdowns must map rank -> factor"),
    ],
)
def test_bad_drift_values_are_refused_with_one_line(changes, message):
    with pytest.raises(InputError, match=message) as raised:
        drift(**changes)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lost_ranks": (-1,)}, r"lost_ranks must be distinct integers >= 0, got \[-1\]"),
        ({"lost_ranks": (2, 2)}, r"lost_ranks must be distinct integers >= 0, got \[2, 2\]"),
        ({"lost_ranks": (1.0,)}, r"lost_ranks must be distinct integers >= 0"),
        ({"lost_ranks": "3"}, r"lost_ranks must be a sequence of ranks"),
        ({"lost_ranks": ()}, r"reason 'lost' names the lost ranks; got none"),
    ],
)
def test_bad_lost_ranks_are_refused(changes, message):
    with pytest.raises(InputError, match=message):
        lost(**changes)


def test_save_replan_takes_only_a_replan(store):
    with pytest.raises(InputError, match="save_replan takes a Replan, got dict"):
        store.save_replan({"launch_id": "launch-a"})


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), "2", None, True])
def test_a_bad_measured_after_time_is_refused_and_nothing_changes(store, seconds):
    replan_id = store.save_replan(drift())
    with pytest.raises(InputError, match="measured_after_step_s must be a finite number > 0"):
        store.set_replan_measured_after(replan_id, seconds)
    assert store.list_replans()[0].measured_after_step_s is None


def test_measured_after_of_an_unknown_replan_names_it(store):
    store.save_replan(drift())
    with pytest.raises(InputError, match=r"has no re-plan with id 99$"):
        store.set_replan_measured_after(99, 1.0)


def _table_names(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
        return {name for (name,) in rows}


def test_a_store_made_before_replans_opens_with_the_table_and_its_rows(tmp_path):
    """A store at revision 0002 (the one before re-plans), emulated by dropping the table and
    stepping its revision back, gets the table on its next open and keeps its plan."""
    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    with Store.open(url) as store:
        plan_id = store.save_plan(
            "{}",
            label="best",
            cluster_name="c",
            model_name="tiny",
            seq_len=64,
            tokens_per_s=None,
            step_time_s=None,
            cost_model="datasheet estimate",
        )
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE runtime_replans"))
        connection.execute(text(f"UPDATE {migrations.VERSION_TABLE} SET version_num = '0002'"))
    engine.dispose()
    assert "runtime_replans" not in _table_names(path)
    with Store.open(url) as store:
        assert store.list_replans() == []
        assert [r.id for r in store.list_plans()] == [plan_id]
        store.save_replan(drift())
        assert len(store.list_replans()) == 1
    with sqlite3.connect(path) as connection:
        (revision,) = connection.execute(f"SELECT version_num FROM {migrations.VERSION_TABLE}")
    assert revision == (migrations.head_revision(),)


def test_a_version_1_store_gets_the_replans_table(tmp_path):
    path = tmp_path / "v1.db"
    shutil.copy(VERSION_1_STORE, path)
    assert "runtime_replans" not in _table_names(path)
    with Store.open(f"sqlite:///{path}") as store:
        assert store.list_replans() == []
        assert len(store.list_runtime_runs()) == 1
        store.save_replan(lost())
        assert [r.reason for r in store.list_replans("launch-b")] == ["lost"]


def test_replans_round_trip_on_postgresql(postgresql_database):
    with Store.open(postgresql_database) as store:
        replan_id = store.save_replan(drift())
        store.save_replan(lost())
        store.set_replan_measured_after(replan_id, 2.0)
        (record,) = store.list_replans("launch-a")
        assert record.measured_slowdowns == {0: 1.0, 2: 2.01}
        assert record.measured_gain == pytest.approx(1.7)
        assert record.created_at.tzinfo is timezone.utc
