"""What every table module of the store shares: the declarative base, the metadata table,
timestamps and metric checks (`hexiseq.store` is the public face)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from hexiseq.errors import InputError


class StoreBase(DeclarativeBase):
    """Declarative base of every table in the store."""


class StoreMetaRow(StoreBase):
    """Key/value facts about the store itself, e.g. `schema_version`."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String, primary_key=True)
    value: Mapped[str] = mapped_column(String)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(moment: datetime) -> datetime:
    """A stored timestamp as timezone-aware UTC: SQLite keeps no offset, so what it gives
    back is the UTC wall time without tzinfo."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)


def check_json_text(field_name: str, text: object) -> None:
    """Raise InputError unless `text` is a string holding valid JSON."""
    if not isinstance(text, str):
        raise InputError(f"{field_name} must be a JSON string, got {type(text).__name__}")
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{field_name} is not valid JSON: {error}") from None


def check_optional_metric(field_name: str, value: float | None) -> None:
    """Raise InputError unless `value` is None or a finite number >= 0.

    NaN is refused rather than stored because SQLite would silently turn it into NULL.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{field_name} must be a number or None, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{field_name} must be finite and >= 0, got {value!r}")


def check_plan_fields(
    plan_json: str,
    label: str,
    cluster_name: str,
    model_name: str,
    seq_len: int,
    cost_model: str,
) -> None:
    """Raise InputError unless the plan's JSON and summary fields can be stored as they are."""
    check_json_text("plan_json", plan_json)
    named = {"label": label, "cluster_name": cluster_name, "model_name": model_name}
    for field_name, value in {**named, "cost_model": cost_model}.items():
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"{field_name} must be a non-empty string, got {value!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise InputError(f"seq_len must be a positive integer, got {seq_len!r}")
