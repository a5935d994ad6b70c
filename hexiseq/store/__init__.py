"""The one persistent store of hexiseq: plans, runtime runs, profile runs, fitted models.

One SQLAlchemy URL names it: `sqlite:///PATH` (embedded, the default `sqlite:///hexiseq.db`) or
`postgresql://USER@HOST/DB`; both behave the same because only portable ORM constructs are used.
Every command takes it from `--store`, else $HEXISEQ_STORE_URL (`store_url_from`); a password in
it is masked wherever a URL is shown (`Store.url`, errors: `mask_url_passwords`).
Every write runs in a transaction (`Session.begin()`), so a crash or Ctrl-C loses only the write in
flight, never what was committed before it. `Store.transaction()` groups several writes into one.

The tables live in `hexiseq.store.runtime` (runtime runs and measurements),
`hexiseq.store.replans` (re-plans of `hexiseq run` launches) and `hexiseq.store.profiles`
(profiling sweeps, fitted models) beside the plans here; `Store` gets their methods from those
modules' mixins. Only migrations (`hexiseq.migrations`, Alembic) create or alter tables:
`Store.open` applies those a store lacks, so a store written by an earlier hexiseq opens with
every row. Changing a table is changing its mapped class and adding a migration to match (a
test compares the two).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import sqlalchemy
from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Float,
    String,
    Text,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import (
    IntegrityError,
    OperationalError,
    ProgrammingError,
    SQLAlchemyError,
)
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import NullPool

from hexiseq import migrations
from hexiseq.errors import InputError, StoreError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.store.base import (
    StoreBase,
    StoreMetaRow,
    as_utc,
    check_optional_metric,
    check_plan_fields,
    utc_now,
)
from hexiseq.store.busy_server import ENGINE_PLUGIN
from hexiseq.store.profiles import (
    ProfileTables,
)
from hexiseq.store.replans import REPLAN_REASONS, Replan, ReplanRecord, ReplanTables
from hexiseq.store.runtime import (
    LAUNCH_ID_ENV,
    MEMORY_MEASURES,
    RUN_STATUSES,
    RuntimeMeasurement,
    RuntimeTables,
)
from hexiseq.store.urls import (
    DEFAULT_STORE_URL,
    OPTUNA_STORAGE_ENV,
    STORE_URL_ENV,
    STORE_URL_HELP,
    child_environment,
    display_url,
    mask_url_passwords,
    parse_database_url,
    store_url_from,
)

__all__ = [
    "DEFAULT_STORE_URL",
    "LAUNCH_ID_ENV",
    "MEMORY_MEASURES",
    "RUN_STATUSES",
    "SCHEMA_VERSION",
    "OPTUNA_STORAGE_ENV",
    "STORE_URL_ENV",
    "STORE_URL_HELP",
    "PlanRecord",
    "PlanRow",
    "REPLAN_REASONS",
    "Replan",
    "ReplanRecord",
    "RuntimeMeasurement",
    "Store",
    "StoreBase",
    "child_environment",
    "display_url",
    "mask_url_passwords",
    "parse_database_url",
    "store_url_from",
]

SCHEMA_VERSION = 2
"""Version of the table layout this code writes (set by its newest migration in
`hexiseq.migrations`); a store with a higher one is refused, a lower one is migrated."""

_SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_ALLOWED_URLS = (
    "allowed: sqlite:///PATH, sqlite:// (in memory), "
    "postgresql+psycopg://USER:PASSWORD@HOST/DB (needs psycopg 3: pip install 'hexiseq[postgres]')"
)
_IDS_SHOWN_IN_ERRORS = 5


class PlanRow(StoreBase):
    """One saved plan: summary columns to list and filter by, plus the full plan JSON document."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    label: Mapped[str] = mapped_column(String)
    cluster_name: Mapped[str] = mapped_column(String)
    model_name: Mapped[str] = mapped_column(String)
    seq_len: Mapped[int]
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    cost_model: Mapped[str] = mapped_column(String)
    plan_json: Mapped[str] = mapped_column(Text)


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """Summary of a saved plan (everything but the JSON document)."""

    id: int
    created_at: datetime
    """When the plan was saved, timezone-aware UTC."""
    label: str
    """"best" for the searched plan, or the name of a baseline planner."""
    cluster_name: str
    model_name: str
    seq_len: int
    """Tokens per training sequence."""
    tokens_per_s: float | None
    """Predicted (or measured) throughput; None when unknown."""
    step_time_s: float | None
    """Predicted (or measured) time of one training step; None when unknown."""
    cost_model: str
    """What produced the numbers, e.g. "datasheet estimate" or a fitted model's name."""

    @classmethod
    def from_row(cls, row: PlanRow) -> PlanRecord:
        """Copy the summary columns out of an ORM row; naive timestamps are read as UTC."""
        return cls(
            id=row.id,
            created_at=as_utc(row.created_at),
            label=row.label,
            cluster_name=row.cluster_name,
            model_name=row.model_name,
            seq_len=row.seq_len,
            tokens_per_s=row.tokens_per_s,
            step_time_s=row.step_time_s,
            cost_model=row.cost_model,
        )


