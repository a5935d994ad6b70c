"""The memory model against what the runtime really allocates (issue 11, item 1).

The runtime's real training step (`runtime.train.run_step`, model, sharded states and AdamW
built as `hexiseq run` builds them) runs on CPU in bfloat16 under
`runtime.allocations.AllocationTracker`, which counts every live storage. Each phase of the
memory model is compared with the tracker's peak of that phase, and the step's peak with the
model's: within 5 % and never more than 3 % under (what the shared H100 runs are held to).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


from hexiseq import Cluster, plan_search  # noqa: E402
from hexiseq.costmodel.memory import estimate_memory  # noqa: E402
from hexiseq.runtime.allocations import AllocationTracker, measure_step_allocations  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from distributed import run_distributed  # noqa: E402

MiB = 2**20
OVER, UNDER = 0.05, 0.03


def bf16_plan(model: str, seq_len: int, ranks: int, checkpointing: bool):
    """A plan for `ranks` CPU ranks, made for bfloat16 compute (what the probe runs)."""
    cluster = Cluster.from_dict(
        {"name": "cpu", "nodes": [{"name": "n0", "gpu": "cpu", "count": ranks}]}
    )
    plan = plan_search(cluster, model, seq_len, activation_checkpointing=checkpointing).best
    train = dataclasses.replace(plan.train, compute_dtype_bytes=2)
    return dataclasses.replace(plan, train=train)


def modelled(plan):
    fractions = [a.state_fraction for a in plan.assignments]
    return estimate_memory(plan.cluster, plan.model, plan.train, plan.layout(), fractions)


def assert_close(measured: int, predicted: int, what: str) -> None:
    ratio = predicted / measured
    assert 1 - UNDER <= ratio <= 1 + OVER, (
        f"{what}: model {predicted / MiB:.2f} MiB, runtime {measured / MiB:.2f} MiB "
        f"({(ratio - 1) * 100:+.1f} %)"
    )


def check_phases(plan, measured, breakdown) -> None:
    phases = breakdown.phase_bytes()
    backward = max(v for k, v in phases.items() if "backward" in k)
    assert_close(measured.peak_bytes, breakdown.allocated_bytes, "step peak")
    assert_close(measured.phases["backward"].peak_bytes, backward, "backward peak")
    assert_close(measured.phases["optimizer"].peak_bytes, phases["optimizer"], "optimizer")
    retained = phases["forward_end"] - breakdown.weight_cache
    assert_close(measured.retained_after_forward_bytes, retained, "held after the forward")


@pytest.mark.parametrize(
    ("model", "seq_len", "checkpointing"),
    [
        ("small", 2048, True),
        ("small", 2048, False),
        ("tiny", 4096, True),
        pytest.param("small", 4096, True, marks=pytest.mark.slow),
        pytest.param("small", 8192, True, marks=pytest.mark.slow),
        pytest.param("small", 4096, False, marks=pytest.mark.slow),
        pytest.param("tiny", 8192, False, marks=pytest.mark.slow),
    ],
)
def test_one_rank_step_allocates_what_the_model_says(
    one_rank_group, model, seq_len, checkpointing
):
    plan = bf16_plan(model, seq_len, 1, checkpointing)
    measured = measure_step_allocations(plan, 0, torch.bfloat16, sharded=True)
    check_phases(plan, measured, modelled(plan)[0])


def test_one_rank_terms_match_the_tensors_they_name(one_rank_group):
    """States by kind: parameters and AdamW states exactly; fused AdamW makes no temporary."""
    plan = bf16_plan("small", 2048, 1, True)
    breakdown = modelled(plan)[0]
    measured = measure_step_allocations(plan, 0, torch.bfloat16, sharded=True)
    kinds = measured.by_kind_after_forward
    assert kinds["parameters"] == breakdown.parameters
    # Made by the first step's AdamW: the moments, and a 4-byte step counter per tensor:
    # one flat master shard per unit (each block, and the root).
    tensors = plan.model.layers + 1
    assert kinds["optimizer"] == breakdown.optimizer_states + 4 * tensors
    optimizer = measured.phases["optimizer"]
    assert optimizer.growth_bytes == breakdown.optimizer_transients == 0


def test_memory_grows_with_the_tokens_as_the_runtime_does(one_rank_group):
    """The slope per token, not only the level: 2K -> 8K tokens."""
    short, long = (bf16_plan("small", n, 1, False) for n in (2048, 8192))
    measured = [
        measure_step_allocations(p, 0, torch.bfloat16, True).peak_bytes for p in (short, long)
    ]
    predicted = [modelled(p)[0].allocated_bytes for p in (short, long)]
    assert_close(measured[1] - measured[0], predicted[1] - predicted[0], "growth 2K -> 8K")


def _two_rank_probe(rank, world_size, plan_json, results):
    from hexiseq.plan import Plan

    plan = Plan.from_json_text(plan_json)
    measured = measure_step_allocations(plan, rank, torch.bfloat16, sharded=True)
    results[rank] = (
        measured.peak_bytes,
        measured.phases["backward"].peak_bytes,
        measured.phases["optimizer"].peak_bytes,
        measured.retained_after_forward_bytes,
    )


@pytest.mark.multiproc
def test_two_ranks_with_sharded_states_and_the_ring_allocate_what_the_model_says(tmp_path):
    import torch.multiprocessing as mp

    plan = bf16_plan("small", 4096, 2, True)
    assert len(plan.layout().groups) == 2  # a ring of two groups
    results = mp.Manager().dict()
    run_distributed(_two_rank_probe, 2, plan.to_json_text(), results, timeout_s=300)
    for rank, breakdown in enumerate(modelled(plan)):
        peak, backward, optimizer, retained = results[rank]
        phases = breakdown.phase_bytes()
        assert_close(peak, breakdown.allocated_bytes, f"rank {rank} step peak")
        assert_close(optimizer, phases["optimizer"], f"rank {rank} optimizer")
        assert_close(
            retained, phases["forward_end"] - breakdown.weight_cache, f"rank {rank} forward"
        )


def test_tracker_counts_storages_once_and_frees_them():
    tracker = AllocationTracker()
    with tracker, tracker.phase("work"):
        a = torch.ones(1024)  # 4 KiB
        view = a[:10]  # a view: no new storage
        b = a * 2  # 4 KiB
        del b
        c = torch.zeros(256, dtype=torch.bfloat16)  # 512 B
        assert tracker.live_bytes == 4096 + 512
    assert tracker.phases["work"].peak_bytes == 8192 + 0  # a and b together, before c
    del a, view, c
    assert tracker.live_bytes == 0
