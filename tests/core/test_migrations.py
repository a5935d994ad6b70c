"""The store's schema migrations (`hexiseq.migrations`): a new store's tables are exactly the
mapped classes, a store written by an earlier hexiseq opens with every row, a failed migration
changes nothing, a newer store is refused, and concurrent openers of one old store all succeed."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from hexiseq import migrations
from hexiseq.errors import InputError
from hexiseq.store import SCHEMA_VERSION, Store, StoreBase

VERSION_1_STORE = Path(__file__).with_name("data") / "store-v1.db"
"""A store written by hexiseq cde2901 (schema version 1, before migrations): 4 plans, a CPU
`hexiseq run` of 2 steps on 4 ranks, a quick CPU profile and its fit."""


def _schema_differences(url: str) -> list[object]:
    """What Alembic's autogenerate would change to make the store's tables the mapped ones."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection,
                opts={
                    "include_object": lambda _o, name, kind, *_: (
                        not (kind == "table" and name == migrations.VERSION_TABLE)
                    )
                },
            )
            return compare_metadata(context, StoreBase.metadata)
    finally:
        engine.dispose()


def _row_counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as connection:
        tables = [
            t for (t,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
        ]
        return {t: connection.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}


def _old_store(tmp_path: Path) -> Path:
    path = tmp_path / "v1.db"
    shutil.copy(VERSION_1_STORE, path)
    return path


def test_a_new_store_has_exactly_the_mapped_tables(tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    Store.open(url).close()
    assert _schema_differences(url) == []


def test_a_new_postgresql_store_has_exactly_the_mapped_tables(postgresql_database):
    Store.open(postgresql_database).close()
    assert _schema_differences(postgresql_database) == []


def test_a_version_1_store_opens_migrated_with_every_row(tmp_path):
    path = _old_store(tmp_path)
    before = _row_counts(path)
    assert "runtime_runs" in before and migrations.VERSION_TABLE not in before
    with Store.open(f"sqlite:///{path}") as store:
        (run,) = store.list_runtime_runs()
        plans = store.list_plans()
        fitted = store.latest_fitted_model()
    after = _row_counts(path)
    assert {t: after[t] for t in before} == before
    assert after[migrations.VERSION_TABLE] == 1
    assert _schema_differences(f"sqlite:///{path}") == []
    assert len(plans) == before["plans"] and fitted is not None
    # The run measured both of its 2 steps, so it finished; nothing says why it would have failed.
    assert (run["steps"], run["status"], run["failure"]) == (2, "finished", None)
    with sqlite3.connect(path) as connection:
        version = connection.execute("SELECT value FROM store_meta").fetchall()
    assert version == [(str(SCHEMA_VERSION),)]


def test_an_old_run_with_steps_missing_is_of_unknown_status(tmp_path):
    path = _old_store(tmp_path)
    with sqlite3.connect(path) as connection:
        connection.execute("DELETE FROM runtime_measurements WHERE step = 1")
    with Store.open(f"sqlite:///{path}") as store:
        (run,) = store.list_runtime_runs()
    assert run["status"] == "unknown"


def test_a_store_older_than_some_version_1_tables_gets_them(tmp_path):
    path = _old_store(tmp_path)
    with sqlite3.connect(path) as connection:
        connection.execute("DROP TABLE fitted_models")
    with Store.open(f"sqlite:///{path}") as store:
        assert store.latest_fitted_model() is None
        store.save_fitted_model('{"schema_version": 4}')
    assert _schema_differences(f"sqlite:///{path}") == []


def test_a_migration_that_fails_half_way_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    path = _old_store(tmp_path)
    with sqlite3.connect(path) as connection:
        schema_before = connection.execute(
            "SELECT sql FROM sqlite_master ORDER BY name"
        ).fetchall()
    counts_before = _row_counts(path)
    (last,) = [s for s in migrations._scripts().walk_revisions() if s.revision == "0002"]
    original = last.module.upgrade

    def upgrade_then_crash():
        original()  # its columns are added and the runs updated ...
        raise RuntimeError("the disk went away")  # ... then the process fails

    monkeypatch.setattr(last.module, "upgrade", upgrade_then_crash)
    with pytest.raises(RuntimeError, match="the disk went away"):
        Store.open(f"sqlite:///{path}")
    with sqlite3.connect(path) as connection:
        schema_after = connection.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
    assert schema_after == schema_before and _row_counts(path) == counts_before
    monkeypatch.setattr(last.module, "upgrade", original)
    with Store.open(f"sqlite:///{path}") as store:  # the next open migrates it whole
        assert store.list_runtime_runs()[0]["status"] == "finished"


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        ("UPDATE {table} SET version_num = '0099'", r"schema revision '0099', newer than this"),
        ("INSERT INTO {table} VALUES ('0003')", r"holds 2 revisions \(.*0003.*\), not one"),
    ],
    ids=["newer revision", "two revisions"],
)
def test_a_store_whose_revision_cannot_be_taken_is_refused_untouched(tmp_path, statement, message):
    """A revision this hexiseq does not know (a newer hexiseq's), or two where hexiseq's line
    of revisions keeps one, is refused with a message, the store unchanged."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    Store.open(url).close()
    with sqlite3.connect(tmp_path / "s.db") as connection:
        connection.execute(statement.format(table=migrations.VERSION_TABLE))
    before = (tmp_path / "s.db").read_bytes()
    with pytest.raises(InputError, match=message):
        Store.open(url)
    assert (tmp_path / "s.db").read_bytes() == before


def test_the_head_revision_constant_is_alembics_head():
    """`HEAD_REVISION` lets a current store open without Alembic: it must be the newest file's."""
    assert migrations.head_revision() == migrations.HEAD_REVISION


_OPEN_WITHOUT_ALEMBIC = """
import sys
from hexiseq.store import Store
with Store.open(sys.argv[1]) as store:
    store.list_plans()
print("alembic" in sys.modules)
"""


def test_a_store_at_the_head_opens_without_importing_alembic(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    Store.open(url).close()  # a new store: migrated, with Alembic
    code = [sys.executable, "-c", _OPEN_WITHOUT_ALEMBIC, url]
    done = subprocess.run(code, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_a_read_only_store_at_the_newest_schema_opens(tmp_path):
    path = tmp_path / "s.db"
    Store.open(f"sqlite:///{path}").close()
    path.chmod(0o444)
    with Store.open(f"sqlite:///{path}") as store:
        assert store.list_plans() == []


_OPEN_AND_COUNT = """
import sys
from hexiseq.store import Store
with Store.open(sys.argv[1]) as store:
    print(len(store.list_plans()), store.list_runtime_runs()[0]["status"])
"""


@pytest.mark.multiproc
def test_processes_opening_one_old_store_at_once_all_succeed(tmp_path):
    path = _old_store(tmp_path)
    before = _row_counts(path)
    openers = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AND_COUNT, f"sqlite:///{path}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    results = [(opener.wait(timeout=120), *opener.communicate()) for opener in openers]
    assert [(code, out.strip()) for code, out, _ in results] == [
        (0, f"{before['plans']} finished")
    ] * 6, [err for _, _, err in results]
    after = _row_counts(path)
    assert {t: after[t] for t in before} == before and after[migrations.VERSION_TABLE] == 1
