"""The one persistent store of hexiseq: plans now; later profile runs, fitted models, runtime runs.

One SQLAlchemy URL names it: `sqlite:///PATH` (embedded, the default `sqlite:///hexiseq.db`) or
`postgresql://USER@HOST/DB`; both behave the same because only portable ORM constructs are used.
Every write runs in a transaction (`Session.begin()`), so a crash or Ctrl-C loses only the write in
flight, never what was committed before it. `Store.transaction()` groups several writes into one.

Adding a table is adding a mapped subclass of `StoreBase`: `Store.open` creates missing tables on
existing stores. Changing or dropping a column of an existing table needs `SCHEMA_VERSION` raised
and a migration, because `create_all` never alters a table that is already there.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from sqlalchemy import (
    Boolean,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    func,
    select,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hexiseq.errors import InputError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.profiles import (
    COMPUTE_OPS,
    LINK_OPS,
    STATUSES,
    ProfileKey,
    ProfileMeasurement,
    canonical_params_json,
    check_measurement,
    measurement_key,
)

DEFAULT_STORE_URL = "sqlite:///hexiseq.db"
SCHEMA_VERSION = 1
"""Version of the table layout this code writes; a store with a higher one is refused."""

_SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_ALLOWED_URLS = (
    "allowed: sqlite:///PATH, sqlite:// (in memory), "
    "postgresql://USER:PASSWORD@HOST/DB (needs the psycopg driver: pip install 'psycopg[binary]')"
)
_IDS_SHOWN_IN_ERRORS = 5


class StoreBase(DeclarativeBase):
    """Declarative base of every table in the store."""


class StoreMetaRow(StoreBase):
    """Key/value facts about the store itself, e.g. `schema_version`."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String, primary_key=True)
    value: Mapped[str] = mapped_column(String)


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class PlanRow(StoreBase):
    """One saved plan: summary columns to list and filter by, plus the full plan JSON document."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_utc_now)
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
        created_at = row.created_at
        # SQLite keeps no offset, so what comes back is the UTC wall time without tzinfo.
        if created_at.tzinfo is None:
            created_at = created_at.replace(tzinfo=timezone.utc)
        return cls(
            id=row.id,
            created_at=created_at.astimezone(timezone.utc),
            label=row.label,
            cluster_name=row.cluster_name,
            model_name=row.model_name,
            seq_len=row.seq_len,
            tokens_per_s=row.tokens_per_s,
            step_time_s=row.step_time_s,
            cost_model=row.cost_model,
        )


class RuntimeRunRow(StoreBase):
    """One run of a plan by the runtime (`hexiseq.runtime.train`): what ran, where, how."""

    __tablename__ = "runtime_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_utc_now)
    plan_hash: Mapped[str] = mapped_column(String)
    """SHA-256 of the plan's JSON text as run: ties measurements to the exact plan."""
    plan_id: Mapped[int | None] = mapped_column(Integer)
    """The id of the same plan in the `plans` table, when it is there."""
    plan_name: Mapped[str] = mapped_column(String)
    model_name: Mapped[str] = mapped_column(String)
    seq_len: Mapped[int]
    world_size: Mapped[int]
    steps: Mapped[int]
    backend: Mapped[str] = mapped_column(String)
    device: Mapped[str] = mapped_column(String)
    dtype: Mapped[str] = mapped_column(String)
    emulation: Mapped[bool] = mapped_column(Boolean)
    """True when some rank's speed was emulated (`emulation_slowdown`), not real hardware."""
    torch_version: Mapped[str] = mapped_column(String)
    plan_json: Mapped[str] = mapped_column(Text)


class RuntimeMeasurementRow(StoreBase):
    """One rank's measurements of one training step of a runtime run."""

    __tablename__ = "runtime_measurements"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runtime_runs.id"), index=True)
    rank: Mapped[int]
    step: Mapped[int]
    step_time_s: Mapped[float] = mapped_column(Float)
    rank_time_s: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int]
    memory_measure: Mapped[str] = mapped_column(String)
    """"cuda_max_allocated" (per step) or "cpu_max_rss" (process lifetime peak)."""
    device: Mapped[str] = mapped_column(String)
    loss: Mapped[float] = mapped_column(Float)
    emulation_slowdown: Mapped[float] = mapped_column(Float)
    emulation_label: Mapped[str] = mapped_column(String)
    """"none", or e.g. "emulated 2x (compute padded by sleeping)"."""


