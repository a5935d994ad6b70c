"""Several processes creating one new store and one new Optuna study at the same moment:
every one of them gets it (schema-creation races are retried, not reported)."""

from __future__ import annotations

import multiprocessing

PROCESSES = 6


def open_store(url: str) -> str:
    from hexiseq.store import Store

    try:
        Store.open(url).list_plans()
    except Exception as error:  # noqa: BLE001 - the test reports whatever went wrong
        return f"{type(error).__name__}: {error}"
    return "ok"


def open_study(url: str) -> str:
    from hexiseq.search.studies import create_study

    try:
        create_study(url, "shared", 0, False)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "ok"


def test_many_processes_create_one_store_and_one_study(tmp_path):
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        for round_ in range(2):
            store = f"sqlite:///{tmp_path / f'store-{round_}.db'}"
            study = f"sqlite:///{tmp_path / f'study-{round_}.db'}"
            assert pool.map(open_store, [store] * PROCESSES) == ["ok"] * PROCESSES
            assert pool.map(open_study, [study] * PROCESSES) == ["ok"] * PROCESSES


def test_many_processes_create_one_store_and_one_study_on_postgresql(postgresql_database):
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        assert pool.map(open_store, [postgresql_database] * PROCESSES) == ["ok"] * PROCESSES
        assert pool.map(open_study, [postgresql_database] * PROCESSES) == ["ok"] * PROCESSES
