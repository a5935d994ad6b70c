"""The store's runtime tables: runs of a plan by `hexiseq.runtime.train`, each rank's
measured steps, and the attention kernels each rank ran in them (`Store` gets these methods
from `RuntimeTables`).

The kernels have a table of their own (`runtime_attention_kernels`) rather than a column of
`runtime_measurements`: `Store.open` adds a missing table to an existing store, while a new
column of an existing table would need a schema migration (`hexiseq.store`); so a store
written before keeps opening with every row, in this hexiseq and in older ones. Its runs have
no kernel rows (reported as ""): runs of that time ran torch's flash kernel on CUDA and
`cpu_flash` on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    func,
    select,
)
from sqlalchemy.orm import Mapped, mapped_column

from hexiseq.errors import InputError
from hexiseq.kernels import ATTENTION_KERNELS, kernels_label
from hexiseq.store.base import StoreBase, check_optional_metric, check_plan_fields, utc_now


class RuntimeRunRow(StoreBase):
    """One run of a plan by the runtime (`hexiseq.runtime.train`): what ran, where, how."""

    __tablename__ = "runtime_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    plan_hash: Mapped[str] = mapped_column(String)
    """SHA-256 of the plan's JSON text as run: ties measurements to the exact plan."""
    plan_id: Mapped[int | None] = mapped_column(Integer)
    """The id of the same plan in the `plans` table, when it is there."""
    plan_name: Mapped[str] = mapped_column(String)
    model_name: Mapped[str] = mapped_column(String)
    seq_len: Mapped[int]
    world_size: Mapped[int]
    steps: Mapped[int]
    """Steps this run was to run: all of them, or, for a run resumed from a checkpoint or
    handed over by a re-plan (`hexiseq run --replan`), those from its first step on."""
    backend: Mapped[str] = mapped_column(String)
    device: Mapped[str] = mapped_column(String)
    dtype: Mapped[str] = mapped_column(String)
    emulation: Mapped[bool] = mapped_column(Boolean)
    """True when some rank's speed was emulated (`emulation_slowdown`), not real hardware."""
    torch_version: Mapped[str] = mapped_column(String)
    plan_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String, server_default="unknown")
    """One of `RUN_STATUSES`: "running" from the start, then how it ended."""
    failure: Mapped[str | None] = mapped_column(Text)
    """Why a failed run failed, in one line."""
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    launch_id: Mapped[str | None] = mapped_column(String)
    """The id `hexiseq run` gave the launch (`LAUNCH_ID_ENV`), so that it can fail the run
    when its ranks died before they could."""


class RuntimeMeasurementRow(StoreBase):
    """One rank's measurements of one training step of a runtime run."""

    __tablename__ = "runtime_measurements"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runtime_runs.id"), index=True)
    rank: Mapped[int]
    step: Mapped[int]
    step_time_s: Mapped[float] = mapped_column(Float)
    rank_time_s: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_measure: Mapped[str] = mapped_column(String)
    """"cuda_max_allocated" (per step) or "cpu_max_rss" (process lifetime peak)."""
    reserved_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """CUDA: `torch.cuda.max_memory_reserved` of the step (the caching allocator's pool at its
    largest: allocated tensors plus the cached, fragmented rest). None on CPU and in rows from
    before it was recorded."""
    outside_allocator_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """CUDA: device memory in use at the step's end that the allocator does not hold (total -
    free - `memory_reserved`: the CUDA context, library workspaces, NCCL buffers, and any other
    process on the device). None on CPU and in older rows."""
    device: Mapped[str] = mapped_column(String)
    loss: Mapped[float] = mapped_column(Float)
    emulation_slowdown: Mapped[float] = mapped_column(Float)
    emulation_label: Mapped[str] = mapped_column(String)
    """"none", or e.g. "emulated 2x (compute padded by sleeping)"."""


class RuntimeKernelRow(StoreBase):
    """The attention kernels one rank ran in one measured step of a runtime run."""

    __tablename__ = "runtime_attention_kernels"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runtime_runs.id"), index=True)
    rank: Mapped[int]
    step: Mapped[int]
    attention_kernels: Mapped[str] = mapped_column(String)
    """`hexiseq.kernels` names, sorted and comma-joined, e.g. "cudnn" or "cudnn,flash"."""