class Store(RuntimeTables, ReplanTables, ProfileTables):
    """A hexiseq store behind one SQLAlchemy URL. Build it with `Store.open(url)`.

    Usable as a context manager (`with Store.open(url) as store: ...`), which closes it on exit.
    """

    def __init__(self, engine: Engine, display_url: str) -> None:
        """Wrap an engine whose schema is already checked; call `Store.open` instead."""
        self._engine = engine
        self._display_url = display_url
        self._session_factory = sessionmaker(engine, expire_on_commit=False)
        # The session of the `transaction()` block open in this thread, if any.
        self._open_transaction = threading.local()

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> Store:
        """Open the store at `url` (None: $HEXISEQ_STORE_URL, else `DEFAULT_STORE_URL`),
        creating missing tables.

        For a SQLite file the parent directory is created if missing; with `create=False`
        (a command that only reads) a SQLite file that does not exist is an InputError
        instead, so that a mistyped path leaves no empty store behind.
        Raises InputError (one line naming the URL and what is allowed) when the URL cannot be
        parsed, names an unsupported dialect or a driver that is not installed, cannot be opened,
        is not a hexiseq store, or holds a schema_version newer than this code knows. No
        message shows the URL's password.
        """
        parsed_url = _parse_store_url(store_url_from(url))
        shown_url = display_url(parsed_url)
        if not create:
            _refuse_missing_sqlite_file(parsed_url, shown_url)
        engine = _create_store_engine(parsed_url, shown_url)
        try:
            _prepare_schema(engine, shown_url)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, shown_url)

    @property
    def url(self) -> str:
        """The store's URL as text, with any password masked as `***`."""
        return self._display_url

    def close(self) -> None:
        """Release the store's database connections; the Store must not be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self._display_url!r})"

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Make every write inside the block (in this thread) one transaction: all or nothing.

        Commits when the block ends normally; rolls back if it raises. Nested blocks join the
        outermost one.
        """
        if getattr(self._open_transaction, "session", None) is not None:
            yield
            return
        with self._database_errors(), self._session_factory.begin() as session:
            self._open_transaction.session = session
            try:
                yield
            finally:
                self._open_transaction.session = None

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """A session inside a transaction: the open `transaction()` one, else a fresh one."""
        open_session = getattr(self._open_transaction, "session", None)
        if open_session is not None:
            yield open_session
            return
        with self._database_errors(), self._session_factory.begin() as session:
            yield session

    @contextmanager
    def _database_errors(self) -> Iterator[None]:
        """The database refusing a valid request (a full disk, a read-only or locked file, a
        lost server) as one `StoreError` line naming the store; the transaction rolled back."""
        try:
            yield
        except OperationalError as error:
            raise StoreError(f"store {self._display_url}: {_one_line(error)}") from None

    def save_plan(
        self,
        plan_json: str,
        *,
        label: str,
        cluster_name: str,
        model_name: str,
        seq_len: int,
        tokens_per_s: float | None,
        step_time_s: float | None,
        cost_model: str,
    ) -> int:
        """Save one plan (its full JSON document plus summary columns) and return its new id.

        Raises InputError if `plan_json` is not a JSON document, a name is empty, `seq_len` is not
        a positive integer, or a metric is negative, NaN or infinite.
        """
        check_plan_fields(plan_json, label, cluster_name, model_name, seq_len, cost_model)
        check_optional_metric("tokens_per_s", tokens_per_s)
        check_optional_metric("step_time_s", step_time_s)
        row = PlanRow(
            label=label,
            cluster_name=cluster_name,
            model_name=model_name,
            seq_len=seq_len,
            tokens_per_s=None if tokens_per_s is None else float(tokens_per_s),
            step_time_s=None if step_time_s is None else float(step_time_s),
            cost_model=cost_model,
            plan_json=plan_json,
        )
        with self._session() as session:
            session.add(row)
            session.flush()  # assigns the id
            return row.id

    def save_search_result(
        self, best: Plan, baselines: Mapping[str, Plan | InfeasiblePlan], best_label: str = "best"
    ) -> int:
        """Save a search's best plan (labelled `best_label`), then each feasible baseline
        (labelled by its name), in one transaction; returns the best plan's id."""
        with self.transaction():
            best_id = self.save_plan_object(best, best_label)
            for name, baseline in baselines.items():
                if isinstance(baseline, Plan):
                    self.save_plan_object(baseline, name)
        return best_id

    def save_plan_object(self, plan: Plan, label: str) -> int:
        """`save_plan` of a `Plan`, its summary columns taken from the plan itself."""
        return self.save_plan(
            plan.to_json_text(),
            label=label,
            cluster_name=plan.cluster.name,
            model_name=plan.model.name,
            seq_len=plan.train.seq_len,
            tokens_per_s=plan.predicted.tokens_per_s,
            step_time_s=plan.predicted.step_time_s,
            cost_model=plan.cost_model_summary,
        )

    def list_plans(self, limit: int | None = None) -> list[PlanRecord]:
        """Summaries of saved plans, newest first; at most `limit` of them when given.

        Raises InputError if `limit` is negative.
        """
        if limit is not None and (isinstance(limit, bool) or limit < 0):
            raise InputError(f"limit must be None or an integer >= 0, got {limit!r}")
        query = select(PlanRow).order_by(PlanRow.created_at.desc(), PlanRow.id.desc()).limit(limit)
        with self._session() as session:
            return [PlanRecord.from_row(row) for row in session.scalars(query)]

    def get_plan_json(self, plan_id: int) -> str:
        """The full JSON document of plan `plan_id`.

        Raises InputError naming some of the ids present if there is no such plan.
        """
        with self._session() as session:
            plan_json = session.scalar(select(PlanRow.plan_json).where(PlanRow.id == plan_id))
            if plan_json is not None:
                return plan_json
            raise InputError(
                f"store {self._display_url} has no plan with id {plan_id} "
                f"(ids present: {_describe_plan_ids(session)})"
            )

    def find_plan_id(self, plan_json: str) -> int | None:
        """The id of the newest saved plan whose JSON text is exactly `plan_json`, if any."""
        query = (
            select(PlanRow.id).where(PlanRow.plan_json == plan_json).order_by(PlanRow.id.desc())
        )
        with self._session() as session:
            return session.scalars(query).first()


