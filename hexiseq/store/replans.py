"""Re-plans of `hexiseq run` launches: when a rank drifts (measured slower than predicted) or a
device is lost, the launcher re-plans from the measured rates, checkpoints and relaunches with
the new plan; each re-plan is one row of `runtime_replans` (`Store` gets these methods from
`ReplanTables`).

The table came with migration 0003 (`hexiseq.migrations`): `Store.open` adds it to a store
written before, keeping every row. A re-plan's measured gain is known only once the new plan's
steps are measured, so `measured_after_step_s` is written later (`set_replan_measured_after`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from numbers import Integral, Real

from sqlalchemy import DateTime, Float, String, Text, select
from sqlalchemy.orm import Mapped, mapped_column

from hexiseq.errors import InputError
from hexiseq.store.base import StoreBase, as_utc, check_json_text, utc_now

REPLAN_REASONS = ("drift", "lost")
"""Why a launch re-planned: a rank measured slower than predicted, or a device lost."""


class ReplanRow(StoreBase):
    """One re-plan of a `hexiseq run` launch (see `Replan` for what each column means)."""

    __tablename__ = "runtime_replans"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    launch_id: Mapped[str] = mapped_column(String, index=True)
    step: Mapped[int]
    reason: Mapped[str] = mapped_column(String)
    detail: Mapped[str] = mapped_column(Text)
    old_plan_json: Mapped[str] = mapped_column(Text)
    new_plan_json: Mapped[str] = mapped_column(Text)
    measured_slowdowns_json: Mapped[str] = mapped_column(Text)
    """JSON object: the old plan's rank (as text) -> its measured slowdown factor."""
    lost_ranks_json: Mapped[str] = mapped_column(Text)
    """JSON array of the old plan's ranks that were lost."""
    predicted_old_step_s: Mapped[float | None] = mapped_column(Float)
    predicted_new_step_s: Mapped[float] = mapped_column(Float)
    planning_s: Mapped[float] = mapped_column(Float)
    measured_before_step_s: Mapped[float | None] = mapped_column(Float)
    measured_after_step_s: Mapped[float | None] = mapped_column(Float)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replan:
    """One re-plan of a running launch: why, the plans before and after, and their step times.

    Checked when built: raises InputError for a reason not in `REPLAN_REASONS`, a negative
    step, an empty launch id or detail, a detail of several lines, plan JSON that does not
    parse, a rank that is negative or lost twice, a slowdown or step time that is not a finite
    number > 0, a negative planning time, or reason "lost" without a lost rank.
    """

    launch_id: str
    """The `hexiseq run` launch that re-planned (`hexiseq.store.LAUNCH_ID_ENV`)."""
    step: int
    """The first training step run with the new plan (>= 0)."""
    reason: str
    """One of `REPLAN_REASONS`."""
    detail: str
    """One line, e.g. "rank 2 (node0 #2, A100-80G) measured 2.01x slower than at the start"."""
    old_plan_json: str
    new_plan_json: str
    measured_slowdowns: dict[int, float] = field(default_factory=dict)
    """The old plan's rank -> how many times slower it measured than at the start of its
    run (> 0; below 1: faster, a device that recovered)."""
    lost_ranks: tuple[int, ...] = ()
    """The old plan's ranks whose devices were lost."""
    predicted_old_step_s: float | None
    """The old plan's step time re-predicted on the changed cluster; None when it cannot run
    there (a device was lost)."""
    predicted_new_step_s: float
    """The new plan's predicted step time."""
    planning_s: float
    """How long the search for the new plan took."""
    measured_before_step_s: float | None = None
    """Median measured step time of the old plan after the drift; None when unknown (e.g. a
    device was lost)."""
    measured_after_step_s: float | None = None
    """Median measured step time of the new plan; None until its steps are measured."""

    def __post_init__(self) -> None:
        _check_text_fields(self)
        check_json_text("old_plan_json", self.old_plan_json)
        check_json_text("new_plan_json", self.new_plan_json)
        object.__setattr__(self, "lost_ranks", _checked_lost_ranks(self.lost_ranks))
        object.__setattr__(self, "measured_slowdowns", _checked_slowdowns(self.measured_slowdowns))
        if self.reason == "lost" and not self.lost_ranks:
            raise InputError("a re-plan for reason 'lost' names the lost ranks; got none")
        for name in ("predicted_new_step_s", "planning_s"):
            positive = name != "planning_s"
            object.__setattr__(self, name, _checked_number(name, getattr(self, name), positive))
        for name in ("predicted_old_step_s", "measured_before_step_s", "measured_after_step_s"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _checked_number(name, value, positive=True))

    @property
    def predicted_gain(self) -> float | None:
        """How many times faster the new plan is predicted to step than the old one on the
        changed cluster (> 1: the re-plan helps); None when the old one cannot run there."""
        if self.predicted_old_step_s is None:
            return None
        return self.predicted_old_step_s / self.predicted_new_step_s

    @property
    def measured_gain(self) -> float | None:
        """Measured step time before over after the re-plan; None while either is unknown."""
        if self.measured_before_step_s is None or self.measured_after_step_s is None:
            return None
        return self.measured_before_step_s / self.measured_after_step_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanRecord(Replan):
    """A re-plan as the store holds it: its id and when it was recorded, then every field."""

    id: int
    created_at: datetime
    """When the re-plan was recorded, timezone-aware UTC."""

    @classmethod
    def from_row(cls, row: ReplanRow) -> ReplanRecord:
        """Copy an ORM row out; the JSON columns back to a dict with int keys and a tuple."""
        slowdowns = json.loads(row.measured_slowdowns_json)
        return cls(
            id=row.id,
            created_at=as_utc(row.created_at),
            launch_id=row.launch_id,
            step=row.step,
            reason=row.reason,
            detail=row.detail,
            old_plan_json=row.old_plan_json,
            new_plan_json=row.new_plan_json,
            measured_slowdowns={int(rank): factor for rank, factor in slowdowns.items()},
            lost_ranks=tuple(json.loads(row.lost_ranks_json)),
            predicted_old_step_s=row.predicted_old_step_s,
            predicted_new_step_s=row.predicted_new_step_s,
            planning_s=row.planning_s,
            measured_before_step_s=row.measured_before_step_s,
            measured_after_step_s=row.measured_after_step_s,
        )


