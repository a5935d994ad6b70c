"""The store's profile and fitted-model tables: profiling sweeps, their points, and the JSON
documents of cost-model fits (`Store` gets these methods from `ProfileTables`)."""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, String, Text, UniqueConstraint, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from hexiseq.errors import InputError
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
from hexiseq.store.base import StoreBase, as_utc, utc_now


class ProfileRunRow(StoreBase):
    """One profiling sweep (`hexiseq profile ...`): where and with what it ran."""

    __tablename__ = "profile_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
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


class FittedModelRow(StoreBase):
    """One cost-model fit session: its JSON document (coefficients, source runs, point
    counts, held-out errors, versions), never pickle (docs/design.md §6)."""

    __tablename__ = "fitted_models"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    document_json: Mapped[str] = mapped_column(Text)


class ProfileTables:
    """`Store` methods of the profile and fitted-model tables (they use its `_session` and
    `_display_url`)."""

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
                entry = runs.setdefault(run.id, (run.id, as_utc(run.started_at), []))
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


def _check_json_object(what: str, text: str) -> None:
    """Raise InputError unless `text` is the JSON text of an object."""
    try:
        document = json.loads(text)
    except (TypeError, json.JSONDecodeError) as error:
        raise InputError(f"{what} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InputError(f"{what} must be a JSON object, got {type(document).__name__}")
