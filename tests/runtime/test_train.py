"""The train loop's pieces without torchrun: compute padding, the store's runtime tables, and
(`slow`) `hexiseq run` on a 'tiny' plan over 4 CPU ranks, two of them emulated 2x slower."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from hexiseq import Cluster, ModelSpec
from hexiseq.errors import InputError
from hexiseq.runtime._emulation import MIN_SLEEP_S, ComputePadding, compute_phase
from hexiseq.runtime.model import LocalAttention, build_model
from hexiseq.store import RuntimeMeasurement, Store


def test_compute_padding_sleeps_k_minus_1_times_the_phases_and_never_inside_one():
    """k = 3: the sleeps add up to 2x the time spent in padded phases, which is most of a
    forward-backward (bounds are loose: the test machine's cores are shared)."""
    model = build_model(ModelSpec.preset("tiny"), LocalAttention())
    tokens = torch.randint(0, model.spec.vocab, (1, 128))
    padding = ComputePadding(model, 3.0)
    began = time.perf_counter()
    for _ in range(3):
        model(tokens, torch.arange(128)).sum().backward()
        padding.flush()
    total_s = time.perf_counter() - began
    padding.remove()
    unpadded_s = total_s - padding.padded_s
    assert padding._open == 0
    assert 0.5 * unpadded_s < padding.padded_s <= 2.0 * unpadded_s + 3 * MIN_SLEEP_S


def test_attention_blocks_are_padded_only_while_a_padding_is_active():
    """`compute_phase` (around each ring step's attention kernels) adds (k - 1) x its own
    duration to the active padding; without an active padding, or after `remove`, nothing."""
    model = build_model(ModelSpec.preset("tiny"), LocalAttention())
    busy_s = 0.02

    def spin() -> None:
        began = time.perf_counter()
        while time.perf_counter() - began < busy_s:
            pass

    with compute_phase():
        spin()  # no padding yet
    padding = ComputePadding(model, 2.5)
    with compute_phase():
        spin()
    assert padding.padded_s >= 1.5 * busy_s  # slept right after the phase (debt >= 1 ms)
    assert padding.debt_s < MIN_SLEEP_S
    padding.remove()
    before = padding.padded_s
    with compute_phase():
        spin()
    assert padding.padded_s == before


def measurement(rank: int, step: int, **overrides) -> RuntimeMeasurement:
    fields = dict(
        rank=rank,
        step=step,
        step_time_s=0.1,
        rank_time_s=0.09,
        peak_memory_bytes=2**20,
        memory_measure="cpu_max_rss",
        device="cpu (plan: cpu)",
        loss=6.2,
        emulation_slowdown=2.0,
        emulation_label="emulated 2x slower (compute padded by sleeping)",
    )
    return RuntimeMeasurement(**{**fields, **overrides})


def test_store_keeps_runtime_runs_and_refuses_bad_measurements(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = store.save_runtime_run(
            '{"name": "p"}',
            plan_hash="abc",
            plan_name="p",
            model_name="tiny",
            seq_len=64,
            world_size=2,
            steps=2,
            backend="gloo",
            device="cpu",
            dtype="float32",
            emulation=True,
            torch_version=torch.__version__,
        )
        store.add_runtime_measurements(run_id, [measurement(r, s) for s in (1, 0) for r in (1, 0)])
        rows = store.runtime_measurements(run_id)
        assert [(m.step, m.rank) for m in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert store.list_runtime_runs(plan_hash="abc")[0]["emulation"] is True
        with pytest.raises(InputError, match="memory_measure"):
            store.add_runtime_measurements(run_id, [measurement(0, 2, memory_measure="rss")])
        with pytest.raises(InputError, match="step_time_s"):
            store.add_runtime_measurements(run_id, [measurement(0, 2, step_time_s=float("nan"))])
        with pytest.raises(InputError, match="no runtime run"):
            store.add_runtime_measurements(run_id + 1, [measurement(0, 2)])
        assert len(store.runtime_measurements(run_id)) == 4


@pytest.mark.slow
@pytest.mark.multiproc
def test_hexiseq_run_records_one_row_per_rank_per_step(tmp_path):
    from hexiseq.search import plan_search

    cluster = Cluster.preset("cpu-emulated-2type")
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 256, seed=0).best
    plan_path, url = tmp_path / "plan.json", f"sqlite:///{tmp_path / 'runs.db'}"
    plan.to_json(plan_path)
    command = [sys.executable, "-m", "hexiseq.cli", "run", "--plan", str(plan_path)]
    done = subprocess.run(
        [*command, "--steps", "3", "--store", url, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with Store.open(url) as store:
        (run,) = store.list_runtime_runs()
        assert (run["world_size"], run["steps"], run["backend"]) == (4, 3, "gloo")
        assert run["emulation"] is True
        rows = store.runtime_measurements(run["id"])
    assert [(m.step, m.rank) for m in rows] == [(s, r) for s in range(3) for r in range(4)]
    assert all(m.memory_measure == "cpu_max_rss" and m.peak_memory_bytes > 2**20 for m in rows)
    assert all(0 < m.rank_time_s <= m.step_time_s for m in rows)
    slowdowns = [device.emulation_slowdown for device in cluster.devices]
    assert [m.emulation_slowdown for m in rows[:4]] == slowdowns
    assert all((m.emulation_label == "none") == (m.emulation_slowdown == 1.0) for m in rows)
    assert len({round(m.loss, 6) for m in rows if m.step == 0}) == 1  # one loss, every rank


def test_train_refuses_a_world_size_that_does_not_match_the_plan(tmp_path, monkeypatch):
    from hexiseq.runtime import train
    from hexiseq.search import plan_search

    plan = plan_search(Cluster.preset("cpu-emulated-2type"), ModelSpec.preset("tiny"), 64).best
    plan.to_json(tmp_path / "plan.json")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--plan", str(tmp_path / "plan.json"), "--no-store"]) == 2


def test_padding_slows_the_sharded_models_layers_as_the_plain_ones():
    """Sharded states bind each layer's weight per forward instead of owning a parameter:
    the emulated slowdown still pads every linear and norm (not only attention)."""
    from hexiseq.runtime.sharding import shard_model_states

    spec = ModelSpec.preset("tiny")
    plain = build_model(spec, LocalAttention())
    sharded = build_model(spec, LocalAttention(), device="meta")
    shard_model_states(sharded, seed=0, device="cpu")
    hooked = [len(ComputePadding(m, 2.0)._handles) for m in (plain, sharded)]
    assert hooked[0] == hooked[1] == 4 * (7 * spec.layers + 2 * spec.layers + 2)


def test_a_collective_inside_a_compute_phase_is_not_padded():
    """A layer's backward may wait on its unit's all-gather (`sharding`): that wait is not
    compute, so a slower emulated device pads only the compute around it."""
    from hexiseq.runtime._emulation import communication_phase

    model = build_model(ModelSpec.preset("tiny"), LocalAttention())
    padding = ComputePadding(model, 2.0)
    with compute_phase():
        began = time.perf_counter()
        while time.perf_counter() - began < 0.01:  # 10 ms of "compute"
            pass
        with communication_phase():
            time.sleep(0.2)  # 200 ms waiting on peers
    padding.flush()
    padding.remove()
    assert 0.01 <= padding.padded_s < 0.1  # the compute's 10 ms, not the 200 ms wait
