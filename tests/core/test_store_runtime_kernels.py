"""The attention kernels of runtime runs in the store: round trip, bad names, and stores written
before they were recorded (which must open and keep every row)."""

from __future__ import annotations

import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from hexiseq.errors import InputError
from hexiseq.store import RuntimeMeasurement, Store

SHARED_H100_STORE = Path(__file__).resolve().parents[3] / "shared" / "data" / "h100-profile.db"
"""The real store of the H100 runs (`../shared/data`), written by hexiseq 490c15d."""
VERSION_1_STORE = Path(__file__).with_name("data") / "store-v1.db"
"""A store written by hexiseq cde2901 (schema version 1, before migrations)."""


def shared_store_copy(tmp_path: Path) -> str:
    """The URL of a writable copy of the shared H100 store."""
    path = tmp_path / "h100.db"
    shutil.copy(SHARED_H100_STORE, path)
    path.chmod(0o644)
    return f"sqlite:///{path}"


def _run(store: Store) -> int:
    return store.save_runtime_run(
        '{"name": "p"}',
        plan_hash="abc",
        plan_name="p",
        model_name="tiny",
        seq_len=64,
        world_size=2,
        steps=2,
        backend="nccl",
        device="cuda",
        dtype="bfloat16",
        emulation=False,
        torch_version="2.13.0",
    )


def _measurement(rank: int, step: int, kernels: str = "") -> RuntimeMeasurement:
    return RuntimeMeasurement(
        rank=rank,
        step=step,
        step_time_s=0.5,
        rank_time_s=0.4,
        peak_memory_bytes=2**30,
        memory_measure="cuda_max_allocated",
        device="cuda:0 (H100-SXM)",
        loss=10.5,
        emulation_slowdown=1.0,
        emulation_label="none",
        attention_kernels=kernels,
    )


def test_each_rank_and_step_keeps_the_kernels_it_ran(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = _run(store)
        store.add_runtime_measurements(
            run_id,
            [_measurement(0, 0, "cudnn"), _measurement(1, 0, "cudnn,flash"),
             _measurement(0, 1, "cudnn"), _measurement(1, 1, "flash")],
        )  # fmt: skip
        rows = store.runtime_measurements(run_id)
        assert [(m.step, m.rank, m.attention_kernels) for m in rows] == [
            (0, 0, "cudnn"), (0, 1, "cudnn,flash"), (1, 0, "cudnn"), (1, 1, "flash"),
        ]  # fmt: skip
        (run,) = store.list_runtime_runs()
        assert run["attention_kernels"] == "cudnn,flash"


def test_a_measurement_without_kernels_reads_back_empty(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = _run(store)
        store.add_runtime_measurements(run_id, [_measurement(0, 0)])
        assert store.runtime_measurements(run_id)[0].attention_kernels == ""
        assert store.list_runtime_runs()[0]["attention_kernels"] == ""


@pytest.mark.parametrize("label", ["tensorrt", "flash,cudnn", "cudnn,", "cudnn,cudnn", 3])
def test_names_the_kernel_rule_does_not_know_are_refused(tmp_path, label):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = _run(store)
        with pytest.raises(InputError, match="attention_kernels"):
            store.add_runtime_measurements(run_id, [_measurement(0, 0, label)])
        assert store.runtime_measurements(run_id) == []  # nothing of the batch was written


def test_a_store_from_before_kernels_were_recorded_opens_with_every_row(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(VERSION_1_STORE, path)
    with sqlite3.connect(path) as connection:  # the tables as hexiseq wrote them before
        connection.execute("DROP TABLE runtime_attention_kernels")
        (run_id,) = connection.execute("SELECT id FROM runtime_runs").fetchone()
        measured = connection.execute(
            "SELECT COUNT(*) FROM runtime_measurements WHERE run_id = ?", (run_id,)
        ).fetchone()[0]
    with Store.open(f"sqlite:///{path}") as store:
        before = store.runtime_measurements(run_id)
        assert len(before) == measured and {m.attention_kernels for m in before} == {""}
        store.add_runtime_measurements(
            run_id, [replace(before[-1], step=9, attention_kernels="cudnn")]
        )
        rows = store.runtime_measurements(run_id)
    assert rows[:-1] == before and (rows[-1].step, rows[-1].attention_kernels) == (9, "cudnn")


@pytest.mark.skipif(not SHARED_H100_STORE.exists(), reason="no ../shared/data here")
def test_the_shared_h100_store_opens_keeps_its_runs_and_records_kernels(tmp_path):
    with Store.open(shared_store_copy(tmp_path)) as store:
        runs = store.list_runtime_runs()
        assert len(runs) >= 6 and {run["attention_kernels"] for run in runs} == {""}
        first = min(run["id"] for run in runs)
        before = store.runtime_measurements(first)
        assert before and all(m.attention_kernels == "" for m in before)
        store.add_runtime_measurements(
            first, [replace(before[-1], step=99, attention_kernels="cudnn")]
        )
        after = store.runtime_measurements(first)
    assert after[:-1] == before and after[-1].attention_kernels == "cudnn"
