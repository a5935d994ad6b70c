"""Nodes cut into HP groups of their own sizes (`GlobalChoices.node_groups`), and the local
solve keeping the fastest split it tried."""

from __future__ import annotations

import pytest

from hexiseq import Cluster, ModelSpec, Plan, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.costmodel.memory import even_state_fractions
from hexiseq.search import local_milp, plan_search
from hexiseq.search import polish as polish_module
from hexiseq.search._evaluate import Problem, memory_shortfall, simulated
from hexiseq.search.greedy import (
    GlobalChoices,
    degree_cut,
    form_groups,
    node_groups_text,
    parse_node_groups,
    with_node_groups,
)
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.objective import choices_from_params, params_of
from hexiseq.search.screen import estimate_s, grouping

A100, H100 = "A100-80G", "H100-SXM"


def cluster_of(nodes: list[tuple[str, str, int]], GBps: float = 100.0) -> Cluster:
    return Cluster.from_dict(
        {
            "name": "cut-test",
            "nodes": [{"name": n, "gpu": gpu, "count": count} for n, gpu, count in nodes],
            "network": {"inter_node_GBps": GBps},
        }
    )


def problem_for(cluster: Cluster, model: str, seq_len: int) -> Problem:
    return Problem(
        cluster, ModelSpec.preset(model), TrainSpec(seq_len=seq_len), DatasheetCostModel()
    )


# plan_quality.py's cluster #4 (seed 2024): its exhaustive optimum cuts the A100 node 2+1+1+1
PLAN_QUALITY_4 = [("n0", A100, 5), ("n1", H100, 6)]


def test_a_node_cut_of_its_own_sizes_keeps_consecutive_ranks_and_the_others_by_degree():
    cluster = cluster_of([("a", A100, 5), ("b", A100, 5), ("h", H100, 4)])
    groups = form_groups(cluster, {A100: 4, H100: 2}, (("b", (2, 1, 1, 1)),))
    assert groups == {
        "a": [(0, 1, 2, 3), (4,)],  # the type's degree: 4 + 1
        "b": [(5, 6), (7,), (8,), (9,)],
        "h": [(10, 11), (12, 13)],
    }
    assert (
        degree_cut(5, 4) == (4, 1) and degree_cut(6, 2) == (2, 2, 2) and degree_cut(2, 4) == (2,)
    )


def test_a_cut_equal_to_the_types_is_no_cut_and_cuts_are_part_of_the_identity():
    cluster = cluster_of(PLAN_QUALITY_4)
    plain = GlobalChoices({A100: 4, H100: 2}, "bandwidth", 256, False)
    cut = with_node_groups(cluster, plain, "n0", (2, 1, 1, 1))
    assert cut.node_groups == (("n0", (2, 1, 1, 1)),) and cut.key() != plain.key()
    again = with_node_groups(cluster, cut, "n0", (4, 1))  # the type's own cut: dropped
    assert again.node_groups == () and again.key() == plain.key()


@pytest.mark.parametrize(
    "cuts", [(), (("n0", (2, 1, 1, 1)),), (("n0", (3, 2)), ("n1", (4, 1, 1)))]
)
def test_a_trials_parameters_carry_the_cuts_both_ways(cuts):
    problem = problem_for(cluster_of(PLAN_QUALITY_4), "llama2-7b", 1 << 17)
    choices = GlobalChoices({A100: 4, H100: 2}, "file", 256, True, cuts)
    params = params_of(choices, 256)
    assert ("node_groups" in params) == bool(cuts)  # Optuna's own trials never carry it
    assert choices_from_params(problem, params).key() == choices.key()
    assert parse_node_groups(node_groups_text(cuts)) == cuts


def test_a_cut_nodes_plan_has_those_groups_and_says_so():
    problem = problem_for(cluster_of(PLAN_QUALITY_4), "llama2-7b", 1 << 17)
    choices = GlobalChoices({A100: 4, H100: 1}, "bandwidth", 128, False, (("n0", (2, 1, 1, 1)),))
    plan = plan_for_choices(problem, choices)
    assert isinstance(plan, Plan)
    sizes = plan.knobs["hp_group_sizes"]
    assert sorted(sizes) == sorted([2, 1, 1, 1] + [1] * 6)
    assert plan.knobs["hp_node_groups"] == {"n0": [2, 1, 1, 1]}
    members = {tuple(group) for group in plan.layout().groups}
    assert {(0, 1), (2,), (3,), (4,)} <= members
    # the screen prices it through its groups (its per-type shortcut does not apply)
    groups, _ = grouping(problem, choices)
    assert (0, 1) in groups and estimate_s(problem, choices) < float("inf")


