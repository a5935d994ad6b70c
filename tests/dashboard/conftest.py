"""Fixtures of the dashboard tests: small search results and stores made the way users make
them (`hexiseq plan ... --store`, plus a runtime run row and a re-plan of its launch)."""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest

import hexiseq
from hexiseq.cli import main
from hexiseq.costmodel import FittedCostModel, fit_cost_model
from hexiseq.plan import Plan
from hexiseq.profiles import ProfileMeasurement
from hexiseq.store import Replan, RuntimeMeasurement, Store


@pytest.fixture(scope="session")
def tiny_result():
    """4 CPU ranks of two speeds, the tiny model, 8K tokens: every baseline fits."""
    return hexiseq.plan_search("cpu-emulated-2type", "tiny", 8192)


@pytest.fixture(scope="session")
def oom_result():
    """32 mixed GPUs with small cards, Llama-3-70B at 256K: every baseline is out of memory."""
    return hexiseq.plan_search("mix4-32", "llama3-70b", "256k")


@dataclass(frozen=True)
class PopulatedStore:
    url: str
    path: Path
    best_id: int


def quiet_main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def add_runtime_run(store: Store, plan: Plan, plan_id: int | None, steps: int = 3) -> int:
    """A runtime run row as `hexiseq run` writes it, measured 1.5x slower than predicted."""
    plan_json = plan.to_json_text()
    run_id = store.save_runtime_run(
        plan_json,
        plan_hash=hashlib.sha256(plan_json.encode()).hexdigest(),
        plan_id=plan_id,
        plan_name=plan.name,
        model_name=plan.model.name,
        seq_len=plan.train.seq_len,
        world_size=plan.cluster.world_size,
        steps=steps,
        backend="gloo",
        device="cpu",
        dtype="float32",
        emulation=True,
        torch_version="test",
    )
    step_s = 1.5 * plan.predicted.step_time_s
    store.add_runtime_measurements(
        run_id,
        [
            RuntimeMeasurement(
                rank=rank,
                step=step,
                step_time_s=step_s * (2.0 if step == 0 else 1.0),  # warm-up step
                rank_time_s=0.9 * step_s,
                peak_memory_bytes=plan.predicted.ranks[rank].memory_bytes,
                memory_measure="cpu_max_rss",
                device="cpu",
                loss=5.0,
                emulation_slowdown=plan.cluster.devices[rank].emulation_slowdown,
                emulation_label="none",
            )
            for step in range(steps)
            for rank in range(plan.cluster.world_size)
        ],
    )
    return run_id


def drift_replan(old: Plan, new: Plan, **changes) -> Replan:
    """A drift re-plan from `old` to `new` as `hexiseq run` records it: rank 1 measured 2x
    slower, the new plan predicted 1.25x and measured 1.2x faster than the old one."""
    step_s = new.predicted.step_time_s
    fields = dict(
        launch_id="launch-test",
        step=3,
        reason="drift",
        detail="rank 1 measured 2.00x slower than at the start",
        old_plan_json=old.to_json_text(),
        new_plan_json=new.to_json_text(),
        measured_slowdowns={1: 2.0},
        predicted_old_step_s=1.25 * step_s,
        predicted_new_step_s=step_s,
        planning_s=0.5,
        measured_before_step_s=1.5 * step_s,
        measured_after_step_s=1.25 * step_s,
    )
    return Replan(**(fields | changes))


@pytest.fixture(scope="session")
def make_drift_replan():
    """`drift_replan`, for tests (a test module cannot import this conftest by name)."""
    return drift_replan


@pytest.fixture(scope="session")
def populated_store(tmp_path_factory, fitted_document) -> PopulatedStore:
    """Two `hexiseq plan` searches saved with their baselines, a runtime run of the tiny plan
    and a re-plan of it to its ring-only baseline, a profile run and its fitted model."""
    path = tmp_path_factory.mktemp("store") / "hexiseq.db"
    url = f"sqlite:///{path}"
    for model in ("tiny-7h", "tiny"):
        argv = ["plan", "--cluster", "cpu-emulated-2type", "--model", model, "--seq-len", "8k"]
        assert quiet_main([*argv, "--store", url]) == 0
    with Store.open(url) as store:
        best = next(r for r in store.list_plans() if r.label == "best" and r.model_name == "tiny")
        plan = Plan.from_json_text(store.get_plan_json(best.id))
        add_runtime_run(store, plan, best.id)
        ring = next(r for r in store.list_plans() if r.label == "ring-only" and r.id > best.id)
        store.save_replan(drift_replan(plan, Plan.from_json_text(store.get_plan_json(ring.id))))
        add_profiles(store, fitted_document)
    return PopulatedStore(url, path, best.id)


@pytest.fixture()
def empty_store_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'empty.db'}"


def gemm_point(size: int, seconds_per_flop: float = 2e-11) -> ProfileMeasurement:
    """A CPU float32 GEMM of size^3 whose time is exactly linear in its FLOPs and bytes."""
    flops, nbytes = 2.0 * size**3, 4.0 * 3 * size**2
    seconds = seconds_per_flop * flops + 1e-10 * nbytes + 1e-5
    return ProfileMeasurement(
        device_type="cpu",
        op="gemm",
        params={"m": size, "n": size, "k": size},
        dtype="float32",
        flops=flops,
        bytes_moved=nbytes,
        status="ok",
        median_s=seconds,
        p10_s=0.95 * seconds,
        p90_s=1.1 * seconds,
        samples=10,
        device_name="test cpu",
        torch_version="test",
    )


def p2p_point(message_bytes: int) -> ProfileMeasurement:
    seconds = 5e-5 + message_bytes / 1e9
    return ProfileMeasurement(
        device_type="cpu",
        op="p2p",
        params={"world": 2, "message_bytes": message_bytes},
        dtype="float32",
        flops=0.0,
        bytes_moved=float(message_bytes),
        status="ok",
        median_s=seconds,
        p10_s=seconds,
        p90_s=seconds,
        samples=10,
        device_name="test cpu",
        torch_version="test",
        link_class="intra:cpu",
    )


def oom_point() -> ProfileMeasurement:
    return ProfileMeasurement(
        device_type="cpu",
        op="gemm",
        params={"m": 65536, "n": 65536, "k": 65536},
        dtype="float32",
        flops=0.0,
        bytes_moved=0.0,
        status="oom",
        median_s=None,
        p10_s=None,
        p90_s=None,
        samples=0,
        device_name="test cpu",
        torch_version="test",
        error="out of memory",
    )


PROFILE_POINTS = [
    *(gemm_point(size) for size in (64, 96, 128, 192, 256, 384, 512, 768)),
    *(p2p_point(2**power) for power in range(10, 24, 2)),
    oom_point(),
]


@pytest.fixture(scope="session")
def profile_points() -> list[ProfileMeasurement]:
    return PROFILE_POINTS


@pytest.fixture(scope="session")
def fitted_document():
    return fit_cost_model(PROFILE_POINTS)


def add_profiles(store: Store, document) -> None:
    """The points as one profile run, and their fit, as `hexiseq profile` / `hexiseq fit` do."""
    run_id = store.save_profile_run(
        kind="compute",
        device_type="cpu",
        device_name="test cpu",
        torch_version="test",
        cuda_version=None,
        host="test",
        command="test",
        grid_name="test",
        quick=True,
    )
    for point in PROFILE_POINTS:
        store.add_profile_measurement(run_id, point)
    store.save_fitted_model(FittedCostModel(document).to_json())