def _describe_plan_ids(session: Session) -> str:
    """The newest few plan ids, e.g. "9, 8, 7, 6, 5 and 4 more", or "none"."""
    newest_ids = session.scalars(
        select(PlanRow.id).order_by(PlanRow.id.desc()).limit(_IDS_SHOWN_IN_ERRORS)
    ).all()
    if not newest_ids:
        return "none"
    total = session.scalar(select(func.count()).select_from(PlanRow)) or 0
    shown = ", ".join(str(plan_id) for plan_id in newest_ids)
    hidden = total - len(newest_ids)
    return f"{shown} and {hidden} more" if hidden > 0 else shown


def _one_line(error: BaseException) -> str:
    """The first line of an error's message, without SQLAlchemy's "(Background on ...)" tail;
    a URL a driver echoes in it shows no password."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()
    return mask_url_passwords(text[0]) if text else type(original).__name__


def _parse_store_url(url: str) -> URL:
    """Parse `url`; raise InputError unless it is a SQLite or PostgreSQL SQLAlchemy URL."""
    parsed_url = parse_database_url(url, "store URL", _ALLOWED_URLS)
    backend = parsed_url.get_backend_name()
    if backend not in _SUPPORTED_BACKENDS:
        shown = display_url(parsed_url)
        raise InputError(
            f"store URL {shown!r} uses unsupported dialect {backend!r}; {_ALLOWED_URLS}"
        )
    return parsed_url


def _create_store_engine(parsed_url: URL, shown_url: str) -> Engine:
    """Create the engine (no connection yet); raise InputError if the driver is missing."""
    if parsed_url.get_backend_name() == "sqlite":
        _make_sqlite_parent_directory(parsed_url, shown_url)
    sqlite = parsed_url.get_backend_name() == "sqlite"
    try:
        return create_engine(
            parsed_url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S} if sqlite else {},
            plugins=[ENGINE_PLUGIN],  # a PostgreSQL server out of connection slots is waited for
        )
    except ImportError as error:
        raise InputError(
            f"store URL {shown_url!r} needs database driver {error.name!r}, which is not "
            f"installed; {_ALLOWED_URLS}"
        ) from None
    except (SQLAlchemyError, TypeError, ValueError) as error:
        raise InputError(f"store URL {shown_url!r} is not usable: {_one_line(error)}") from None


def _refuse_missing_sqlite_file(parsed_url: URL, shown_url: str) -> None:
    database = parsed_url.database or ""
    on_disk = parsed_url.get_backend_name() == "sqlite" and not _in_memory(parsed_url)
    if on_disk and not database.startswith("file:") and not Path(database).is_file():
        raise InputError(
            f"store {shown_url}: no such SQLite file {database}; give the store the data was "
            "saved to (--store or $HEXISEQ_STORE_URL)"
        )


def _make_sqlite_parent_directory(parsed_url: URL, shown_url: str) -> None:
    """Create the directory that will hold a SQLite database file, if it is missing."""
    database = parsed_url.database
    is_uri = str(parsed_url.query.get("uri", "")).lower() in ("true", "1")
    if not database or database == ":memory:" or is_uri:
        return
    parent = Path(database).expanduser().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(
            f"store {shown_url} cannot be opened: cannot create directory {str(parent)!r}: "
            f"{error.strerror or error}"
        ) from None


SCHEMA_RACE_ATTEMPTS = 8
T = TypeVar("T")


def retry_schema_race(create: Callable[[], T], attempts: int = SCHEMA_RACE_ATTEMPTS) -> T:
    """`create()`, tried again when another process creating the same schema at the same
    moment made it fail (a table or row that "already exists", a locked SQLite file): the
    second try finds the schema in place."""
    for attempt in range(attempts):
        try:
            return create()
        except (OperationalError, IntegrityError, ProgrammingError) as error:
            if attempt == attempts - 1 or not _is_schema_race(error):
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def _is_schema_race(error: SQLAlchemyError) -> bool:
    text = str(error).lower()
    return any(
        sign in text
        for sign in (
            "already exists",  # SQLite, and PostgreSQL's DuplicateTable
            "database is locked",
            "unique constraint",
            "duplicate",
        )
    )


def _prepare_schema(engine: Engine, display_url: str) -> None:
    """Bring the store to this hexiseq's schema: nothing to do (and nothing written) when it is
    there already; else every missing migration, applied under a lock that makes concurrent
    openers of one new or old store wait for each other (tried again on a lost race).

    Raises InputError if the database cannot be reached, is not a hexiseq store, or is newer.
    """
    try:
        engine.connect().close()
    except SQLAlchemyError as error:
        raise InputError(f"store {display_url} cannot be opened: {_one_line(error)}") from None
    try:
        with engine.connect() as connection:
            if _schema_state(connection, display_url) == "current":
                return
        retry_schema_race(lambda: _migrate(engine, display_url))
    except OperationalError as error:
        # Reachable but refused: read-only file, locked, a foreign table named like ours, ...
        reason = _one_line(error)
        raise InputError(
            f"store {display_url} cannot be used as a hexiseq store: {reason}"
        ) from None
    except SQLAlchemyError as error:
        raise InputError(
            f"store {display_url} is not a hexiseq store: {_one_line(error)}"
        ) from None


def _migrate(engine: Engine, display_url: str) -> None:
    """Apply the missing migrations in one transaction holding the store's schema lock."""
    with _schema_lock(engine) as connection:
        if _schema_state(connection, display_url) == "current":
            return
        migrations.upgrade_to_head(connection)
        if _schema_state(connection, display_url) != "current":
            raise AssertionError(f"store {display_url}: migrations did not reach the head")


