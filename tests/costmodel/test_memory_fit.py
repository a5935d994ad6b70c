"""Calibrating the memory model against measured peaks: the fit recovers a known reserve and
scale, its held-out split is held out, the store feeds it, and the planner uses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_main

from hexiseq import Cluster, ModelSpec
from hexiseq.costmodel import FittedCostModel, RuntimeSource, fit_cost_model
from hexiseq.costmodel._fit_document import parse_fitted_document
from hexiseq.costmodel._memory_fit import memory_points
from hexiseq.errors import InfeasibleError
from hexiseq.search import plan_search
from hexiseq.store import RuntimeMeasurement, Store

MiB = 2**20
CLUSTER = Cluster.from_dict({"name": "cpu2", "nodes": [{"name": "a", "gpu": "cpu", "count": 2}]})
RESERVE_BYTES, SCALE = 350 * MiB, 1.6


@pytest.fixture(scope="module")
def plans():
    """Datasheet plans of the small model at six sequence lengths on two CPU ranks."""
    model = ModelSpec.preset("small")
    return [plan_search(CLUSTER, model, seq, n_trials=4).best for seq in
            (2048, 4096, 8192, 12288, 16384, 24576)]  # fmt: skip


def _measured(plans, rng, noise=0.01) -> list[RuntimeSource]:
    """Runs whose ranks peaked at RESERVE + SCALE x (modelled peak - modelled reserve)."""
    runs = []
    for run_id, plan in enumerate(plans, start=1):
        peaks = []
        for rank, predicted in enumerate(plan.predicted.ranks):
            dynamic = predicted.memory_bytes - predicted.memory_terms["reserve"]
            true_bytes = RESERVE_BYTES + SCALE * dynamic
            peaks.append((rank, "cpu_max_rss", int(true_bytes * np.exp(rng.normal(0, noise)))))
        runs.append(RuntimeSource(run_id, plan.to_json_text(), peaks))
    return runs


def test_calibration_recovers_the_reserve_and_scale(plans) -> None:
    document = fit_cost_model([], runtime_runs=_measured(plans, np.random.default_rng(1)))
    (fit,) = document.memory
    assert (fit.device_type, fit.memory_measure, fit.points) == ("cpu", "cpu_max_rss", 12)
    assert fit.reserve_bytes == pytest.approx(RESERVE_BYTES, rel=0.05)
    assert fit.scale == pytest.approx(SCALE, rel=0.05)
    assert fit.heldout.train_points == 8 and fit.heldout.test_points == 4
    assert fit.heldout.extrapolation_mape < 0.03
    exact = fit_cost_model([], runtime_runs=_measured(plans, np.random.default_rng(1), 0.0))
    assert exact.memory[0].heldout.extrapolation_mape < 1e-6


def test_heldout_split_is_held_out(plans) -> None:
    # The largest third measured 30 % above the line: a fit that saw them could not miss
    # them all by that much on the same side.
    runs = _measured(plans, np.random.default_rng(2), 0.0)
    for source in runs[-2:]:
        source.peaks[:] = [(r, m, int(b * 1.3)) for r, m, b in source.peaks]
    (fit,) = fit_cost_model([], runtime_runs=runs).memory
    assert fit.heldout.extrapolation_bias < -0.15


def test_too_few_sizes_are_skipped_not_fitted(plans) -> None:
    document = fit_cost_model([], runtime_runs=_measured(plans[:3], np.random.default_rng(3)))
    assert document.memory == ()
    assert any(s.what == "memory cpu cpu_max_rss" for s in document.skipped)


def _save_run(store: Store, plan, peak_bytes) -> int:
    """A runtime run of `plan` whose rank r peaked at peak_bytes(rank, step) in steps 0-2."""
    run_id = store.save_runtime_run(
        plan.to_json_text(), plan_hash="x", plan_name=plan.name, model_name="small",
        seq_len=plan.train.seq_len, world_size=2, steps=3, backend="gloo", device="cpu",
        dtype="float32", emulation=False, torch_version="test",
    )  # fmt: skip
    store.add_runtime_measurements(run_id, [
        RuntimeMeasurement(rank=rank, step=step, step_time_s=1.0, rank_time_s=1.0,
                           peak_memory_bytes=peak_bytes(rank, step),
                           memory_measure="cpu_max_rss", device="cpu", loss=1.0,
                           emulation_slowdown=1.0, emulation_label="none")
        for step in range(3) for rank in range(2)
    ])  # fmt: skip
    return run_id


def test_runs_come_from_the_store_with_each_rank_largest_peak(tmp_path: Path, plans) -> None:
    from hexiseq.cli.fit import read_runtime_sources

    plan = plans[0]
    with Store.open(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        run_id = _save_run(store, plan, lambda rank, step: (100 + 10 * step + rank) * MiB)
        (source,) = read_runtime_sources(store)
    assert source.run_id == run_id
    assert sorted(source.peaks) == [(0, "cpu_max_rss", 120 * MiB), (1, "cpu_max_rss", 121 * MiB)]
    points = memory_points([source])
    assert [p.measured_bytes for p in points] == [120 * MiB, 121 * MiB]
    assert points[0].dynamic_bytes == plan.predicted.ranks[0].memory_bytes - 256 * MiB


def test_the_planner_uses_the_calibration(plans) -> None:
    document = fit_cost_model([], runtime_runs=_measured(plans, np.random.default_rng(4), 0.0))
    cost = FittedCostModel(document)
    calibration = cost.memory_calibration("cpu")
    assert calibration.reserve_bytes == pytest.approx(RESERVE_BYTES, rel=1e-3)
    assert cost.memory_calibration("H100-SXM") is None
    model = ModelSpec.preset("small")
    plain = plan_search(CLUSTER, model, 8192, n_trials=4).best
    calibrated = plan_search(CLUSTER, model, 8192, n_trials=4, cost_model=cost).best
    for before, after in zip(plain.predicted.ranks, calibrated.predicted.ranks):
        dynamic = before.memory_bytes - before.memory_terms["reserve"]
        assert after.memory_terms["reserve"] == calibration.reserve_bytes
        assert after.memory_bytes == pytest.approx(RESERVE_BYTES + SCALE * dynamic, rel=1e-3)
        assert sum(after.memory_terms.values()) == pytest.approx(after.memory_bytes, abs=8)
    assert calibrated.predicted.cost_model["cpu"].endswith("; memory calibrated by measured peaks")
    text = cost.to_json()
    assert parse_fitted_document(text).memory == document.memory  # persisted as JSON


def test_a_calibration_can_make_a_plan_not_fit(plans) -> None:
    # A device whose measured peaks grow 200x faster than modelled: the 16K plan that fits
    # the uncalibrated model's 95 % of 24 GiB no longer does, and the search says so.
    runs = _measured(plans, np.random.default_rng(5), 0.0)
    for source, plan in zip(runs, plans):
        dynamic = [r.memory_bytes - r.memory_terms["reserve"] for r in plan.predicted.ranks]
        source.peaks[:] = [(r, m, RESERVE_BYTES + 200 * dynamic[r]) for r, m, _ in source.peaks]
    cost = FittedCostModel(fit_cost_model([], runtime_runs=runs))
    model = ModelSpec.preset("small")
    assert plan_search(CLUSTER, model, 16384, n_trials=4).best.predicted.max_memory_fraction < 0.1
    with pytest.raises(InfeasibleError, match="no plan for small at 16384 tokens fits"):
        plan_search(CLUSTER, model, 16384, n_trials=4, cost_model=cost)


def test_hexiseq_fit_calibrates_memory_from_runs_alone(tmp_path: Path, plans) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store.open(url) as store:
        for source in _measured(plans, np.random.default_rng(6)):
            peaks = {rank: peak for rank, _, peak in source.peaks}
            _save_run(store, plans[source.run_id - 1], lambda rank, step, p=peaks: p[rank])
    result = run_main(["fit", "--store", url])
    assert result.code == 0, result.stderr
    assert "memory peak (cpu_max_rss: 3" in result.stdout and "x model)" in result.stdout
    assert "no device type (memory calibration only)" in result.stdout
    assert "memory calibrated by measured peaks for cpu" in result.stdout
    with Store.open(url) as store:
        cost = FittedCostModel.from_json(store.latest_fitted_model())
    assert cost.memory_calibration("cpu").scale == pytest.approx(SCALE, rel=0.05)


def test_runs_of_calibrated_plans_are_not_calibrated_twice(plans) -> None:
    # A plan made with a calibrated model carries calibrated peaks; its run's point is the
    # memory model's own peak all the same, so a refit finds the same calibration.
    runs = _measured(plans, np.random.default_rng(7), 0.0)
    cost = FittedCostModel(fit_cost_model([], runtime_runs=runs))
    model = ModelSpec.preset("small")
    replanned = [plan_search(CLUSTER, model, p.train.seq_len, n_trials=4, cost_model=cost).best
                 for p in plans]  # fmt: skip
    assert replanned[0].predicted.ranks[0].memory_terms["reserve"] != 256 * MiB
    again = [RuntimeSource(s.run_id, p.to_json_text(), s.peaks) for s, p in zip(runs, replanned)]
    assert [(p.dynamic_bytes, p.modelled_bytes) for p in memory_points(again)] == [
        (p.dynamic_bytes, p.modelled_bytes) for p in memory_points(runs)
    ]
    refit = fit_cost_model([], runtime_runs=again).memory[0]
    assert refit.scale == pytest.approx(SCALE, rel=1e-3)


def test_a_run_of_uneven_state_shares_is_modelled_with_those_shares():
    """The sharded runtime holds the plan's state fractions, even or not: the points of its
    runs model each rank with its own share (a run of the former FSDP2 runtime: even)."""
    import dataclasses
    import json

    plan = plan_search(CLUSTER, ModelSpec.preset("small"), 4096).best
    peaks = [(0, "cpu_max_rss", 10**9), (1, "cpu_max_rss", 10**9)]

    def run_of(fractions, recorded=True):
        assignments = tuple(
            dataclasses.replace(a, state_fraction=f) for a, f in zip(plan.assignments, fractions)
        )
        document = json.loads(dataclasses.replace(plan, assignments=assignments).to_json_text())
        assert document["train"]["runtime_recipe"] == "sharded"
        if not recorded:  # a run from before the runtime recorded its recipe
            del document["train"]["runtime_recipe"]
        return memory_points([RuntimeSource(1, json.dumps(document), peaks)])

    big, small = run_of((0.8, 0.2))
    near_big, near_small = run_of((0.6, 0.4))
    gap, near_gap = (
        big.dynamic_bytes - small.dynamic_bytes,
        near_big.dynamic_bytes - (near_small.dynamic_bytes),
    )
    assert near_gap > 0 and gap / near_gap == pytest.approx(3.0, rel=0.02)  # 0.6 / 0.2 of states
    even_big, even_small = run_of((0.8, 0.2), recorded=False)
    assert even_big.dynamic_bytes == even_small.dynamic_bytes