MEMORY_MEASURES = ("cuda_max_allocated", "cpu_max_rss")
_MEASUREMENT_FIELDS = (
    "rank",
    "step",
    "step_time_s",
    "rank_time_s",
    "peak_memory_bytes",
    "memory_measure",
    "device",
    "loss",
    "emulation_slowdown",
    "emulation_label",
)


@dataclass(frozen=True, slots=True)
class RuntimeMeasurement:
    """One rank, one step of a runtime run (see `RuntimeMeasurementRow`)."""

    rank: int
    step: int
    step_time_s: float
    """Barrier to barrier: the step as the whole domain sees it (same on every rank)."""
    rank_time_s: float
    """From the opening barrier until this rank's own optimizer step ended."""
    peak_memory_bytes: int
    memory_measure: str
    device: str
    loss: float
    emulation_slowdown: float
    emulation_label: str


class ProfileRunRow(StoreBase):
    """One profiling sweep (`hexiseq profile ...`): where and with what it ran."""

    __tablename__ = "profile_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_utc_now)
    kind: Mapped[str] = mapped_column(String)
    """"compute" (one device) or "links" (torchrun ranks)."""
    device_type: Mapped[str] = mapped_column(String)
    device_name: Mapped[str] = mapped_column(String)
    torch_version: Mapped[str] = mapped_column(String)
    cuda_version: Mapped[str | None] = mapped_column(String)
    host: Mapped[str] = mapped_column(String)
    command: Mapped[str] = mapped_column(Text)
    grid_name: Mapped[str] = mapped_column(String)
    quick: Mapped[bool] = mapped_column(Boolean)


class ProfileMeasurementRow(StoreBase):
    """One `hexiseq.profiles.ProfileMeasurement`; unique over the point's identity so that a
    resumed sweep cannot write a point twice. `link_class` is "" for compute ops (SQL unique
    constraints treat NULLs as distinct)."""

    __tablename__ = "profile_measurements"
    __table_args__ = (
        UniqueConstraint(
            "device_type",
            "op",
            "params_json",
            "dtype",
            "link_class",
            "emulation_slowdown",
            name="uq_profile_measurement_identity",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("profile_runs.id"), index=True)
    device_type: Mapped[str] = mapped_column(String)
    op: Mapped[str] = mapped_column(String)
    params_json: Mapped[str] = mapped_column(String)
    dtype: Mapped[str] = mapped_column(String)
    link_class: Mapped[str] = mapped_column(String)
    emulation_slowdown: Mapped[float] = mapped_column(Float)
    flops: Mapped[float] = mapped_column(Float)
    bytes_moved: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String)
    median_s: Mapped[float | None] = mapped_column(Float)
    p10_s: Mapped[float | None] = mapped_column(Float)
    p90_s: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int]
    device_name: Mapped[str] = mapped_column(String)
    torch_version: Mapped[str] = mapped_column(String)
    cuda_version: Mapped[str | None] = mapped_column(String)
    clocks: Mapped[str | None] = mapped_column(String)
    error: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str] = mapped_column(String)
    extra_json: Mapped[str] = mapped_column(Text)