MEMORY_MEASURES = ("cuda_max_allocated", "cpu_max_rss")
RUN_STATUSES = ("running", "finished", "replanned", "failed", "unknown")
"""A runtime run's status; "replanned": it stopped after a checkpoint so that `hexiseq run
--replan` could go on with a new plan; "unknown": recorded before hexiseq kept status, not all
steps there."""
ENDED_STATUSES = ("finished", "replanned", "failed")
LAUNCH_ID_ENV = "HEXISEQ_LAUNCH_ID"
"""Where `hexiseq run` hands the ranks the id of its launch."""
_FAILURE_CHARS = 2000
_MEASUREMENT_FIELDS = (
    "rank",
    "step",
    "step_time_s",
    "rank_time_s",
    "peak_memory_bytes",
    "memory_measure",
    "reserved_peak_bytes",
    "outside_allocator_bytes",
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
    attention_kernels: str = ""
    """The attention kernels this rank really ran in the step (`hexiseq.kernels` names, sorted
    and comma-joined, as `hexiseq.runtime.kernels.take_used_kernels` gives them); "" when not
    recorded (runs stored before kernels were, or a step that ran no attention)."""
    reserved_peak_bytes: int | None = None
    """See `RuntimeMeasurementRow.reserved_peak_bytes` (None: not measured)."""
    outside_allocator_bytes: int | None = None
    """See `RuntimeMeasurementRow.outside_allocator_bytes` (None: not measured)."""


class RuntimeTables:
    """`Store` methods of the runtime tables (they use its `_session` and `_display_url`)."""

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
        launch_id: str | None = None,
    ) -> int:
        """Record the start of a runtime run of a plan (status "running"); returns the run id."""
        check_plan_fields(plan_json, plan_name, "-", model_name, seq_len, backend)
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
            status="running",
            launch_id=launch_id,
        )
        with self._session() as session:
            session.add(row)
            session.flush()
            return row.id

    def end_runtime_run(self, run_id: int, status: str, failure: str | None = None) -> None:
        """Record that run `run_id` ended: "finished", "replanned" (its steps went on under a
        new plan), or "failed" with why (one line, cut to
        2000 characters). A run that has ended already keeps its first ending.

        Raises InputError for an unknown run or status, or a failure without a reason.
        """
        if status not in ENDED_STATUSES:
            raise InputError(f"a run ends {', '.join(ENDED_STATUSES)}, not {status!r}")
        if (status == "failed") != bool(failure):
            raise InputError("a failed run needs its failure; a finished one has none")
        with self._session() as session:
            row = session.get(RuntimeRunRow, run_id)
            if row is None:
                raise InputError(f"store {self._display_url} has no runtime run {run_id}")
            if row.status in ENDED_STATUSES:
                return
            row.status = status
            row.failure = _one_line(failure) if failure else None
            row.finished_at = utc_now()

    def fail_unended_runs(self, launch_id: str, failure: str) -> int:
        """Mark every run of launch `launch_id` that is still "running" failed with `failure`
        (its ranks died without recording an end); returns how many were."""
        query = select(RuntimeRunRow).where(
            RuntimeRunRow.launch_id == launch_id, RuntimeRunRow.status == "running"
        )
        with self._session() as session:
            rows = list(session.scalars(query))
            for row in rows:
                row.status = "failed"
                row.failure = _one_line(failure)
                row.finished_at = utc_now()
            return len(rows)

    def add_runtime_measurements(
        self, run_id: int, measurements: list[RuntimeMeasurement]
    ) -> None:
        """Append measurements to run `run_id`, all in one transaction.

        Raises InputError for an unknown run, an unknown memory measure, a time or memory
        that is negative, NaN or infinite, or attention kernels `hexiseq.kernels` does not name.
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
            session.add_all(
                RuntimeKernelRow(
                    run_id=run_id, rank=m.rank, step=m.step, attention_kernels=m.attention_kernels
                )
                for m in measurements
                if m.attention_kernels
            )

    def list_runtime_runs(self, plan_hash: str | None = None) -> list[dict[str, object]]:
        """Runtime runs, newest first (all columns but the plan JSON), optionally of one plan,
        each with `attention_kernels`: the kernels any rank ran in any step, sorted and
        comma-joined ("" when none were recorded)."""
        query = select(RuntimeRunRow).order_by(RuntimeRunRow.id.desc())
        if plan_hash is not None:
            query = query.where(RuntimeRunRow.plan_hash == plan_hash)
        columns = [c.name for c in RuntimeRunRow.__table__.columns if c.name != "plan_json"]
        with self._session() as session:
            runs = [{c: getattr(row, c) for c in columns} for row in session.scalars(query)]
            kernels = _kernels_by_run(session, [run["id"] for run in runs])
        for run in runs:
            run["attention_kernels"] = kernels_label(kernels.get(run["id"], set()))
        return runs

    def runtime_peaks(self) -> list[tuple[int, str, list[tuple[int, str, int]]]]:
        """Every runtime run with measurements, oldest first: (run id, the plan JSON it ran,
        [(rank, memory measure, the rank's largest peak over the run's steps)])."""
        peak = func.max(RuntimeMeasurementRow.peak_memory_bytes)
        query = (
            select(
                RuntimeMeasurementRow.run_id,
                RuntimeMeasurementRow.rank,
                RuntimeMeasurementRow.memory_measure,
                peak,
            )  # fmt: skip
            .group_by(
                RuntimeMeasurementRow.run_id,
                RuntimeMeasurementRow.rank,
                RuntimeMeasurementRow.memory_measure,
            )  # fmt: skip
            .order_by(RuntimeMeasurementRow.run_id, RuntimeMeasurementRow.rank)
        )
        with self._session() as session:
            peaks: dict[int, list[tuple[int, str, int]]] = {}
            for run_id, rank, measure, largest in session.execute(query):
                peaks.setdefault(run_id, []).append((rank, measure, int(largest)))
            plans = session.execute(
                select(RuntimeRunRow.id, RuntimeRunRow.plan_json).where(
                    RuntimeRunRow.id.in_(list(peaks))
                )
            )
            plan_of = dict(plans.all())
        return [(run_id, plan_of[run_id], ranks) for run_id, ranks in peaks.items()]

    def runtime_measurements(self, run_id: int) -> list[RuntimeMeasurement]:
        """The measurements of run `run_id`, by step then rank."""
        query = (
            select(RuntimeMeasurementRow)
            .where(RuntimeMeasurementRow.run_id == run_id)
            .order_by(RuntimeMeasurementRow.step, RuntimeMeasurementRow.rank)
        )
        kernel_query = select(
            RuntimeKernelRow.rank, RuntimeKernelRow.step, RuntimeKernelRow.attention_kernels
        ).where(RuntimeKernelRow.run_id == run_id)
        with self._session() as session:
            kernels = {(rank, step): names for rank, step, names in session.execute(kernel_query)}
            return [
                RuntimeMeasurement(
                    **{f: getattr(row, f) for f in _MEASUREMENT_FIELDS},
                    attention_kernels=kernels.get((row.rank, row.step), ""),
                )
                for row in session.scalars(query)
            ]


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_FAILURE_CHARS]


def _kernels_by_run(session, run_ids: list[int]) -> dict[int, set[str]]:
    """run id -> every attention kernel its kernel rows name."""
    if not run_ids:
        return {}
    query = select(RuntimeKernelRow.run_id, RuntimeKernelRow.attention_kernels).where(
        RuntimeKernelRow.run_id.in_(run_ids)
    )
    kernels: dict[int, set[str]] = {}
    for run_id, names in session.execute(query):
        kernels.setdefault(run_id, set()).update(names.split(","))
    return kernels


def _check_measurement(measurement: RuntimeMeasurement) -> None:
    if measurement.memory_measure not in MEMORY_MEASURES:
        raise InputError(
            f"memory_measure {measurement.memory_measure!r} is not one of "
            f"{', '.join(MEMORY_MEASURES)}"
        )
    for field_name in ("step_time_s", "rank_time_s", "peak_memory_bytes", "loss"):
        value = getattr(measurement, field_name)
        check_optional_metric(field_name, value)
        if value is None:
            raise InputError(f"{field_name} must be a number, got None")
    _check_kernels(measurement.attention_kernels)


def _check_kernels(label: object) -> None:
    """Raise InputError unless `label` is "" or sorted, comma-joined `hexiseq.kernels` names."""
    if not isinstance(label, str):
        raise InputError(f"attention_kernels must be a string, got {label!r}")
    if not label:
        return
    names = label.split(",")
    unknown = [name for name in names if name not in ATTENTION_KERNELS]
    if unknown or kernels_label(names) != label:
        raise InputError(
            f"attention_kernels {label!r} is not a sorted, comma-joined list of "
            f"{', '.join(ATTENTION_KERNELS)}"
        )
