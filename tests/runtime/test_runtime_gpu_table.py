"""`benchmarks/runtime_gpu.py`'s prediction table: the peak with its reserve against what the
device held (the allocator's reserved peak plus the memory outside it), where a run recorded
them, and a dash where it did not (runs from before)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from runtime_gpu import _prediction_table  # noqa: E402

GIB = 2**30


def _report(hexiseq_side: dict) -> dict:
    row = {
        "seq_len": 8192,
        "checkpointing": False,
        "predicted_step_s": 0.5,
        "predicted_peak_bytes": 70 * GIB,
        "predicted_memory_fraction": 0.5,
        "predicted_memory_terms": {"reserve": 4 * GIB},
        "hexiseq": hexiseq_side,
    }
    return {"meta": {"warmup": 1, "device_kind": "cuda"}, "rows": [row]}


def _side(**extra) -> dict:
    return {
        "status": "ok",
        "step_times_s": [0.9, 0.7, 0.7],
        "peaks": [64 * GIB, 66 * GIB, 66 * GIB],
        **extra,
    }


def _cells(lines: list[str]) -> list[str]:
    (row,) = [line for line in lines if line.startswith("| 8,192")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_peak_with_its_reserve_is_compared_with_what_the_device_held():
    side = _side(
        reserved_peaks=[67 * GIB, 68 * GIB, 68 * GIB],
        outside_allocator=[GIB // 2, GIB, GIB],
    )
    cells = _cells(_prediction_table(_report(side)))
    assert cells[5:8] == ["66.00", "66.00", "+0.0 %"]  # allocated: 70 - 4 GiB reserve
    assert cells[-3:] == ["70.00", "69.00", "+1.4 %"]  # 70 against 68 + 1 GiB


def test_runs_that_did_not_record_the_reserved_peak_show_a_dash():
    cells = _cells(_prediction_table(_report(_side())))
    assert cells[-3:] == ["70.00", "—", "—"]
    none_recorded = _side(reserved_peaks=[None] * 3, outside_allocator=[None] * 3)
    assert _cells(_prediction_table(_report(none_recorded)))[-2:] == ["—", "—"]


def test_repredict_without_saved_rows_is_one_clear_error(capsys):
    from runtime_gpu import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--repredict"])
    assert "--repredict re-plans saved rows: it needs --from-json" in capsys.readouterr().err