class Store:
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
    def open(cls, url: str | None = None) -> Store:
        """Open the store at `url` (default `DEFAULT_STORE_URL`), creating missing tables.

        For a SQLite file the parent directory is created if missing.
        Raises InputError (one line naming the URL and what is allowed) when the URL cannot be
        parsed, names an unsupported dialect or a driver that is not installed, cannot be opened,
        is not a hexiseq store, or holds a schema_version newer than this code knows.
        """
        parsed_url = _parse_store_url(DEFAULT_STORE_URL if url is None else url)
        display_url = parsed_url.render_as_string(hide_password=True)
        engine = _create_store_engine(parsed_url, display_url)
        try:
            _prepare_schema(engine, display_url)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, display_url)

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
        with self._session_factory.begin() as session:
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
        with self._session_factory.begin() as session:
            yield session

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
        _check_plan_fields(plan_json, label, cluster_name, model_name, seq_len, cost_model)
        _check_optional_metric("tokens_per_s", tokens_per_s)
        _check_optional_metric("step_time_s", step_time_s)
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

    def save_runtime_run(
        self,
        plan_json: str,
        *,
        plan_hash: str,
        plan_name: str,
        model_name: str,
        seq_len: int,
        world_size: int,
        steps: int,
        backend: str,
        device: str,
        dtype: str,
        emulation: bool,
        torch_version: str,
        plan_id: int | None = None,
    ) -> int:
        """Record the start of a runtime run of a plan; returns the run id."""
        _check_plan_fields(plan_json, plan_name, "-", model_name, seq_len, backend)
        row = RuntimeRunRow(
            plan_hash=plan_hash,
            plan_id=plan_id,
            plan_name=plan_name,
            model_name=model_name,
            seq_len=seq_len,
            world_size=world_size,
            steps=steps,
            backend=backend,
            device=device,
            dtype=dtype,
            emulation=bool(emulation),
            torch_version=torch_version,
            plan_json=plan_json,
        )
        with self._session() as session:
            session.add(row)
            session.flush()
            return row.id

    def add_runtime_measurements(
        self, run_id: int, measurements: list[RuntimeMeasurement]
    ) -> None:
        """Append measurements to run `run_id`, all in one transaction.

        Raises InputError for an unknown run, an unknown memory measure or a time or memory
        that is negative, NaN or infinite.
        """
        for measurement in measurements:
            _check_measurement(measurement)
        with self._session() as session:
            if session.get(RuntimeRunRow, run_id) is None:
                raise InputError(f"store {self._display_url} has no runtime run {run_id}")
            session.add_all(
                RuntimeMeasurementRow(
                    run_id=run_id, **{f: getattr(m, f) for f in _MEASUREMENT_FIELDS}
                )
                for m in measurements
            )

    def list_runtime_runs(self, plan_hash: str | None = None) -> list[dict[str, object]]:
        """Runtime runs, newest first (all columns but the plan JSON), optionally of one plan."""
        query = select(RuntimeRunRow).order_by(RuntimeRunRow.id.desc())
        if plan_hash is not None:
            query = query.where(RuntimeRunRow.plan_hash == plan_hash)
        columns = [c.name for c in RuntimeRunRow.__table__.columns if c.name != "plan_json"]
        with self._session() as session:
            return [{c: getattr(row, c) for c in columns} for row in session.scalars(query)]

    def runtime_measurements(self, run_id: int) -> list[RuntimeMeasurement]:
        """The measurements of run `run_id`, by step then rank."""
        query = (
            select(RuntimeMeasurementRow)
            .where(RuntimeMeasurementRow.run_id == run_id)
            .order_by(RuntimeMeasurementRow.step, RuntimeMeasurementRow.rank)
        )
        with self._session() as session:
            return [
                RuntimeMeasurement(**{f: getattr(row, f) for f in _MEASUREMENT_FIELDS})
                for row in session.scalars(query)
            ]

    def find_plan_id(self, plan_json: str) -> int | None:
        """The id of the newest saved plan whose JSON text is exactly `plan_json`, if any."""
        query = (
            select(PlanRow.id).where(PlanRow.plan_json == plan_json).order_by(PlanRow.id.desc())
        )
        with self._session() as session:
            return session.scalars(query).first()

    def save_fitted_model(self, document_json: str) -> int:
        """Save one fit session's JSON document (`hexiseq.costmodel.FittedCostModel.to_json`)
        and return its id. Raises InputError unless the text is a JSON object."""
        _check_json_object("fitted model document", document_json)
        row = FittedModelRow(document_json=document_json)
        with self._session() as session:
            session.add(row)
            session.flush()
            return row.id

    def latest_fitted_model(self) -> str | None:
        """The JSON document of the newest saved fitted model; None when there is none."""
        query = select(FittedModelRow.document_json).order_by(FittedModelRow.id.desc()).limit(1)
        with self._session() as session:
            return session.scalars(query).first()

    def profile_measurements_by_run(
        self,
    ) -> list[tuple[int, datetime, list[ProfileMeasurement]]]:
        """(run id, start time in UTC, its measurements in written order) for every profile
        run that has measurements, oldest first: what a cost-model fit reads."""
        query = select(ProfileRunRow, ProfileMeasurementRow).join(
            ProfileMeasurementRow, ProfileMeasurementRow.run_id == ProfileRunRow.id
        )
        runs: dict[int, tuple[int, datetime, list[ProfileMeasurement]]] = {}
        with self._session() as session:
            for run, row in session.execute(query.order_by(ProfileMeasurementRow.id)):
                started_at = run.started_at
                if started_at.tzinfo is None:  # SQLite keeps UTC wall time without offset
                    started_at = started_at.replace(tzinfo=timezone.utc)
                entry = runs.setdefault(run.id, (run.id, started_at, []))
                entry[2].append(_measurement_from_row(row, self._display_url))
        return sorted(runs.values(), key=lambda entry: entry[0])

    def save_profile_run(
        self,
        *,
        kind: str,
        device_type: str,
        device_name: str,
        torch_version: str,
        cuda_version: str | None,
        host: str,
        command: str,
        grid_name: str,
        quick: bool,
    ) -> int:
        """Record the start of a profiling sweep (`kind` "compute" or "links"); returns its id.

        Raises InputError for an unknown kind or an empty device type.
        """
        if kind not in ("compute", "links"):
            raise InputError(f"profile run kind must be compute or links, got {kind!r}")
        if not device_type:
            raise InputError("device_type must be a non-empty string")
        row = ProfileRunRow(
            kind=kind,
            device_type=device_type,
            device_name=device_name,
            torch_version=torch_version,
            cuda_version=cuda_version,
            host=host,
            command=command,
            grid_name=grid_name,
            quick=bool(quick),
        )
        with self._session() as session:
            session.add(row)
            session.flush()
            return row.id

    def add_profile_measurement(self, run_id: int, measurement: ProfileMeasurement) -> bool:
        """Write one point of sweep `run_id` in its own transaction (unless inside
        `transaction()`), so an interrupted sweep keeps every point already written.

        Returns False, writing nothing, when the store already holds a point with the same
        identity (`hexiseq.profiles.measurement_key`). Raises InputError for an unknown run or
        a measurement that `check_measurement` refuses.
        """
        check_measurement(measurement)
        try:
            with self._session() as session:
                if session.get(ProfileRunRow, run_id) is None:
                    raise InputError(f"store {self._display_url} has no profile run {run_id}")
                if session.scalar(_identity_query(measurement_key(measurement))) is not None:
                    return False
                session.add(_profile_measurement_row(run_id, measurement))
        except IntegrityError:
            # Another writer stored the same point between the check and the insert.
            return False
        return True

    def profile_measurements(
        self, device_type: str | None = None, op: str | None = None, link_class: str | None = None
    ) -> list[ProfileMeasurement]:
        """Stored points in the order they were written, optionally of one device type, op or
        link class.

        Raises InputError naming the row id when a row is corrupt (bad JSON, unknown op or
        status).
        """
        query = _profile_query(ProfileMeasurementRow, device_type, op, link_class)
        with self._session() as session:
            return [
                _measurement_from_row(row, self._display_url)
                for row in session.scalars(query.order_by(ProfileMeasurementRow.id))
            ]

    def profiled_keys(
        self, device_type: str | None = None, op: str | None = None, link_class: str | None = None
    ) -> set[ProfileKey]:
        """Identities (`hexiseq.profiles.ProfileKey`) of the stored points: what a resumed
        sweep skips. Failed points count, so they are not retried."""
        columns = (
            ProfileMeasurementRow.device_type,
            ProfileMeasurementRow.op,
            ProfileMeasurementRow.params_json,
            ProfileMeasurementRow.dtype,
            ProfileMeasurementRow.link_class,
            ProfileMeasurementRow.emulation_slowdown,
        )
        query = _profile_query(columns, device_type, op, link_class)
        with self._session() as session:
            return {(*row[:5], float(row[5])) for row in session.execute(query)}


