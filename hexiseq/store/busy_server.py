"""A PostgreSQL server that refuses a connection only for a moment, with "too many clients
already" (every slot of its `max_connections` taken, as when dozens of processes open one store
or one study at once), is asked again with a growing pause for up to `BUSY_SERVER_WAIT_S`
before the refusal stands (then it is the caller's one-line error, as before).

A SQLAlchemy engine plugin (`ENGINE_PLUGIN`, named in `create_engine(plugins=...)`), so the
store's engines and the Optuna storage's (through `RDBStorage(engine_kwargs=...)`) get it
alike, before their first connection.
"""

from __future__ import annotations

import time

from sqlalchemy import event
from sqlalchemy.dialects import plugins
from sqlalchemy.engine import URL, CreateEnginePlugin, Engine

ENGINE_PLUGIN = "hexiseq_busy_server"
BUSY_SERVER_WAIT_S = 60.0
"""How long a connection refused for "too many clients" is asked for again."""
_FIRST_PAUSE_S = 0.05
_LONGEST_PAUSE_S = 2.0
_TOO_MANY_CONNECTIONS = "53300"
"""PostgreSQL's SQLSTATE for "sorry, too many clients already"."""


class BusyServerPlugin(CreateEnginePlugin):
    """Connects a PostgreSQL engine patiently (`connect_patiently`); other engines as they are."""

    def update_url(self, url: URL) -> URL:
        return url  # the plugin takes no URL arguments

    def engine_created(self, engine: Engine) -> None:
        if engine.dialect.name == "postgresql":
            event.listen(engine, "do_connect", connect_patiently)


plugins.register(ENGINE_PLUGIN, __name__, BusyServerPlugin.__name__)


def connect_patiently(dialect, _record, cargs, cparams):
    """The DBAPI connection, asked for again while the server says it has too many clients."""
    dbapi = dialect.loaded_dbapi
    deadline = time.monotonic() + BUSY_SERVER_WAIT_S
    pause_s = _FIRST_PAUSE_S
    while True:
        try:
            return dbapi.connect(*cargs, **cparams)
        except dbapi.OperationalError as error:
            if not is_out_of_slots(error) or time.monotonic() + pause_s > deadline:
                raise
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, _LONGEST_PAUSE_S)


def is_out_of_slots(error: Exception) -> bool:
    """Whether a driver's error is the server refusing for want of a connection slot: all of
    `max_connections` ("too many clients already") or a role's or database's connection limit
    ("too many connections for role ..."). psycopg 3 gives no SQLSTATE for a refused
    connection, so the message decides where the code is missing."""
    state = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    text = str(error).lower()
    return state == _TOO_MANY_CONNECTIONS or any(
        sign in text for sign in ("too many clients", "too many connections")
    )
