"""Tests of hexiseq.store: round trips, ordering, persistence, transactions and bad input."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from datetime import timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateTable

from hexiseq.errors import InputError
from hexiseq.store import (
    DEFAULT_STORE_URL,
    SCHEMA_VERSION,
    PlanRecord,
    PlanRow,
    Store,
    StoreBase,
)


def _plan_json(tag: str) -> str:
    return json.dumps({"schema_version": 1, "tag": tag, "ranks": [{"tokens": 1024}]})


def _save(store: Store, tag: str, **overrides: object) -> int:
    fields: dict[str, object] = {
        "label": "best",
        "cluster_name": "mixed-a100-h100",
        "model_name": "llama-7b",
        "seq_len": 131072,
        "tokens_per_s": 12345.5,
        "step_time_s": 10.6,
        "cost_model": "datasheet estimate",
    }
    fields.update(overrides)
    return store.save_plan(_plan_json(tag), **fields)  # type: ignore[arg-type]


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "hexiseq.db"


@pytest.fixture
def store(store_path: Path) -> Iterator[Store]:
    with Store.open(_sqlite_url(store_path)) as opened:
        yield opened


@pytest.fixture
def fail_on_plan_insert() -> Iterator[list[int]]:
    """Make the n-th insert into `plans` raise, n taken from the list the fixture yields."""
    insert_numbers_that_fail: list[int] = []
    inserts_seen = [0]

    def raise_on_chosen_insert(mapper: object, connection: object, target: PlanRow) -> None:
        inserts_seen[0] += 1
        if inserts_seen[0] in insert_numbers_that_fail:
            raise RuntimeError("simulated crash during insert")

    event.listen(PlanRow, "before_insert", raise_on_chosen_insert)
    try:
        yield insert_numbers_that_fail
    finally:
        event.remove(PlanRow, "before_insert", raise_on_chosen_insert)


# --- round trips -------------------------------------------------------------------------------


def test_default_url_is_sqlite_file() -> None:
    assert DEFAULT_STORE_URL == "sqlite:///hexiseq.db"


def test_save_list_get_round_trip(store: Store) -> None:
    plan_id = _save(store, "one")

    assert store.get_plan_json(plan_id) == _plan_json("one")
    [record] = store.list_plans()
    assert record == PlanRecord(
        id=plan_id,
        created_at=record.created_at,
        label="best",
        cluster_name="mixed-a100-h100",
        model_name="llama-7b",
        seq_len=131072,
        tokens_per_s=12345.5,
        step_time_s=10.6,
        cost_model="datasheet estimate",
    )
    assert record.created_at.tzinfo is not None
    assert record.created_at.utcoffset() == timezone.utc.utcoffset(None)


def test_missing_metrics_round_trip_as_none(store: Store) -> None:
    _save(store, "unknown", tokens_per_s=None, step_time_s=None)

    [record] = store.list_plans()
    assert record.tokens_per_s is None
    assert record.step_time_s is None


def test_list_plans_is_newest_first_and_limited(store: Store) -> None:
    ids = [_save(store, f"plan-{index}", label=f"baseline-{index}") for index in range(4)]

    assert [record.id for record in store.list_plans()] == ids[::-1]
    assert [record.id for record in store.list_plans(limit=2)] == ids[:1:-1]
    assert store.list_plans(limit=0) == []
    created = [record.created_at for record in store.list_plans()]
    assert created == sorted(created, reverse=True)


def test_plans_persist_across_reopen(store_path: Path) -> None:
    with Store.open(_sqlite_url(store_path)) as first:
        first_id = _save(first, "kept")
    with Store.open(_sqlite_url(store_path)) as second:
        second_id = _save(second, "added")
        assert second.get_plan_json(first_id) == _plan_json("kept")
        assert [record.id for record in second.list_plans()] == [second_id, first_id]


def test_open_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store.db"
    with Store.open(_sqlite_url(path)) as store:
        _save(store, "nested")
    assert path.is_file()


def test_in_memory_sqlite_works() -> None:
    with Store.open("sqlite://") as store:
        plan_id = _save(store, "memory")
        assert store.get_plan_json(plan_id) == _plan_json("memory")
        assert [record.id for record in store.list_plans()] == [plan_id]
        assert store.url == "sqlite://"


def test_url_property_masks_password() -> None:
    with Store.open("sqlite://") as store:
        assert store.url == "sqlite://"
    with pytest.raises(InputError) as raised:
        Store.open("mysql://user:secret@localhost/hexiseq")
    assert "secret" not in str(raised.value)


def test_schema_version_is_recorded(store_path: Path) -> None:
    Store.open(_sqlite_url(store_path)).close()
    with sqlite3.connect(store_path) as connection:
        rows = connection.execute("SELECT key, value FROM store_meta").fetchall()
    assert rows == [("schema_version", str(SCHEMA_VERSION))]


# --- transactions ------------------------------------------------------------------------------


def test_failed_insert_in_transaction_leaves_nothing_half_written(
    store: Store, fail_on_plan_insert: list[int]
) -> None:
    committed_id = _save(store, "committed before")
    fail_on_plan_insert.append(3)  # insert 1 was above; inserts 2 and 3 share a transaction

    with pytest.raises(RuntimeError, match="simulated crash"), store.transaction():
        _save(store, "first of pair")
        _save(store, "second of pair")

    assert [record.id for record in store.list_plans()] == [committed_id]
    assert store.get_plan_json(committed_id) == _plan_json("committed before")


def test_failed_single_save_writes_nothing(store: Store, fail_on_plan_insert: list[int]) -> None:
    committed_id = _save(store, "committed before")
    fail_on_plan_insert.append(2)

    with pytest.raises(RuntimeError, match="simulated crash"):
        _save(store, "crashes")

    assert [record.id for record in store.list_plans()] == [committed_id]
    later_id = _save(store, "after the crash")
    assert [record.id for record in store.list_plans()] == [later_id, committed_id]


def test_error_raised_by_caller_rolls_back_transaction(store_path: Path) -> None:
    with Store.open(_sqlite_url(store_path)) as store:
        committed_id = _save(store, "committed before")
        with pytest.raises(KeyboardInterrupt), store.transaction():
            _save(store, "in flight")
            raise KeyboardInterrupt
    with Store.open(_sqlite_url(store_path)) as reopened:
        assert [record.id for record in reopened.list_plans()] == [committed_id]


def test_transaction_commits_all_writes_and_reads_see_them(store: Store) -> None:
    with store.transaction():
        first_id = _save(store, "first")
        with store.transaction():  # nested blocks join the outer one
            second_id = _save(store, "second")
        assert store.get_plan_json(first_id) == _plan_json("first")
    assert [record.id for record in store.list_plans()] == [second_id, first_id]


# --- bad input ---------------------------------------------------------------------------------


def test_unparsable_url_is_input_error() -> None:
    with pytest.raises(
        InputError, match=r"store URL 'not a url' cannot be parsed; allowed: sqlite"
    ):
        Store.open("not a url")


@pytest.mark.parametrize(
    "url",
    ["mysql://user@localhost/hexiseq", "nosuchdialect://host/db", "oracle://scott@host/db"],
)
def test_unsupported_dialect_is_input_error(url: str) -> None:
    with pytest.raises(
        InputError,
        match=r"unsupported dialect .*allowed: sqlite:///PATH.*postgresql\+psycopg://.*\[postgres\]",
    ):
        Store.open(url)


def test_missing_postgresql_driver_is_input_error() -> None:
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("psycopg2 is installed")
    with pytest.raises(
        InputError, match=r"needs database driver 'psycopg2', which is not installed"
    ):
        Store.open("postgresql+psycopg2://user:secret@localhost/hexiseq")


def test_unreachable_path_is_input_error(tmp_path: Path) -> None:
    directory = tmp_path / "a_directory.db"
    directory.mkdir()
    with pytest.raises(InputError, match=r"store sqlite:///.*a_directory\.db cannot be opened: "):
        Store.open(_sqlite_url(directory))


def test_parent_that_is_a_file_is_input_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be\n")
    with pytest.raises(InputError, match=r"cannot be opened: cannot create directory"):
        Store.open(_sqlite_url(blocker / "store.db"))


def test_text_file_is_not_a_store(tmp_path: Path) -> None:
    text_file = tmp_path / "notes.db"
    text_file.write_text("these are my notes, not a database\n" * 10)
    with pytest.raises(
        InputError,
        match=r"store sqlite:///.*notes\.db is not a hexiseq store: file is not a database",
    ):
        Store.open(_sqlite_url(text_file))
    assert text_file.read_text().startswith("these are my notes")


def _set_schema_version(path: Path, value: str) -> None:
    with sqlite3.connect(path) as connection:
        connection.execute(
            "UPDATE store_meta SET value = ? WHERE key = 'schema_version'", (value,)
        )


def test_newer_schema_version_is_refused(store_path: Path) -> None:
    Store.open(_sqlite_url(store_path)).close()
    _set_schema_version(store_path, str(SCHEMA_VERSION + 1))
    with pytest.raises(
        InputError,
        match=rf"has schema_version {SCHEMA_VERSION + 1}, newer than this hexiseq knows "
        rf"\({SCHEMA_VERSION}\); upgrade hexiseq",
    ):
        Store.open(_sqlite_url(store_path))


def test_garbled_schema_version_is_not_a_store(store_path: Path) -> None:
    Store.open(_sqlite_url(store_path)).close()
    _set_schema_version(store_path, "banana")
    with pytest.raises(InputError, match=r"is not a hexiseq store: schema_version 'banana'"):
        Store.open(_sqlite_url(store_path))


def test_unknown_plan_id_lists_ids_present(store: Store) -> None:
    with pytest.raises(InputError, match=r"has no plan with id 7 \(ids present: none\)"):
        store.get_plan_json(7)
    ids = [_save(store, f"plan-{index}") for index in range(7)]
    newest_five = ", ".join(str(plan_id) for plan_id in ids[::-1][:5])
    with pytest.raises(
        InputError,
        match=rf"store sqlite:///.* has no plan with id 999 "
        rf"\(ids present: {newest_five} and 2 more\)",
    ):
        store.get_plan_json(999)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seq_len": 0}, r"seq_len must be a positive integer, got 0"),
        ({"seq_len": 1.5}, r"seq_len must be a positive integer"),
        ({"label": ""}, r"label must be a non-empty string"),
        ({"cost_model": "  "}, r"cost_model must be a non-empty string"),
        ({"tokens_per_s": float("nan")}, r"tokens_per_s must be finite and >= 0, got nan"),
        ({"step_time_s": -1.0}, r"step_time_s must be finite and >= 0"),
        ({"step_time_s": "fast"}, r"step_time_s must be a number or None"),
    ],
)
def test_bad_plan_fields_are_input_errors(
    store: Store, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(InputError, match=message):
        _save(store, "bad", **overrides)
    assert store.list_plans() == []


def test_plan_json_must_be_json(store: Store) -> None:
    with pytest.raises(InputError, match=r"plan_json is not valid JSON"):
        store.save_plan(
            "{not json",
            label="best",
            cluster_name="c",
            model_name="m",
            seq_len=1,
            tokens_per_s=None,
            step_time_s=None,
            cost_model="datasheet estimate",
        )


def test_negative_limit_is_input_error(store: Store) -> None:
    with pytest.raises(InputError, match=r"limit must be None or an integer >= 0, got -1"):
        store.list_plans(limit=-1)


def test_schema_compiles_for_postgresql() -> None:
    """No SQLite-only constructs: every table's DDL and the list query compile for PostgreSQL."""
    dialect = postgresql.dialect()
    ddl = {
        table.name: str(CreateTable(table).compile(dialect=dialect))
        for table in StoreBase.metadata.sorted_tables
    }
    assert set(ddl) >= {"store_meta", "plans"}
    assert "SERIAL" in ddl["plans"] or "IDENTITY" in ddl["plans"]
    assert "TIMESTAMP WITH TIME ZONE" in ddl["plans"]
    query = select(PlanRow).order_by(PlanRow.created_at.desc()).limit(3)
    assert "LIMIT" in str(query.compile(dialect=dialect))