def _profile_query(selected, device_type: str | None, op: str | None, link_class: str | None):
    """select(selected) from profile_measurements, filtered by the arguments that are given."""
    query = select(*selected) if isinstance(selected, tuple) else select(selected)
    filters = {"device_type": device_type, "op": op, "link_class": link_class}
    for column, value in filters.items():
        if value is not None:
            query = query.where(getattr(ProfileMeasurementRow, column) == value)
    return query


def _identity_query(key: ProfileKey):
    names = ("device_type", "op", "params_json", "dtype", "link_class", "emulation_slowdown")
    query = select(ProfileMeasurementRow.id)
    for name, value in zip(names, key):
        query = query.where(getattr(ProfileMeasurementRow, name) == value)
    return query


_PROFILE_COPIED_FIELDS = (
    "device_type", "op", "dtype", "flops", "bytes_moved", "status", "median_s", "p10_s", "p90_s",
    "samples", "device_name", "torch_version", "cuda_version", "clocks", "error", "host",
)  # fmt: skip


def _profile_measurement_row(run_id: int, m: ProfileMeasurement) -> ProfileMeasurementRow:
    return ProfileMeasurementRow(
        run_id=run_id,
        params_json=canonical_params_json(m.params),
        link_class=m.link_class or "",
        emulation_slowdown=float(m.emulation_slowdown),
        extra_json=json.dumps(m.extra, sort_keys=True),
        **{name: getattr(m, name) for name in _PROFILE_COPIED_FIELDS},
    )


