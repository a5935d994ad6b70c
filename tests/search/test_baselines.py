"""The baselines: homogeneous-style grids, and the fastest homogeneous subset."""

from __future__ import annotations

import pytest

from hexiseq import Cluster, ModelSpec, Plan, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.plan import InfeasiblePlan
from hexiseq.search import plan_search
from hexiseq.search._evaluate import Problem
from hexiseq.search.baselines import (
    MAX_SEQUENCES_PER_REPLICA,
    all_baselines,
    data_parallel,
    homogeneous_subset,
    ring_only,
    strongest,
    ulysses_only,
    uniform_grid_plan,
    uniform_usp,
)


def problem_for(cluster, model: str, seq_len: int) -> Problem:
    return Problem(
        cluster, ModelSpec.preset(model), TrainSpec(seq_len=seq_len), DatasheetCostModel()
    )


def test_grids_split_tokens_and_heads_evenly():
    problem = problem_for(Cluster.preset("h100x8-a100x8"), "llama3-8b", 256 * 1024)
    plan = uniform_grid_plan(problem, 4, "grid")
    assert isinstance(plan, Plan)
    assert {a.tokens for a in plan.assignments} == {256 * 1024 // 16}
    assert {a.heads for a in plan.assignments} == {32 // 4}
    assert all(a.state_fraction == pytest.approx(1 / 16) for a in plan.assignments)
    ring, ulysses = ring_only(problem), ulysses_only(problem)
    assert ring.knobs["hp_degree"] == 1 and ulysses.knobs["hp_degree"] == 16
    assert ring.name == "ring-only" and ulysses.name == "ulysses-only"


def test_a_grid_that_cannot_split_the_heads_evenly_says_so():
    problem = problem_for(Cluster.preset("h100x8-a100x8"), "llama-30b", 256 * 1024)
    plan = ulysses_only(problem)  # 52 heads over 16 ranks
    assert isinstance(plan, InfeasiblePlan)
    assert "52 heads are not divisible by HP degree 16" in plan.reason


def test_grids_drop_the_recompute_where_memory_allows_it():
    problem = problem_for(Cluster.preset("h100x8-a100x8"), "llama3-8b", 64 * 1024)
    plan = uniform_usp(problem)
    assert plan.knobs["activation_checkpointing"] is False
    forced = Problem(
        problem.cluster, problem.model, problem.train, problem.cost, checkpointing_options=(True,)
    )
    slower = uniform_usp(forced)
    assert slower.knobs["activation_checkpointing"] is True
    assert slower.predicted.tokens_per_s < plan.predicted.tokens_per_s


def test_homogeneous_subset_runs_on_one_gpu_type_alone():
    problem = problem_for(Cluster.preset("h100x8-a100x8"), "llama-30b", 128 * 1024)
    plan = homogeneous_subset(problem)
    assert isinstance(plan, Plan)
    gpus = {device.gpu for device in plan.cluster.devices}
    assert len(gpus) == 1 and plan.cluster.world_size == 8
    assert plan.knobs["devices_used"] == 8 and plan.knobs["devices_dropped"] == 8
    assert plan.name.startswith("homogeneous-subset (")
    each = []
    for gpu in ("H100-SXM", "A100-80G"):
        nodes = [n.name for n in problem.cluster.nodes if n.gpu == gpu]
        sub = problem_for(problem.cluster.subset(nodes), "llama-30b", 128 * 1024)
        each.append(uniform_usp(sub).predicted.tokens_per_s)
    assert plan.predicted.tokens_per_s == pytest.approx(max(each))


def test_homogeneous_subset_that_cannot_fit_names_the_missing_bytes_on_global_ranks():
    cluster = Cluster.preset("mix4-32")
    problem = problem_for(cluster, "llama3-70b", 256 * 1024)
    plan = homogeneous_subset(problem)
    assert isinstance(plan, InfeasiblePlan)
    assert "GiB short" in plan.reason and plan.missing_bytes
    assert max(plan.missing_bytes) < cluster.world_size
    closest_gpu = plan.reason.split("the closest, ")[1].split(" alone")[0]
    assert {cluster.devices[r].gpu for r in plan.missing_bytes} == {closest_gpu}


def test_homogeneous_clusters_have_no_subset_baseline():
    cluster = Cluster.from_dict(
        {"name": "one-type", "nodes": [{"name": "n0", "gpu": "H100-SXM", "count": 8}]}
    )
    assert "homogeneous-subset" not in all_baselines(problem_for(cluster, "llama3-8b", 65536))


def test_speedups_are_reported_against_the_strongest_feasible_baseline():
    result = plan_search("h100x8-a100x8", "llama-30b", "128k")
    best_baseline = strongest(result.baselines)
    feasible = [b for b in result.baselines.values() if isinstance(b, Plan)]
    assert best_baseline.predicted.tokens_per_s == max(b.predicted.tokens_per_s for b in feasible)
    assert result.strongest_baseline is best_baseline
    expected = result.best.predicted.tokens_per_s / best_baseline.predicted.tokens_per_s
    assert result.speedup_over_strongest() == pytest.approx(expected)
    assert result.speedup_over_strongest() <= min(
        result.speedup_over(name) for name, b in result.baselines.items() if isinstance(b, Plan)
    )


def test_data_parallel_replicas_balance_the_types_and_pay_the_gradient_sync():
    problem = problem_for(Cluster.preset("h100x8-a100x8"), "llama-30b", 128 * 1024)
    replicas = data_parallel(problem)
    assert replicas is not None and {r.gpu for r in replicas.replicas} == {"H100-SXM", "A100-80G"}
    steps = [r.sequences * r.plan.predicted.step_time_s for r in replicas.replicas]
    assert replicas.step_time_s == pytest.approx(max(steps) + replicas.gradient_sync_s)
    sequences = sum(r.sequences for r in replicas.replicas)
    assert replicas.tokens_per_s == pytest.approx(128 * 1024 * sequences / replicas.step_time_s)
    # the faster type takes more sequences, each replica at most MAX_SEQUENCES_PER_REPLICA
    by_gpu = {r.gpu: r for r in replicas.replicas}
    assert by_gpu["H100-SXM"].sequences >= by_gpu["A100-80G"].sequences
    assert all(1 <= r.sequences <= MAX_SEQUENCES_PER_REPLICA for r in replicas.replicas)
    # no better balance exists among the counts it may choose
    rates = [
        128
        * 1024
        * (h + a)
        / (
            max(
                h * by_gpu["H100-SXM"].plan.predicted.step_time_s,
                a * by_gpu["A100-80G"].plan.predicted.step_time_s,
            )
            + replicas.gradient_sync_s
        )
        for h in range(1, 9)
        for a in range(1, 9)
    ]
    assert replicas.tokens_per_s == pytest.approx(max(rates))
    assert replicas.gradient_sync_s > 0


def test_data_parallel_needs_two_types_that_hold_a_sequence_each():
    small = problem_for(Cluster.preset("mix4-32"), "llama3-70b", 256 * 1024)
    assert data_parallel(small) is None  # no type holds 256K of a 70B model alone
    one_type = Cluster.from_dict(
        {"name": "one-type", "nodes": [{"name": "n0", "gpu": "H100-SXM", "count": 8}]}
    )
    homogeneous = problem_for(one_type, "llama3-8b", 65536)
    assert data_parallel(homogeneous) is None
    # decided before any sub-cluster is planned: a one-type "subset" is the cluster itself
    assert not [key for key in homogeneous.cache if key[0] == "type subsets"]


def test_the_cli_says_when_replicas_would_beat_the_plan(tmp_path):
    from hexiseq.report import format_search_result

    result = plan_search("h100x8-a100x8", "llama-30b", "128k")
    text = format_search_result(result)
    assert "data-parallel replicas (H100-SXM x 8" in text
    ratio = result.speedup_over_data_parallel()
    assert (ratio < 1.0) == ("hexiseq plans data-parallel replicas sharing it" in text)
