"""Shared test helpers live beside this file (`cli_runner`); pytest puts this folder on
sys.path because it holds a conftest."""

import os
import uuid
from collections.abc import Iterator

import pytest

POSTGRESQL_URL_VARIABLE = "HEXISEQ_TEST_POSTGRESQL_URL"


@pytest.fixture(autouse=True)
def searches_without_a_helper(monkeypatch):
    """Searches keep their work in the test's process: a helper process forked in one test
    would run that moment's code for later tests that patch it (`search.helper`). The
    helper's own tests allow it again."""
    monkeypatch.setenv("HEXISEQ_SEARCH_HELPER", "off")


@pytest.fixture
def postgresql_database() -> Iterator[str]:
    """URL of a new, empty database on the PostgreSQL server that HEXISEQ_TEST_POSTGRESQL_URL
    names (`.ci/run` starts a private one), dropped afterwards; the test skips without it."""
    server = os.environ.get(POSTGRESQL_URL_VARIABLE)
    if not server:
        pytest.skip(f"set {POSTGRESQL_URL_VARIABLE} to a disposable PostgreSQL server")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"hexiseq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