def _measurement_from_row(row: ProfileMeasurementRow, display_url: str) -> ProfileMeasurement:
    """Rebuild a measurement; InputError naming the row when it is corrupt."""
    try:
        params, extra = json.loads(row.params_json), json.loads(row.extra_json)
    except (TypeError, json.JSONDecodeError) as error:
        problem = f"params or extra is not valid JSON ({error})"
    else:
        problem = _profile_row_problem(row, params, extra)
    if problem:
        raise InputError(
            f"store {display_url}: profile_measurements row {row.id} is corrupt: {problem}"
        )
    return ProfileMeasurement(
        params=params,
        link_class=row.link_class or None,
        emulation_slowdown=row.emulation_slowdown,
        extra=extra,
        **{name: getattr(row, name) for name in _PROFILE_COPIED_FIELDS},
    )


def _profile_row_problem(row: ProfileMeasurementRow, params: object, extra: object) -> str:
    """What is wrong with a stored row, or "" when nothing is."""
    if not isinstance(params, dict) or not isinstance(extra, dict):
        return "params and extra must be JSON objects"
    if row.op not in COMPUTE_OPS + LINK_OPS:
        return f"unknown op {row.op!r}"
    if row.status not in STATUSES:
        return f"unknown status {row.status!r}"
    return ""


def _check_measurement(measurement: RuntimeMeasurement) -> None:
    if measurement.memory_measure not in MEMORY_MEASURES:
        raise InputError(
            f"memory_measure {measurement.memory_measure!r} is not one of "
            f"{', '.join(MEMORY_MEASURES)}"
        )
    for field_name in ("step_time_s", "rank_time_s", "peak_memory_bytes", "loss"):
        value = getattr(measurement, field_name)
        _check_optional_metric(field_name, value)
        if value is None:
            raise InputError(f"{field_name} must be a number, got None")


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


def _check_plan_fields(
    plan_json: str,
    label: str,
    cluster_name: str,
    model_name: str,
    seq_len: int,
    cost_model: str,
) -> None:
    """Raise InputError unless the plan's JSON and summary fields can be stored as they are."""
    if not isinstance(plan_json, str):
        raise InputError(f"plan_json must be a JSON string, got {type(plan_json).__name__}")
    try:
        json.loads(plan_json)
    except json.JSONDecodeError as error:
        raise InputError(f"plan_json is not valid JSON: {error}") from None
    named = {"label": label, "cluster_name": cluster_name, "model_name": model_name}
    for field_name, value in {**named, "cost_model": cost_model}.items():
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"{field_name} must be a non-empty string, got {value!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise InputError(f"seq_len must be a positive integer, got {seq_len!r}")


