"""`benchmarks/step_trace.py` on a hand-made Chrome trace: busy and idle device time, kernel
families, the host operator each idle gap waited for, host synchronizations."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_trace  # noqa: E402


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(ts, correlation, name="cudaLaunchKernel"):
    args = {"correlation": correlation}
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "ts": ts,
        "dur": 2,
        "tid": 1,
        "args": args,
    }


def _kernel(name, ts, dur, correlation, cat="kernel"):
    args = {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": args}


def trace_events() -> list[dict]:
    """Host: a GEMM launched at 0, an elementwise kernel at 5, then a 100 us host stretch
    inside `outer` ending in `aten::mul`'s launch; a synchronization. Device: the GEMM
    [10, 40), a copy [40, 50), a 60 us gap, the mul [110, 120)."""
    return [
        _op("aten::mm", 0, 4),
        _launch(1, 1),
        _op("aten::copy_", 5, 4),
        _launch(6, 2, "cudaMemcpyAsync"),
        _op("outer", 10, 100),
        _op("aten::mul", 100, 9),
        _launch(104, 3),
        _launch(112, 99, "cudaStreamSynchronize"),
        _kernel("nvjet_sm90_tst_256x128_gemm", 10, 30, 1),
        _kernel("Memcpy DtoD (Device -> Device)", 40, 10, 2, cat="gpu_memcpy"),
        _kernel("vectorized_elementwise_kernel<mul>", 110, 10, 3),
    ]


def test_busy_idle_families_and_the_operator_an_idle_gap_waited_for():
    figures = step_trace.analyse(trace_events())
    assert figures["window_ms"] == pytest.approx(0.110)
    assert figures["busy_ms"] == pytest.approx(0.050)
    assert figures["idle_ms"] == pytest.approx(0.060)
    assert figures["families"]["gemm"] == {"ms": pytest.approx(0.030), "count": 1}
    assert figures["families"]["copy/memset"]["count"] == 1
    assert figures["families"]["elementwise/other"]["count"] == 1
    assert figures["idle_by_operator"] == {"aten::mul": pytest.approx(0.060)}
    assert figures["idle_by_outer_operator"] == {"outer": pytest.approx(0.060)}
    assert figures["syncs"]["count"] == 1
    assert figures["host_operators"] == 3  # mm, copy_, outer (mul is inside outer)


def test_reads_gzipped_traces_and_refuses_one_without_device_events(tmp_path, capsys):
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": trace_events()}, handle)
    assert step_trace.main([str(path)]) == 0
    assert "idle before a kernel launched by" in capsys.readouterr().out
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": [_op("aten::mm", 0, 4)]}))
    with pytest.raises(SystemExit, match="no device events"):
        step_trace.main([str(cpu_only)])
