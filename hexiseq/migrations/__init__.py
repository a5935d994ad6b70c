"""The store's schema migrations (Alembic): the only code that creates or alters its tables.

Each file in `versions/` is one Alembic revision: an `upgrade()` in Alembic operations, tied to
the one before it by `down_revision`. `upgrade_to_head` applies the revisions a store lacks,
in order, inside the caller's transaction, then records the newest in the store's own version
table (`VERSION_TABLE`: not Alembic's default `alembic_version`, which an Optuna study kept in
the same database uses). So a store written by any earlier hexiseq opens with every row, and
a migration that fails half-way leaves the store as it was.

Changing the tables is adding a revision (and editing the mapped classes to match; a test
compares the two): copy the newest file, give it a new `revision`, set `down_revision` to the
newest's, write `upgrade()` with `alembic.op`, set `HEAD_REVISION` below to it (a test checks
that it is Alembic's head), and raise `SCHEMA_VERSION` in `versions/` when an older hexiseq
could no longer read the result.

Opening a store that is at the head needs no Alembic: its revision is read with one query and
compared with `HEAD_REVISION`. Importing Alembic and reading the revision files made opening
the store 0.16-0.20 s of a cold `hexiseq plan` on a 2-core machine, 0.03 s without them
(`benchmarks/cli_latency.py`). Alembic is loaded where a store is older, newer or new.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, text

if TYPE_CHECKING:  # Alembic is imported where a store is opened, not with hexiseq.store
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

__all__ = [
    "HEAD_REVISION",
    "VERSION_TABLE",
    "current_revision",
    "head_revision",
    "upgrade_to_head",
]

VERSION_TABLE = "hexiseq_alembic_version"
"""The table holding the store's Alembic revision."""
HEAD_REVISION = "0004"
"""The newest revision in `versions/` (what Alembic's `get_current_head` finds there)."""

_VERSIONS = Path(__file__).with_name("versions")


@cache
def _scripts() -> ScriptDirectory:
    """The revisions (each file read once per process)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(Path(__file__).parent, version_locations=[_VERSIONS])


def _context(connection: Connection) -> MigrationContext:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})


def head_revision() -> str:
    """The newest revision this hexiseq knows, as Alembic finds it in `versions/`."""
    head = _scripts().get_current_head()
    assert head is not None, "hexiseq/migrations/versions holds no revision"
    return head


def current_revision(connection: Connection) -> str | None:
    """The store's revision (None: a new store, or one from before migrations), read from
    `VERSION_TABLE` with one query. Raises ValueError where the table holds several (hexiseq's
    history has one branch, so Alembic never writes two)."""
    rows = [row[0] for row in connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    if len(rows) > 1:
        raise ValueError(
            f"{VERSION_TABLE} holds {len(rows)} revisions ({', '.join(rows)}), not one"
        )
    return rows[0] if rows else None


def is_known(revision: str) -> bool:
    """Whether `revision` is one of this hexiseq's revisions (a newer hexiseq's is not)."""
    return any(script.revision == revision for script in _scripts().walk_revisions())


def upgrade_to_head(connection: Connection) -> list[str]:
    """Apply, in order and in the caller's transaction, every revision after the store's own
    (all of them for a new store or one from before migrations: the first creates only the
    tables missing), record the head, and return the revisions applied."""
    from alembic.operations import Operations

    scripts = _scripts()
    context = _context(connection)
    current = context.get_current_revision()
    pending = list(scripts.iterate_revisions("heads", current or "base"))
    pending.reverse()
    with Operations.context(context):
        for script in pending:
            script.module.upgrade()
    if pending:
        context.stamp(scripts, "heads")
    return [script.revision for script in pending]