def _check_optional_metric(field_name: str, value: float | None) -> None:
    """Raise InputError unless `value` is None or a finite number >= 0.

    NaN is refused rather than stored because SQLite would silently turn it into NULL.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{field_name} must be a number or None, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{field_name} must be finite and >= 0, got {value!r}")


def _one_line(error: BaseException) -> str:
    """The first line of an error's message, without SQLAlchemy's "(Background on ...)" tail."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()
    return text[0] if text else type(original).__name__


def _parse_store_url(url: str) -> URL:
    """Parse `url`; raise InputError unless it is a SQLite or PostgreSQL SQLAlchemy URL."""
    try:
        parsed_url = make_url(url)
    except (ArgumentError, TypeError, ValueError):
        raise InputError(f"store URL {url!r} cannot be parsed; {_ALLOWED_URLS}") from None
    backend = parsed_url.get_backend_name()
    if backend not in _SUPPORTED_BACKENDS:
        shown = parsed_url.render_as_string(hide_password=True)
        raise InputError(
            f"store URL {shown!r} uses unsupported dialect {backend!r}; {_ALLOWED_URLS}"
        )
    return parsed_url


def _create_store_engine(parsed_url: URL, display_url: str) -> Engine:
    """Create the engine (no connection yet); raise InputError if the driver is missing."""
    if parsed_url.get_backend_name() == "sqlite":
        _make_sqlite_parent_directory(parsed_url, display_url)
    try:
        return create_engine(parsed_url)
    except ImportError as error:
        raise InputError(
            f"store URL {display_url!r} needs database driver {error.name!r}, which is not "
            f"installed; {_ALLOWED_URLS}"
        ) from None
    except (SQLAlchemyError, TypeError, ValueError) as error:
        raise InputError(f"store URL {display_url!r} is not usable: {_one_line(error)}") from None


def _make_sqlite_parent_directory(parsed_url: URL, display_url: str) -> None:
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
            f"store {display_url} cannot be opened: cannot create directory {str(parent)!r}: "
            f"{error.strerror or error}"
        ) from None


def _prepare_schema(engine: Engine, display_url: str) -> None:
    """Check the store's schema_version and create missing tables, in one transaction.

    Raises InputError if the database cannot be reached, is not a hexiseq store, or is newer.
    """
    try:
        engine.connect().close()
    except SQLAlchemyError as error:
        raise InputError(f"store {display_url} cannot be opened: {_one_line(error)}") from None
    try:
        with Session(engine) as session, session.begin():
            StoreMetaRow.__table__.create(session.connection(), checkfirst=True)
            _check_schema_version(session, display_url)
            StoreBase.metadata.create_all(session.connection())
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


def _check_schema_version(session: Session, display_url: str) -> None:
    """Record SCHEMA_VERSION in a new store; raise InputError if an existing one differs."""
    stored = session.get(StoreMetaRow, "schema_version")
    if stored is None:
        session.add(StoreMetaRow(key="schema_version", value=str(SCHEMA_VERSION)))
        return
    try:
        stored_version = int(stored.value)
    except ValueError:
        raise InputError(
            f"store {display_url} is not a hexiseq store: schema_version {stored.value!r} "
            "is not an integer"
        ) from None
    if stored_version > SCHEMA_VERSION:
        raise InputError(
            f"store {display_url} has schema_version {stored_version}, newer than this hexiseq "
            f"knows ({SCHEMA_VERSION}); upgrade hexiseq or use another store"
        )
    if stored_version < SCHEMA_VERSION:
        raise InputError(
            f"store {display_url} has schema_version {stored_version}, which this hexiseq cannot "
            f"read (it knows {SCHEMA_VERSION}); use another store"
        )


class FittedModelRow(StoreBase):
    """One cost-model fit session: its JSON document (coefficients, source runs, point
    counts, held-out errors, versions), never pickle (DESIGN.md §6)."""

    __tablename__ = "fitted_models"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_utc_now)
    document_json: Mapped[str] = mapped_column(Text)


def _check_json_object(what: str, text: str) -> None:
    """Raise InputError unless `text` is the JSON text of an object."""
    try:
        document = json.loads(text)
    except (TypeError, json.JSONDecodeError) as error:
        raise InputError(f"{what} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InputError(f"{what} must be a JSON object, got {type(document).__name__}")
