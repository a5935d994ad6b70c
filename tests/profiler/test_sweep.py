"""The compute sweep on the CPU: rows, statistics, resume, failures, emulation padding."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from profiler_cases import TINY_GRID_POINTS

from hexiseq.profiler import ComputeSweep, run_compute_sweep
from hexiseq.profiler import _sweep as sweep_module
from hexiseq.profiler._timing import CpuTimer, pad_by_sleeping, summarize
from hexiseq.profiles import COMPUTE_OPS, measurement_key
from hexiseq.store import Store


def test_tiny_sweep_writes_one_timed_row_per_point(store: Store, tiny_sweep) -> None:
    summary = run_compute_sweep(store, tiny_sweep, show_progress=False)
    rows = store.profile_measurements()
    assert len(rows) == TINY_GRID_POINTS and summary.statuses == {"ok": TINY_GRID_POINTS}
    assert {r.op for r in rows} == set(COMPUTE_OPS)
    for row in rows:
        assert row.status == "ok" and row.error is None
        assert row.samples == 10 and row.extra["rounds"] == 5
        assert 0 < row.p10_s <= row.median_s <= row.p90_s
        assert (row.device_type, row.dtype, row.link_class) == ("cpu", "float32", None)
        assert row.device_name and row.host and row.torch_version == torch.__version__
        assert row.extra["threads"] == torch.get_num_threads()
        assert row.extra["grid"] == "tiny" and row.emulation_slowdown == 1.0
    kernels = {r.op: r.extra["kernel"] for r in rows}
    assert kernels == {"gemm": "linear", "attention_fwd": "cpu_flash",
                       "attention_bwd": "cpu_flash", "elementwise": "add"}  # fmt: skip


def test_each_family_is_timed_in_interleaved_rounds(
    store: Store, tiny_sweep, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_timed_visit, visits = sweep_module.timed_visit, []

    def recording_visit(timer, calls, *, warmup_s, count, offset=0):
        visits.append((len(calls), warmup_s, count, offset))
        return real_timed_visit(timer, calls, warmup_s=warmup_s, count=count, offset=offset)

    real_build_calls, builds = sweep_module.build_calls, []

    def recording_build(point, device, input_sets):
        builds.append(point)
        return real_build_calls(point, device, input_sets)

    monkeypatch.setattr(sweep_module, "timed_visit", recording_visit)
    monkeypatch.setattr(sweep_module, "build_calls", recording_build)
    run_compute_sweep(store, tiny_sweep, max_points=2, show_progress=False)  # the 2 gemms
    assert len(visits) == 2 * 5  # each point once per round
    assert [v[1] is None for v in visits] == [False, False] + [True] * 8  # warm-up on the first
    assert [v[2] for v in visits] == [2] * 10 and [v[3] for v in visits[-2:]] == [8, 8]
    assert len(builds) == 2  # inputs kept between rounds while they fit the budget
    rows = store.profile_measurements()
    assert [r.samples for r in rows] == [10, 10]

    builds.clear()
    monkeypatch.setattr(sweep_module, "_keep_budget_bytes", lambda device: 0.0)
    with Store.open(f"sqlite:///{tmp_path / 'rebuilt.db'}") as fresh:
        run_compute_sweep(fresh, tiny_sweep, max_points=2, show_progress=False)
    assert len(builds) == 2 * 5  # no budget: rebuilt on every visit


def test_flops_of_known_shapes(store: Store, tiny_sweep) -> None:
    run_compute_sweep(store, tiny_sweep, show_progress=False)
    rows = {(r.op, tuple(sorted(r.params.items()))): r for r in store.profile_measurements()}
    gemm = rows[("gemm", (("k", 32), ("m", 32), ("n", 32)))]
    assert gemm.flops == 2 * 32**3
    causal = {"q_len": 16, "kv_len": 16, "heads": 2, "head_dim": 16, "causal": True}
    forward = rows[("attention_fwd", tuple(sorted(causal.items())))]
    backward = rows[("attention_bwd", tuple(sorted(causal.items())))]
    assert forward.flops == 4 * 16 * (16 * 17 // 2) * 2
    assert backward.flops == 2.5 * forward.flops
    elementwise = rows[("elementwise", (("numel", 1024),))]
    assert elementwise.flops == 0 and elementwise.bytes_moved == 3 * 1024 * 4


def test_stopped_sweep_resumes_without_duplicates(store: Store, tiny_sweep) -> None:
    first = run_compute_sweep(store, tiny_sweep, max_points=3, show_progress=False)
    assert sum(first.statuses.values()) == 3 and len(store.profile_measurements()) == 3
    second = run_compute_sweep(store, tiny_sweep, show_progress=False)
    assert second.already_stored == 3
    assert sum(second.statuses.values()) == TINY_GRID_POINTS - 3
    rows = store.profile_measurements()
    assert len(rows) == TINY_GRID_POINTS
    assert len({measurement_key(r) for r in rows}) == TINY_GRID_POINTS
    third = run_compute_sweep(store, tiny_sweep, show_progress=False)
    assert third.run_id is None and not third.statuses  # nothing left: no empty run recorded


def test_interrupted_sweep_keeps_what_it_finished(
    store: Store, tiny_sweep, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build_calls = sweep_module.build_calls
    built = []

    def interrupt_at_fourth_point(point, device, input_sets):
        built.append(point)
        if len(built) == 4:
            raise KeyboardInterrupt  # Ctrl-C stops the sweep; it is not a failed point
        return real_build_calls(point, device, input_sets)

    monkeypatch.setattr(sweep_module, "build_calls", interrupt_at_fourth_point)
    with pytest.raises(KeyboardInterrupt):
        run_compute_sweep(store, tiny_sweep, show_progress=False)
    # The gemm family (2 points) was done and written; attention_fwd was being timed.
    assert [(r.op, r.status) for r in store.profile_measurements()] == [("gemm", "ok")] * 2
    monkeypatch.setattr(sweep_module, "build_calls", real_build_calls)
    run_compute_sweep(store, tiny_sweep, show_progress=False)
    assert len(store.profile_measurements()) == TINY_GRID_POINTS


def test_failing_sizes_are_recorded_and_the_sweep_goes_on(
    store: Store, tiny_sweep, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build_calls = sweep_module.build_calls

    def fail_some(point, device, input_sets):
        if point.op == "gemm" and point.params["m"] == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB\nmore")
        if point.op == "elementwise":
            raise RuntimeError("kernel exploded")
        return real_build_calls(point, device, input_sets)

    monkeypatch.setattr(sweep_module, "build_calls", fail_some)
    summary = run_compute_sweep(store, tiny_sweep, show_progress=False)
    assert summary.statuses == {"ok": TINY_GRID_POINTS - 2, "oom": 1, "error": 1}
    failed = {r.status: r for r in store.profile_measurements() if r.status != "ok"}
    assert failed["oom"].error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB"
    assert failed["error"].error == "RuntimeError: kernel exploded"
    assert failed["oom"].median_s is None and failed["oom"].samples == 0
    # Failed points are kept, so a rerun does not retry them.
    assert run_compute_sweep(store, tiny_sweep, show_progress=False).run_id is None


def test_point_too_big_for_cpu_memory_is_oom_without_trying(
    store: Store, tiny_sweep, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep_module, "available_memory_bytes", lambda: 1024)
    run_compute_sweep(store, tiny_sweep, max_points=1, show_progress=False)
    (row,) = store.profile_measurements()
    assert row.status == "oom" and "not attempted" in row.error


def test_emulated_rows_are_their_own_points(store: Store, tiny_sweep: ComputeSweep) -> None:
    run_compute_sweep(store, tiny_sweep, max_points=2, show_progress=False)
    emulated = dataclasses.replace(tiny_sweep, emulation_slowdown=2.0)
    summary = run_compute_sweep(store, emulated, max_points=2, show_progress=False)
    assert summary.already_stored == 0
    slowdowns = [r.emulation_slowdown for r in store.profile_measurements()]
    assert slowdowns == [1.0, 1.0, 2.0, 2.0]


def test_cpu_timer_pads_by_sleeping_k_minus_1_times() -> None:
    def sleep_20ms() -> None:
        time.sleep(0.02)

    padded_s = CpuTimer(slowdown=3.0).time_call(sleep_20ms)
    assert 0.058 <= padded_s < 0.2  # 20 ms + 2 x 20 ms of padding (the machine may be busy)
    assert 0.019 <= CpuTimer().time_call(sleep_20ms) < 0.1


def test_short_padding_is_exact() -> None:
    start = time.perf_counter()
    pad_by_sleeping(2e-4)  # spins: time.sleep overshoots requests this short
    assert 2e-4 <= time.perf_counter() - start < 5e-3


def test_summary_statistics() -> None:
    stats = summarize([float(v) for v in range(10, 0, -1)])
    assert (stats.median_s, stats.p10_s, stats.p90_s) == pytest.approx((5.5, 1.9, 9.1))
    assert stats.samples == 10