class ReplanTables:
    """`Store` methods of the re-plans table (they use its `_session` and `_display_url`)."""

    def save_replan(self, replan: Replan) -> int:
        """Record one re-plan (checked when the `Replan` was built); returns its new id.

        Raises InputError if `replan` is not a `Replan`.
        """
        if not isinstance(replan, Replan):
            raise InputError(f"save_replan takes a Replan, got {type(replan).__name__}")
        row = ReplanRow(
            launch_id=replan.launch_id,
            step=replan.step,
            reason=replan.reason,
            detail=replan.detail,
            old_plan_json=replan.old_plan_json,
            new_plan_json=replan.new_plan_json,
            # JSON object keys are text; `ReplanRecord.from_row` turns them back into ints.
            measured_slowdowns_json=json.dumps(
                {str(rank): factor for rank, factor in sorted(replan.measured_slowdowns.items())}
            ),
            lost_ranks_json=json.dumps(list(replan.lost_ranks)),
            predicted_old_step_s=replan.predicted_old_step_s,
            predicted_new_step_s=replan.predicted_new_step_s,
            planning_s=replan.planning_s,
            measured_before_step_s=replan.measured_before_step_s,
            measured_after_step_s=replan.measured_after_step_s,
        )
        with self._session() as session:
            session.add(row)
            session.flush()  # assigns the id
            return row.id

    def set_replan_measured_after(self, replan_id: int, measured_after_step_s: float) -> None:
        """Record the measured median step time of re-plan `replan_id`'s new plan (replacing
        one recorded before).

        Raises InputError for an unknown re-plan or a time that is not a finite number > 0.
        """
        seconds = _checked_number("measured_after_step_s", measured_after_step_s, True)
        with self._session() as session:
            row = session.get(ReplanRow, replan_id)
            if row is None:
                raise InputError(f"store {self._display_url} has no re-plan with id {replan_id}")
            row.measured_after_step_s = seconds

    def list_replans(self, launch_id: str | None = None) -> list[ReplanRecord]:
        """Recorded re-plans, newest first, optionally only those of launch `launch_id`."""
        query = select(ReplanRow).order_by(ReplanRow.id.desc())
        if launch_id is not None:
            query = query.where(ReplanRow.launch_id == launch_id)
        with self._session() as session:
            return [ReplanRecord.from_row(row) for row in session.scalars(query)]


def _check_text_fields(replan: Replan) -> None:
    if not isinstance(replan.launch_id, str) or not replan.launch_id.strip():
        raise InputError(f"launch_id must be a non-empty string, got {replan.launch_id!r}")
    step = replan.step
    if isinstance(step, bool) or not isinstance(step, Integral) or step < 0:
        raise InputError(f"step must be an integer >= 0, got {step!r}")
    if replan.reason not in REPLAN_REASONS:
        allowed = " or ".join(repr(reason) for reason in REPLAN_REASONS)
        raise InputError(f"a re-plan's reason is {allowed}, not {replan.reason!r}")
    detail = replan.detail
    if not isinstance(detail, str) or not detail.strip() or len(detail.splitlines()) > 1:
        raise InputError(f"detail must be one non-empty line of text, got {detail!r}")


def _is_rank(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 0


def _checked_lost_ranks(ranks: object) -> tuple[int, ...]:
    """`ranks` as a tuple of ints; InputError unless each is an integer >= 0, none twice."""
    if isinstance(ranks, (str, bytes, Mapping)) or not hasattr(ranks, "__iter__"):
        raise InputError(f"lost_ranks must be a sequence of ranks, got {ranks!r}")
    ranks = tuple(ranks)
    if not all(_is_rank(rank) for rank in ranks) or len(set(ranks)) != len(ranks):
        raise InputError(f"lost_ranks must be distinct integers >= 0, got {list(ranks)}")
    return tuple(int(rank) for rank in ranks)


def _checked_slowdowns(slowdowns: object) -> dict[int, float]:
    """A copy with int keys and float values; InputError unless each key is a rank (an
    integer >= 0) and each factor a finite number > 0."""
    if not isinstance(slowdowns, Mapping):
        raise InputError(f"measured_slowdowns must map rank -> factor, got {slowdowns!r}")
    checked = {}
    for rank, factor in slowdowns.items():
        if not _is_rank(rank):
            raise InputError(f"measured_slowdowns: rank {rank!r} is not an integer >= 0")
        checked[int(rank)] = _checked_number(f"measured_slowdowns[{rank}]", factor, True)
    return checked


def _checked_number(field_name: str, value: object, positive: bool) -> float:
    """`value` as a float; InputError unless a finite number > 0 (`positive`) or >= 0.

    NaN is refused rather than stored because SQLite would silently turn it into NULL."""
    bound = "> 0" if positive else ">= 0"
    is_number = isinstance(value, Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise InputError(f"{field_name} must be a finite number {bound}, got {value!r}")
    return float(value)
