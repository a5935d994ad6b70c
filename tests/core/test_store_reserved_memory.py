"""The allocator's reserved peak and the memory outside it, per runtime measurement: round trip
on SQLite and PostgreSQL at GPU sizes (beyond 32-bit integers), None where not measured, and
older stores (the shared H100 one) opening with every row and these columns empty."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_store_runtime_kernels import SHARED_H100_STORE, _measurement, _run, shared_store_copy

from hexiseq.store import Store

GIB = 2**30


def _round_trip(url: str) -> None:
    with Store.open(url) as store:
        run_id = _run(store)
        measured = replace(
            _measurement(0, 0, "cudnn"),
            peak_memory_bytes=123 * GIB + 7,  # an H200's allocated peak
            reserved_peak_bytes=131 * GIB + 11,
            outside_allocator_bytes=3 * GIB // 4,
        )
        unmeasured = _measurement(1, 0, "cudnn")
        store.add_runtime_measurements(run_id, [measured, unmeasured])
        rows = store.runtime_measurements(run_id)
    assert rows == [measured, unmeasured]
    assert (rows[1].reserved_peak_bytes, rows[1].outside_allocator_bytes) == (None, None)


def test_reserved_memory_round_trips_at_gpu_sizes(tmp_path):
    _round_trip(f"sqlite:///{tmp_path / 's.db'}")


def test_reserved_memory_round_trips_at_gpu_sizes_on_postgresql(postgresql_database):
    _round_trip(postgresql_database)


@pytest.mark.skipif(not SHARED_H100_STORE.exists(), reason="no ../shared/data here")
def test_the_shared_h100_store_opens_with_every_row_and_no_reserved_figures(tmp_path):
    with Store.open(shared_store_copy(tmp_path)) as store:
        runs = store.list_runtime_runs()
        rows = [m for run in runs for m in store.runtime_measurements(run["id"])]
    assert len(runs) >= 6 and len(rows) >= 20
    assert max(m.peak_memory_bytes for m in rows) > 60 * GIB  # the 3B runs' peaks, kept
    assert all(m.reserved_peak_bytes is None for m in rows)