def test_the_polish_cuts_only_nodes_of_unequal_groups_on_small_clusters():
    cluster = cluster_of(PLAN_QUALITY_4)
    problem = problem_for(cluster, "llama2-7b", 1 << 17)
    choices = GlobalChoices({A100: 4, H100: 2}, "bandwidth", 256, False)
    plan = plan_for_choices(problem, choices)
    found = polish_module.neighbours(problem, choices, [128, 256, 512], plan)
    cut = [c for c in found if c.node_groups]
    # n0 (4 + 1) is cut every other way (7 partitions of 5 less its own); n1 (2+2+2) is not
    assert {c.node_groups for c in cut} == {
        (("n0", sizes),) for sizes in polish_module.partitions(5, 5) if sizes != (4, 1)
    }
    assert len(cut) == 6
    # a degree move of the type drops its nodes' own cuts
    moved = polish_module.neighbours(problem, cut[0], [256], plan)
    a100_moves = [c for c in moved if c.hp_degrees[A100] != 4]
    assert a100_moves and all(c.node_groups == () for c in a100_moves)
    big = cluster_of([(f"n{i}", A100, 5) for i in range(4)])  # 20 devices: no cuts
    big_problem = problem_for(big, "llama2-7b", 1 << 17)
    big_choices = GlobalChoices({A100: 4}, "bandwidth", 256, False)
    big_plan = plan_for_choices(big_problem, big_choices)
    assert big.world_size > polish_module.NODE_CUTS_UP_TO
    assert not any(
        c.node_groups for c in polish_module.neighbours(big_problem, big_choices, [256], big_plan)
    )


def test_partitions_are_every_descending_sum():
    assert polish_module.partitions(5, 5) == [
        (5,), (4, 1), (3, 2), (3, 1, 1), (2, 2, 1), (2, 1, 1, 1), (1, 1, 1, 1, 1)
    ]  # fmt: skip
    assert polish_module.partitions(4, 2) == [(2, 2), (2, 1, 1), (1, 1, 1, 1)]


def test_the_default_search_reaches_past_one_degree_per_type_on_plan_quality_4():
    """Without the cut moves the polish stops at A100 4 + 1, H100 2+2+2, 1.09 % short of the
    exhaustive optimum; with them it goes on (through a cut) to a faster plan."""
    cluster = cluster_of(PLAN_QUALITY_4)
    with_cuts = plan_search(cluster, "llama2-7b", "128k").best
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(polish_module, "NODE_CUTS_UP_TO", 0)
        without = plan_search(cluster, "llama2-7b", "128k").best
    assert with_cuts.predicted.tokens_per_s > without.predicted.tokens_per_s


@pytest.mark.parametrize(
    "nodes, model, seq_len",
    [
        ([("n0", "V100-32G", 3), ("n1", "H200", 2), ("n2", "A100-40G", 6)], "llama2-7b", 1 << 16),
        (
            [("n0", A100, 1), ("n1", A100, 5), ("n2", "A100-40G", 2), ("n3", "RTX-4090", 4)],
            "tiny-7h",
            1 << 16,
        ),
    ],
)
def test_the_local_solve_keeps_the_fastest_split_it_tried(monkeypatch, nodes, model, seq_len):
    """Every split the re-linearization lays out is simulated; the solve's answer simulates no
    slower than any of them (by more than the tolerance) where even state shares fit."""
    problem = problem_for(cluster_of(nodes, 50.0), model, seq_len)
    tried = []
    original = local_milp._time_coefficients

    def recording(problem, layout, classes, quantum):
        tried.append(layout)
        return original(problem, layout, classes, quantum)

    monkeypatch.setattr(local_milp, "_time_coefficients", recording)
    even = even_state_fractions(problem.cluster.world_size)
    checked = 0
    for degrees in ({gpu: 1 for gpu in problem.cluster.gpu_types}, None):
        degrees = degrees or {gpu: 2 for gpu in problem.cluster.gpu_types}
        choices = GlobalChoices(degrees, "bandwidth", 256, False)
        groups, heads = grouping(problem, choices)
        tried.clear()
        solution = local_milp.solve_local(problem, groups, heads, 256)
        if solution.layout is None or memory_shortfall(problem, solution.layout, even):
            continue
        solved_s = simulated(problem, solution.layout).step_time_s
        for layout in tried:
            if not memory_shortfall(problem, layout, even):
                slack = 1 + local_milp.TIME_TOLERANCE
                assert solved_s <= simulated(problem, layout).step_time_s * slack
                checked += 1
    assert checked >= 2
