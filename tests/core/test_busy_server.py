"""A PostgreSQL server out of connection slots is waited for, not a failure: a driver that
refuses twice with "too many clients" connects on the third try; any other refusal, or one
that outlasts the wait, stands. On a real server: a store opens under a role whose one
connection slot is taken until a moment later."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from hexiseq.store import Store
from hexiseq.store import busy_server as _busy_server


class _RefusedError(Exception):
    pass


class _Driver:
    """A DBAPI module whose connect fails with `errors` in turn, then connects."""

    OperationalError = _RefusedError

    def __init__(self, *errors: str) -> None:
        self.errors, self.calls = list(errors), 0

    def connect(self, *args, **kwargs):
        self.calls += 1
        if self.errors:
            raise _RefusedError(self.errors.pop(0))
        return ("connection", args, kwargs)


class _Dialect:
    def __init__(self, driver: _Driver) -> None:
        self.loaded_dbapi = driver


FULL = "connection failed: FATAL:  sorry, too many clients already"


def test_a_full_server_is_asked_again_until_it_has_a_slot(monkeypatch):
    monkeypatch.setattr(_busy_server, "_FIRST_PAUSE_S", 0.001)
    driver = _Driver(FULL, 'FATAL:  too many connections for role "x"')
    connection = _busy_server.connect_patiently(_Dialect(driver), None, ("dsn",), {"a": 1})
    assert connection == ("connection", ("dsn",), {"a": 1}) and driver.calls == 3


def test_another_refusal_is_not_waited_for(monkeypatch):
    driver = _Driver('FATAL:  password authentication failed for user "x"')
    with pytest.raises(_RefusedError, match="password authentication"):
        _busy_server.connect_patiently(_Dialect(driver), None, (), {})
    assert driver.calls == 1


def test_a_server_full_for_longer_than_the_wait_is_refused(monkeypatch):
    monkeypatch.setattr(_busy_server, "BUSY_SERVER_WAIT_S", 0.05)
    monkeypatch.setattr(_busy_server, "_FIRST_PAUSE_S", 0.01)
    driver = _Driver(*[FULL] * 1000)
    with pytest.raises(_RefusedError, match="too many clients"):
        _busy_server.connect_patiently(_Dialect(driver), None, (), {})
    assert 2 <= driver.calls < 1000


def test_a_store_opens_once_a_taken_slot_is_freed(postgresql_database):
    server = make_url(postgresql_database)
    role = f"hexiseq_one_slot_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1'))
        connection.execute(text(f'GRANT ALL ON DATABASE "{server.database}" TO "{role}"'))
        connection.execute(text(f'GRANT ALL ON SCHEMA public TO "{role}"'))
    url = server.set(username=role, password=None).render_as_string(hide_password=False)
    holder = create_engine(url, poolclass=NullPool).connect()  # the role's one slot, taken
    try:
        with pytest.raises(Exception, match="too many connections"):
            create_engine(url).connect()  # a plain engine is refused at once
        threading.Timer(1.0, holder.close).start()
        started = time.monotonic()
        with Store.open(url) as store:
            assert store.list_plans() == []
        assert time.monotonic() - started >= 0.5  # it waited for the slot
    finally:
        holder.close()
        with admin.connect() as connection:
            connection.execute(text(f'DROP OWNED BY "{role}"'))
            connection.execute(text(f'DROP ROLE "{role}"'))
        admin.dispose()