# --- PostgreSQL (only when a disposable test database is given) ---------------------------------


@pytest.fixture
def postgresql_url(postgresql_database: str) -> Iterator[str]:
    """URL of a new, empty PostgreSQL database (tests/conftest.py)."""
    yield postgresql_database


def test_postgresql_round_trip_and_transactions(
    postgresql_url: str, fail_on_plan_insert: list[int]
) -> None:
    with Store.open(postgresql_url) as store:
        first_id = _save(store, "first")
        second_id = _save(store, "second", tokens_per_s=None)
        fail_on_plan_insert.append(4)
        with pytest.raises(RuntimeError, match="simulated crash"), store.transaction():
            _save(store, "third")
            _save(store, "fourth")
    with Store.open(postgresql_url) as reopened:
        records = reopened.list_plans()
        assert [record.id for record in records] == [second_id, first_id]
        assert records[0].tokens_per_s is None
        assert records[0].created_at.utcoffset() == timezone.utc.utcoffset(None)
        assert reopened.get_plan_json(first_id) == _plan_json("first")
        with pytest.raises(InputError, match=rf"ids present: {second_id}, {first_id}\)"):
            reopened.get_plan_json(999)


def test_postgresql_newer_schema_version_is_refused(postgresql_url: str) -> None:
    Store.open(postgresql_url).close()
    engine = create_engine(postgresql_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE store_meta SET value = '99' WHERE key = 'schema_version'"))
    engine.dispose()
    with pytest.raises(InputError, match=r"has schema_version 99, newer than this hexiseq knows"):
        Store.open(postgresql_url)
