"""The store's profile tables: runs, measurements, identity, resume keys, corrupt rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy import text

from hexiseq.errors import InputError
from hexiseq.profiles import ProfileMeasurement, measurement_key
from hexiseq.store import Store


def _run(store: Store, kind: str = "compute") -> int:
    return store.save_profile_run(
        kind=kind,
        device_type="cpu",
        device_name="test cpu",
        torch_version="2.x",
        cuda_version=None,
        host="h",
        command="hexiseq profile --quick",
        grid_name="quick",
        quick=True,
    )


def _measurement(**changes) -> ProfileMeasurement:
    base = ProfileMeasurement(
        device_type="cpu",
        op="gemm",
        params={"m": 2, "n": 3, "k": 4},
        dtype="float32",
        flops=48.0,
        bytes_moved=104.0,
        status="ok",
        median_s=2e-6,
        p10_s=1e-6,
        p90_s=3e-6,
        samples=10,
        device_name="test cpu",
        torch_version="2.x",
        host="h",
        extra={"threads": 2},
    )
    return dataclasses.replace(base, **changes)


def test_round_trip_keeps_every_field(store: Store) -> None:
    run_id = _run(store)
    written = [
        _measurement(),
        _measurement(
            op="p2p",
            params={"world": 2, "message_bytes": 1024, "direction": "next"},
            link_class="inter",
            flops=0.0,
        ),
        _measurement(params={"m": 9, "n": 9, "k": 9}, status="oom", median_s=None,
                     p10_s=None, p90_s=None, samples=0, error="MemoryError: too big"),
    ]  # fmt: skip
    assert all(store.add_profile_measurement(run_id, m) for m in written)
    assert store.profile_measurements() == written
    assert store.profile_measurements(op="p2p") == [written[1]]
    assert store.profile_measurements(link_class="inter") == [written[1]]
    assert store.profile_measurements(device_type="h100") == []


def test_same_identity_is_not_written_twice(store: Store) -> None:
    run_id = _run(store)
    assert store.add_profile_measurement(run_id, _measurement())
    # Same identity (param order and timings do not matter), second sweep: nothing written.
    again = _measurement(params={"k": 4, "n": 3, "m": 2}, median_s=5e-6, p90_s=6e-6)
    assert not store.add_profile_measurement(_run(store), again)
    assert len(store.profile_measurements()) == 1
    # A different emulation slowdown, dtype or link class is another point.
    assert store.add_profile_measurement(run_id, _measurement(emulation_slowdown=2.0))
    assert store.add_profile_measurement(run_id, _measurement(dtype="bfloat16"))
    assert len(store.profile_measurements()) == 3


def test_profiled_keys_match_measurement_keys(store: Store) -> None:
    run_id = _run(store)
    measurements = [_measurement(), _measurement(emulation_slowdown=3.0, op="elementwise",
                                                 params={"numel": 8})]  # fmt: skip
    for m in measurements:
        store.add_profile_measurement(run_id, m)
    assert store.profiled_keys() == {measurement_key(m) for m in measurements}
    assert store.profiled_keys(op="gemm") == {measurement_key(measurements[0])}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"op": "conv"}, "op 'conv'"),
        ({"status": "slow"}, "status 'slow'"),
        ({"p10_s": 5e-6}, "p10 <= median <= p90"),
        ({"median_s": None}, "finite times"),
        ({"status": "error", "error": None}, "needs a one-line error"),
        ({"params": {"m": [1, 2]}}, "params['m']"),
        ({"emulation_slowdown": 0.5}, "emulation_slowdown"),
    ],
)
def test_bad_measurement_is_refused(store: Store, changes: dict, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(")):
        store.add_profile_measurement(_run(store), _measurement(**changes))
    assert store.profile_measurements() == []


def test_unknown_run_is_refused(store: Store) -> None:
    with pytest.raises(InputError, match="no profile run 99"):
        store.add_profile_measurement(99, _measurement())


@pytest.mark.parametrize(
    ("column", "value", "problem"),
    [
        ("params_json", "{not json", "not valid JSON"),
        ("extra_json", "[1, 2]", "must be JSON objects"),
        ("op", "conv", "unknown op 'conv'"),
        ("status", "maybe", "unknown status 'maybe'"),
    ],
)
def test_corrupt_row_is_reported_by_id(
    tmp_path: Path, column: str, value: str, problem: str
) -> None:
    url = f"sqlite:///{tmp_path / 'corrupt.db'}"
    with Store.open(url) as store:
        run_id = _run(store)
        store.add_profile_measurement(run_id, _measurement())
        store.add_profile_measurement(run_id, _measurement(params={"m": 1, "n": 1, "k": 1}))
        with store._engine.begin() as connection:  # what a crashed tool could have left behind
            connection.execute(
                text(f"UPDATE profile_measurements SET {column} = :value WHERE id = 2"),
                {"value": value},
            )
    with Store.open(url) as store, pytest.raises(InputError) as caught:
        store.profile_measurements()
    message = str(caught.value)
    assert "\n" not in message
    assert "profile_measurements row 2 is corrupt" in message and problem in message


def test_unknown_run_kind_is_refused(store: Store) -> None:
    with pytest.raises(InputError, match="compute or links"):
        _run(store, kind="other")
