"""Plans of several data-parallel replicas (issue 15): the search picks them where they are
faster, their prediction is the composition of their replicas' own, and the plan document
keeps them (schema 3) and refuses what the runtime cannot run."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from hexiseq import InfeasiblePlan, InputError, Plan, plan_search, predict
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.report import format_plan
from hexiseq.search.replicas import balanced_sequences, gradient_sync_s


@pytest.fixture(scope="module")
def mix32():
    """A batch of 16 sequences of 32K tokens, 3B model, on 32 GPUs of four types: each node
    holds a sequence."""
    return plan_search("mix4-32", "llama3.2-3b", "32k", micro_batches=16)


def test_replicas_win_clearly_on_128_mixed_gpus_at_32k():
    """The same batch of 64 sequences: 16 replicas of a node each, or one 128-GPU mesh taking
    them one after another."""
    replicated = plan_search("mix4-128", "llama3.2-3b", "32k", micro_batches=64).best
    one_mesh = plan_search(
        "mix4-128", "llama3.2-3b", "32k", micro_batches=64, data_parallel=False
    ).best
    assert replicated.data_parallel and len(replicated.replicas) >= 4
    assert not one_mesh.data_parallel
    assert replicated.train.micro_batches == one_mesh.train.micro_batches == 64
    assert replicated.predicted.tokens_per_s > 3 * one_mesh.predicted.tokens_per_s
    assert replicated.predicted.max_memory_fraction <= 0.95


def test_one_sequence_per_step_is_one_mesh():
    best = plan_search("mix4-32", "llama3.2-3b", "32k").best
    assert not best.data_parallel and best.train.micro_batches == 1
    assert best.layout().world_size == best.cluster.world_size


def test_one_mesh_where_no_gpu_type_holds_a_sequence_alone():
    best = plan_search("h100x8-a100x8", "llama-30b", "512k", micro_batches=4).best
    assert not best.data_parallel and len(best.replicas) == 1
    assert best.replicas[0].ranks == tuple(range(16)) and best.layout().world_size == 16
    assert best.replicas[0].sequences == 4


def test_a_replica_plan_is_consistent(mix32):
    plan = mix32.best
    assert plan.data_parallel
    assert sum(r.sequences for r in plan.replicas) == plan.train.micro_batches
    assert plan.predicted.tokens_per_s == pytest.approx(
        plan.train.seq_len * plan.train.micro_batches / plan.predicted.step_time_s
    )
    for rank in plan.predicted.ranks:  # everyone waits for the slowest replica, then syncs
        assert rank.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
        assert rank.sharding_exposed_comm_s >= plan.knobs["gradient_sync_s"] > 0
    for index, replica in enumerate(plan.replicas):
        own = plan.replica_plan(index)
        assert own.layout() == replica.layout and own.train.micro_batches == replica.sequences
        assert math.fsum(a.state_fraction for a in own.assignments) == pytest.approx(1.0)
        assert {plan.assignments[r].replica for r in replica.ranks} == {index}
        assert len({plan.cluster.devices[r].gpu for r in replica.ranks}) == 1


def test_a_replica_plan_round_trips_and_predicts_the_same(mix32, tmp_path):
    plan = mix32.best
    path = tmp_path / "plan.json"
    plan.to_json(path)
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["schema_version"] == 3 and len(document["replicas"]) == len(plan.replicas)
    assert Plan.from_json(path) == plan
    again = predict(plan, cost_model="datasheet")
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    assert [r.memory_bytes for r in again.ranks] == [r.memory_bytes for r in plan.predicted.ranks]


def test_a_search_of_one_mesh_never_returns_replicas():
    best = plan_search("mix4-32", "llama3.2-3b", "32k", micro_batches=16, data_parallel=False)
    assert not best.best.data_parallel


def test_a_batch_of_fewer_sequences_than_nodes_gets_larger_replicas():
    """4 sequences over 16 nodes: no more than 4 replicas, every one with a sequence."""
    plan = plan_search("mix4-128", "llama3.2-3b", "32k", micro_batches=4).best
    assert plan.data_parallel and 2 <= len(plan.replicas) <= 4
    assert all(replica.sequences >= 1 for replica in plan.replicas)


def test_the_plan_table_names_each_ranks_replica(mix32):
    text = format_plan(mix32.best)
    assert "data-parallel replicas taking" in text
    assert text.splitlines()[2].split()[:2] == ["rank", "replica"]


def test_layout_of_a_replica_plan_points_to_the_replicas(mix32):
    with pytest.raises(InputError, match=r"replicas\[i\]\.layout"):
        mix32.best.layout()


def test_balanced_sequences_finish_together():
    assert balanced_sequences([1.0, 2.0], 3) == [2, 1]
    assert balanced_sequences([1.0, 3.0], 4) == [3, 1]
    assert balanced_sequences([2.0, 2.0, 2.0], 3) == [1, 1, 1]
    assert balanced_sequences([1.0, 5.0], 2) == [2, 0]  # the slow one would finish later
    steps = [0.7, 1.3, 2.9]
    counts = balanced_sequences(steps, 10)
    makespan = max(k * s for k, s in zip(counts, steps))
    best = min(  # every split of 10 sequences over the three
        max(a * 0.7, b * 1.3, (10 - a - b) * 2.9) for a in range(11) for b in range(11 - a)
    )
    assert sum(counts) == 10 and makespan == pytest.approx(best)


def test_gradient_sync_is_a_ring_all_reduce_of_the_largest_shard(mix32):
    plan = mix32.best
    parts = [plan.replica_plan(i) for i in range(len(plan.replicas))]
    cost, cluster = DatasheetCostModel(), plan.cluster
    count, largest = len(parts), max(a.state_fraction for a in plan.assignments)
    moved = 2 * (count - 1) / count * 4 * plan.model.params * largest
    latency = 2 * (count - 1) * (plan.model.layers + 1) * cluster.inter_node_latency_us * 1e-6
    want = cost.transfer_time_s(moved, cluster.inter_node_GBps, 0.0) + latency
    assert gradient_sync_s(cluster, plan.model, parts, cost) == pytest.approx(want)
    assert gradient_sync_s(cluster, plan.model, parts[:1], cost) == 0.0


def _refused(document: dict, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        Plan.from_dict(document)


def test_broken_replica_documents_are_refused(mix32):
    document = mix32.best.to_dict()
    broken = copy.deepcopy(document)
    broken["replicas"] = broken["replicas"][:1]
    _refused(broken, "at least two")
    broken = copy.deepcopy(document)
    broken["replicas"][0]["ranks"], broken["replicas"][1]["ranks"] = (
        broken["replicas"][1]["ranks"],
        broken["replicas"][0]["ranks"],
    )
    _refused(broken, "replica")
    broken = copy.deepcopy(document)
    broken["replicas"][0]["sequences"] += 1
    _refused(broken, "sequences per step")
    broken = copy.deepcopy(document)
    broken["assignments"][0]["state_fraction"] += 0.5
    _refused(broken, "state fractions of replica 0")
    broken = copy.deepcopy(document)
    broken["replicas"][0]["colour"] = "blue"
    _refused(broken, "unknown key")
    broken = copy.deepcopy(document)
    first, second = broken["replicas"][0]["ranks"], broken["replicas"][1]["ranks"]
    first[-1], second[0] = second[0], first[-1]
    _refused(broken, "whole nodes")


def test_a_plan_of_one_mesh_keeps_its_replica_true_under_replace(mix32):
    mesh = plan_search("mix4-32", "llama3.2-3b", "32k", data_parallel=False).best
    train = dataclasses.replace(mesh.train, micro_batches=3)
    assert dataclasses.replace(mesh, train=train).replicas[0].sequences == 3
    assert "replicas" not in mesh.to_dict()


def mixed_cluster(nodes_per_type: int):
    from hexiseq import Cluster

    types = ("H200", "H100-SXM", "A100-80G", "L40S")
    nodes = [
        {"name": f"{gpu.lower()}-{i}", "gpu": gpu, "count": 8}
        for gpu in types
        for i in range(nodes_per_type)
    ]
    network = {"inter_node_GBps": 25, "inter_node_latency_us": 5}
    return Cluster.from_dict({"name": "mixed", "nodes": nodes, "network": network})


def test_16384_mixed_gpus_are_planned_as_replicas_not_ranks():
    """Beyond the one-mesh planner's 4,096 devices a batch is planned as replicas (each
    mesh once per node shape); the baselines say they were not planned."""
    result = plan_search(mixed_cluster(512), "llama3.2-3b", "32k", micro_batches=4096)
    plan = result.best
    assert plan.cluster.world_size == 16384 and plan.data_parallel
    assert sum(r.sequences for r in plan.replicas) == 4096 and len(plan.replicas) == 2048
    assert all(isinstance(b, InfeasiblePlan) for b in result.baselines.values())
    with pytest.raises(InputError, match="micro-batches"):
        plan_search(mixed_cluster(512), "llama3.2-3b", "32k")


def test_replicas_of_a_gpu_mix_where_no_type_holds_a_long_sequence_alone():
    """llama3-70b at 512K: no node of one type holds a sequence, but four replicas of the
    cluster's whole GPU mix (each planned by the search of one mesh) do, and beat one mesh
    over all 128 GPUs on the same batch."""
    kwargs = {"micro_batches": 32}
    best = plan_search("mix4-128", "llama3-70b", "512k", **kwargs).best
    mesh = plan_search("mix4-128", "llama3-70b", "512k", data_parallel=False, **kwargs).best
    assert best.data_parallel and len(best.replicas) >= 2
    for replica in best.replicas:
        assert len({best.cluster.devices[r].gpu for r in replica.ranks}) == 4
    assert best.predicted.tokens_per_s > mesh.predicted.tokens_per_s
    assert best.predicted.max_memory_fraction <= 0.95


def test_the_data_parallel_baseline_shares_the_same_batch(mix32):
    """Given a batch, the per-type baseline shares it too, and hexiseq's replicas (which
    include per-type ones, simulated with their real sequence counts) are not slower."""
    baseline = mix32.data_parallel
    assert baseline.sequences == mix32.best.train.micro_batches == 16
    assert mix32.speedup_over_data_parallel() >= 1.0