SQLITE_BUSY_TIMEOUT_S = 60.0
"""How long a SQLite write waits for another process's write lock before it gives up (the
driver's default, 5 s, is too short for dozens of processes writing one store at once)."""
_POSTGRESQL_SCHEMA_LOCK = 0x6865786973657121
"""pg_advisory_xact_lock key of hexiseq's schema migrations ("hexiseq!")."""
_SQLITE_LOCK_TIMEOUT_S = 30.0


@contextmanager
def _schema_lock(engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction that holds the store's write lock from its first
    statement (SQLite: BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock), so
    that its DDL and data changes commit together or not at all and one opener migrates at a
    time. SQLite's driver would otherwise run each DDL statement outside any transaction."""
    if engine.dialect.name != "sqlite" or _in_memory(engine.url):
        with engine.begin() as connection:
            if engine.dialect.name == "postgresql":
                lock = sqlalchemy.text("SELECT pg_advisory_xact_lock(:key)")
                connection.execute(lock, {"key": _POSTGRESQL_SCHEMA_LOCK})
            yield connection
        return
    locking = create_engine(
        engine.url, poolclass=NullPool, connect_args={"timeout": _SQLITE_LOCK_TIMEOUT_S}
    )
    event.listen(locking, "connect", _driver_leaves_transactions_to_us)
    event.listen(
        locking, "begin", lambda connection: connection.exec_driver_sql("BEGIN IMMEDIATE")
    )
    try:
        with locking.begin() as connection:
            yield connection
    finally:
        locking.dispose()


def _driver_leaves_transactions_to_us(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None


def _begin_immediate(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _in_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def _schema_state(connection: Connection, display_url: str) -> str:
    """ "new" (no tables), "old" (a hexiseq store that lacks migrations) or "current".

    Raises InputError for a database that is someone else's (tables but no `store_meta`), a
    `schema_version` that is not an integer, and a store written by a newer hexiseq (a higher
    `schema_version`, or a revision this hexiseq does not know).
    """
    tables = set(sqlalchemy.inspect(connection).get_table_names())
    if not tables:
        return "new"
    _refuse_foreign(tables, display_url)
    stored = connection.execute(
        select(StoreMetaRow.value).where(StoreMetaRow.key == "schema_version")
    ).scalar_one_or_none()
    if stored is not None:
        _check_schema_version(stored, display_url)
    try:
        revision = (
            migrations.current_revision(connection) if migrations.VERSION_TABLE in tables else None
        )
    except ValueError as error:
        raise InputError(
            f"store {display_url} cannot be read: {error}; restore it from a copy or use "
            "another store"
        ) from None
    if revision == migrations.HEAD_REVISION:
        return "current"  # no Alembic needed (`hexiseq.migrations`)
    if revision is not None and not migrations.is_known(revision):
        raise InputError(
            f"store {display_url} has schema revision {revision!r}, newer than this hexiseq "
            f"knows ({migrations.head_revision()}); upgrade hexiseq or use another store"
        )
    return "old"


def _refuse_foreign(tables: set[str], display_url: str) -> None:
    """A database with tables but no hexiseq metadata is someone else's: write nothing to it."""
    if StoreMetaRow.__tablename__ not in tables:
        names = sorted(tables)
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise InputError(
            f"store {display_url} is not a hexiseq store: it holds tables ({shown}) but no "
            f"{StoreMetaRow.__tablename__}; give a new database or a hexiseq store"
        )


def _check_schema_version(stored: str, display_url: str) -> None:
    """Raise InputError unless `stored` is an integer schema_version this hexiseq can migrate."""
    try:
        stored_version = int(stored)
    except ValueError:
        raise InputError(
            f"store {display_url} is not a hexiseq store: schema_version {stored!r} "
            "is not an integer"
        ) from None
    if stored_version > SCHEMA_VERSION:
        raise InputError(
            f"store {display_url} has schema_version {stored_version}, newer than this hexiseq "
            f"knows ({SCHEMA_VERSION}); upgrade hexiseq or use another store"
        )
    if stored_version < 1:
        raise InputError(
            f"store {display_url} has schema_version {stored_version}; hexiseq stores start "
            f"at 1 (this hexiseq writes {SCHEMA_VERSION})"
        )
