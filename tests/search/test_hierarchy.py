"""Greedy global stage, exact local MILP and the Optuna layer."""

from __future__ import annotations

import itertools
import math

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq import Cluster, ModelSpec, Plan, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.costmodel.memory import MEMORY_LIMIT_FRACTION
from hexiseq.plan import InfeasiblePlan
from hexiseq.search import plan_search
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    GlobalChoices,
    default_choices,
    explicit_ring_order,
    form_groups,
    greedy_candidates,
    order_ring,
    split_heads,
)
from hexiseq.search.hierarchy import plan_for_choices


def problem_for(cluster: Cluster, model: str, seq_len: int) -> Problem:
    return Problem(
        cluster, ModelSpec.preset(model), TrainSpec(seq_len=seq_len), DatasheetCostModel()
    )


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=1, max_value=5).flatmap(
        lambda n: st.tuples(
            st.integers(min_value=n, max_value=12),
            st.lists(st.floats(min_value=0.2, max_value=5.0), min_size=n, max_size=n),
        )
    )
)
def test_split_heads_is_the_exact_min_max(case):
    heads, speeds = case
    split = split_heads(heads, speeds)
    assert sum(split) == heads and min(split) >= 1
    best = min(
        max(h / s for h, s in zip(option, speeds))
        for option in itertools.product(range(1, heads + 1), repeat=len(speeds))
        if sum(option) == heads
    )
    assert max(h / s for h, s in zip(split, speeds)) == pytest.approx(best)


def cluster_of(name: str, nodes: list[tuple[str, str, int]], GBps: float, slow=()) -> Cluster:
    """A cluster of (node, GPU, count) nodes, `GBps` between nodes but (a, b, GBps) `slow`."""
    return Cluster.from_dict(
        {
            "name": name,
            "nodes": [{"name": n, "gpu": gpu, "count": count} for n, gpu, count in nodes],
            "network": {
                "inter_node_GBps": GBps,
                "overrides": [{"a": a, "b": b, "GBps": link} for a, b, link in slow],
            },
        }
    )


def eight_type_cluster() -> Cluster:
    gpus = ["H100-SXM", "A100-80G", "H200", "L40S", "RTX-4090", "V100-32G", "A800-80G", "B200"]
    counts = [8, 6, 4, 5, 3, 8, 2, 7]  # odd node sizes on purpose
    nodes = [(f"n{i}", g, c) for i, (g, c) in enumerate(zip(gpus, counts))]
    return cluster_of("eight-types", nodes, 50, slow=[("n0", "n1", 5)])


def test_groups_stay_inside_nodes_with_odd_sizes():
    cluster = eight_type_cluster()
    groups = form_groups(cluster, {gpu: 4 for gpu in cluster.gpu_types})
    assert [len(g) for g in groups["n1"]] == [4, 2]  # 6 GPUs at degree 4
    assert [len(g) for g in groups["n4"]] == [3]  # 3 GPUs at degree 4
    node_of = {d.rank: d.node for d in cluster.devices}
    for name, node_groups in groups.items():
        assert all(node_of[r] == name for g in node_groups for r in g)
    assert sorted(r for gs in groups.values() for g in gs for r in g) == list(range(43))


def test_bandwidth_ring_order_avoids_the_slow_link():
    cluster = eight_type_cluster()
    groups = form_groups(cluster, {gpu: 8 for gpu in cluster.gpu_types})
    speed = {gpu: 1.0 for gpu in cluster.gpu_types}
    ring = order_ring(cluster, groups, "bandwidth", speed)
    node_of = {d.rank: d.node for d in cluster.devices}
    nodes = [node_of[g[0]] for g in ring]
    hops = {frozenset((nodes[i - 1], nodes[i])) for i in range(len(nodes))}
    assert frozenset(("n0", "n1")) not in hops  # the 5 GB/s override is never a ring hop
    # The file order would use it:
    file_ring = order_ring(cluster, groups, "file", speed)
    file_nodes = [node_of[g[0]] for g in file_ring]
    assert file_nodes[:2] == ["n0", "n1"]


def test_an_explicit_ring_order_visits_the_named_nodes_and_refuses_others():
    cluster = eight_type_cluster()
    groups = form_groups(cluster, {gpu: 8 for gpu in cluster.gpu_types})
    speed = {gpu: 1.0 for gpu in cluster.gpu_types}
    names = list(groups)[::-1]
    ring = order_ring(cluster, groups, explicit_ring_order(names), speed)
    node_of = {d.rank: d.node for d in cluster.devices}
    assert list(dict.fromkeys(node_of[g[0]] for g in ring)) == names
    with pytest.raises(ValueError, match="each node once"):
        order_ring(cluster, groups, explicit_ring_order(names[1:]), speed)


def test_every_ring_order_is_a_permutation_of_the_groups():
    cluster = eight_type_cluster()
    groups = form_groups(cluster, {gpu: 2 for gpu in cluster.gpu_types})
    speed = {gpu: float(i + 1) for i, gpu in enumerate(cluster.gpu_types)}
    flat = sorted(g for gs in groups.values() for g in gs)
    for strategy in ("bandwidth", "file", "fastest-first", "interleaved"):
        assert sorted(order_ring(cluster, groups, strategy, speed)) == flat


def test_greedy_candidates_start_with_the_default_and_are_distinct():
    cluster = Cluster.preset("mix4-32")
    model = ModelSpec.preset("llama-30b")
    candidates = greedy_candidates(cluster, model)
    assert candidates[0] == default_choices(cluster, model)
    assert len({c.key() for c in candidates}) == len(candidates)


def test_milp_plan_fits_validates_and_handles_uneven_gqa_heads():
    # 32 query heads / 8 KV heads (GQA 4) over odd node sizes: 6 GPUs at HP degree 6 gives
    # head counts 6,6,5,5,5,5 and KV heads shared across group members.
    cluster = eight_type_cluster()
    problem = problem_for(cluster, "llama3-8b", 512 * 1024)
    plan = plan_for_choices(problem, GlobalChoices({gpu: 6 for gpu in cluster.gpu_types}))
    assert isinstance(plan, Plan)
    layout = plan.layout()
    layout.validate()
    assert plan.predicted.max_memory_fraction <= MEMORY_LIMIT_FRACTION
    assert sum(a.state_fraction for a in plan.assignments) == pytest.approx(1.0)
    six = [g for g in layout.groups if len(g) == 6][0]
    assert sorted(layout.num_heads_of(r) for r in six) == [5, 5, 5, 5, 6, 6]
    kv_ranges = [layout.kv_head_range(r) for r in six]
    assert any(a[1] > b[0] for a, b in zip(kv_ranges, kv_ranges[1:]))  # a shared boundary


def test_milp_infeasible_grouping_reports_missing_bytes():
    # L40S ranks alone in their groups must hold a big ring block with all 52 heads.
    cluster = Cluster.preset("mix4-32")
    problem = problem_for(cluster, "llama-30b", 1024 * 1024)
    choices = GlobalChoices({"H200": 8, "H100-SXM": 8, "A100-80G": 8, "L40S": 1})
    plan = plan_for_choices(problem, choices)
    assert isinstance(plan, InfeasiblePlan)
    assert plan.reason.startswith("OOM")
    l40s = {d.rank for d in cluster.devices if d.gpu == "L40S"}
    assert set(plan.missing_bytes) <= l40s and all(b > 0 for b in plan.missing_bytes.values())


def test_seeded_search_is_deterministic():
    runs = [
        plan_search("h100x8-a100x8", "llama3-8b", "256k", n_trials=12, seed=7) for _ in range(2)
    ]
    assert runs[0].best == runs[1].best
    assert [t.params for t in runs[0].trials] == [t.params for t in runs[1].trials]


def test_search_never_loses_to_the_greedy_default():
    greedy = plan_search("mix4-32", "llama-30b", "512k")
    searched = plan_search("mix4-32", "llama-30b", "512k", n_trials=16, seed=1)
    assert searched.best.predicted.tokens_per_s >= greedy.best.predicted.tokens_per_s


def test_storage_keeps_the_study_and_a_later_run_goes_on(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = plan_search("h100x8-a100x8", "llama3-8b", "256k", n_trials=6, storage=url)
    after_first = len(optuna.load_study(study_name=first.study_name, storage=url).trials)
    second = plan_search("h100x8-a100x8", "llama3-8b", "256k", n_trials=3, storage=url)
    study = optuna.load_study(study_name=first.study_name, storage=url)
    assert first.study_name == second.study_name
    assert after_first >= 6  # a new study scores at least the greedy short list
    assert len(study.trials) == after_first + 3


def test_workers_share_one_study_and_complete_exactly_the_trials_asked(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = plan_search(
        "h100x8-a100x8", "llama3-8b", "256k", n_trials=20, storage=url, workers=2, seed=3
    )
    study = optuna.load_study(study_name=result.study_name, storage=url)
    assert len(study.trials) == 20  # asked here, exactly: no worker draws past the count
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}
    assert isinstance(result.best, Plan)


def test_a_trial_count_below_the_short_list_is_kept(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = plan_search("h100x8-a100x8", "llama3-8b", "256k", n_trials=2, storage=url)
    study = optuna.load_study(study_name=result.study_name, storage=url)
    assert len(study.trials) == 2
    # the first trial is the greedy default (every node one HP group over its NVLink)
    assert study.trials[0].params["hp_degree[H100-SXM]"] == 8


def test_multi_objective_returns_a_pareto_front():
    result = plan_search("mix4-32", "llama-30b", "512k", n_trials=14, multi_objective=True)
    front = result.pareto
    assert front
    points = [(p.predicted.tokens_per_s, 1 - p.predicted.max_memory_fraction) for p in front]
    for a in points:
        assert not any(b[0] >= a[0] and b[1] >= a[1] and b != a for b in points)


def test_postgresql_storage_with_workers(postgresql_database):
    import uuid

    url = postgresql_database
    name = f"hexiseq-test-{uuid.uuid4()}"
    result = plan_search(
        "h100x8-a100x8",
        "llama3-8b",
        "256k",
        n_trials=8,
        storage=url,
        workers=2,
        study_name=name,
    )
    study = optuna.load_study(study_name=name, storage=url)
    assert len(study.trials) == 8 and isinstance(result.best, Plan)
    optuna.delete_study(study_name=name, storage=url)


def test_polish_finds_what_the_short_list_misses(monkeypatch):
    """benchmarks/plan_quality.py case 15: the winning ring order only wins at another chunk
    quantum, which the screen cannot price; the polish (every ring at the current quantum,
    the fastest rings at every quantum) reaches it, deterministically."""
    from hexiseq.search import optuna_layer

    cluster = cluster_of(
        "random-15",
        [
            ("n0", "A100-80G", 1),
            ("n1", "A100-80G", 5),
            ("n2", "A100-40G", 2),
            ("n3", "RTX-4090", 4),
        ],
        12.5,
    )
    polished = [plan_search(cluster, "tiny-7h", "64k").best for _ in range(2)]
    monkeypatch.setattr(optuna_layer, "polish_evaluations", lambda world_size: 0)
    short_list = plan_search(cluster, "tiny-7h", "64k").best
    speeds = [plan.predicted.tokens_per_s for plan in polished]
    assert speeds[0] == speeds[1]
    assert speeds[0] > 1.003 * short_list.predicted.tokens_per_s
    assert polished[0].knobs["chunk_quantum"] != short_list.knobs["chunk_quantum"]


def test_polish_budget_shrinks_with_the_cluster_and_stops_at_512_gpus():
    from hexiseq.search.polish import polish_evaluations

    budgets = [polish_evaluations(n) for n in (4, 32, 64, 128, 511, 512, 1024)]
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] > 0 and budgets[3] > 0 and budgets[-2:] == [0, 0]


def test_polish_asks_the_screen_only_where_the_rings_leave_evaluations(monkeypatch):
    """The regrouped neighbours' estimates cost probes and programs: where the rings at hand
    use up the polish's evaluations (3 on 128 GPUs), they are not asked for."""
    from hexiseq.search import polish as polish_module
    from hexiseq.search.objective import quantum_choices

    h100, a100 = "H100-SXM", "A100-80G"
    nodes = [("h0", h100, 2), ("a0", a100, 2), ("h1", h100, 2), ("a1", a100, 2)]
    problem = problem_for(cluster_of("two-by-two", nodes, 50), "tiny", 1 << 16)
    quanta = quantum_choices(problem)
    start = GlobalChoices({h100: 1, a100: 2}, "file", quanta[1], False)
    screened = []
    estimated = polish_module.fastest_estimated

    def counting(*args, **kwargs):
        screened.append(args[1])
        return estimated(*args, **kwargs)

    monkeypatch.setattr(polish_module, "fastest_estimated", counting)
    plans: dict = {}

    def plan_of(choices: GlobalChoices):
        return plans.setdefault(choices.key(), plan_for_choices(problem, choices))

    def plans_of(batch, more=None):
        batch = [*batch, *(more() if more is not None else [])]
        return batch, [plan_of(c) for c in batch]

    def polished(evaluations: int) -> list:
        plans.clear()
        starts = [(start, polish_module.throughput(plan_of(start)))]
        return polish_module.polish(
            problem,
            starts,
            plan_of,
            plans_of,
            lambda c: c.key() in plans,
            quanta,
            evaluations,
            None,
        )

    simulated = []
    first_s = polish_module.simulated_first_s
    monkeypatch.setattr(
        polish_module, "simulated_first_s", lambda p, c: simulated.append(c) or first_s(p, c)
    )
    few = polished(2)
    assert len(few) == 2 and not screened  # two rings: the screen was not asked
    assert all(c.hp_degrees == start.hp_degrees for c, _ in few)
    assert not simulated
    polished(40)
    assert screened and all(screened)  # room left: the regrouped neighbours are screened
    assert simulated  # and on 8 devices the best estimated are re-ranked by simulation
    simulated.clear()
    monkeypatch.setattr(polish_module, "POLISH_RERANKED_UP_TO", 4)
    polished(40)
    assert not simulated  # on more devices than that, the estimate alone ranks them


def test_polish_tells_ring_orders_apart_only_where_a_node_differs():
    """Rings that differ by swapping nodes that look alike (same GPUs, links, groups) are one
    ring to the polish, and do score the same; a swap that changes a link the ring uses is
    another ring."""
    from hexiseq.search.polish import _ring_key

    h100, a100 = "H100-SXM", "A100-80G"
    nodes = [("h0", h100, 2), ("a0", a100, 2), ("h1", h100, 2), ("a1", a100, 2), ("h2", h100, 2)]
    cluster = cluster_of("two-by-two", nodes, 50, slow=[("h0", "a0", 10)])
    problem = problem_for(cluster, "tiny", 1 << 16)
    degrees = {"H100-SXM": 1, "A100-80G": 2}

    def ring(*nodes: str) -> GlobalChoices:
        return GlobalChoices(degrees, explicit_ring_order(nodes), 0, False)

    def tokens_per_s(choices: GlobalChoices) -> float:
        return plan_for_choices(problem, choices).predicted.tokens_per_s

    same = [ring("h0", "h1", "a0", "h2", "a1"), ring("h0", "h2", "a0", "h1", "a1")]  # h1 <-> h2
    other = ring("h0", "a0", "h1", "h2", "a1")  # uses the slow h0 - a0 link
    assert _ring_key(problem, same[0]) == _ring_key(problem, same[1])
    assert tokens_per_s(same[0]) == tokens_per_s(same[1])
    assert _ring_key(problem, other) != _ring_key(problem, same[0])
    assert tokens_per_s(other) != tokens_per_s(same[0])


def test_polish_tries_every_ring_at_this_quantum_and_the_fastest_rings_at_every_quantum():
    """The polish's ring layouts come in two stages: every other ring at the current chunk
    quantum and the current ring at the others; then, once those are scored, the other
    quanta of the POLISH_RING_FINALISTS rings fastest at the current quantum, and no ring
    and quantum twice."""
    from hexiseq.search.objective import quantum_choices
    from hexiseq.search.polish import (
        POLISH_RING_FINALISTS,
        _ring_key,
        _worth_evaluating,
        neighbours,
        throughput,
    )

    h100, a100 = "H100-SXM", "A100-80G"
    nodes = [("h0", h100, 2), ("a0", a100, 2), ("h1", h100, 2), ("a1", a100, 2)]
    cluster = cluster_of("two-by-two", nodes, 50, slow=[("h0", "a0", 10)])
    problem = problem_for(cluster, "tiny", 1 << 16)
    quanta = quantum_choices(problem)
    plans: dict = {}

    def plan_of(choices: GlobalChoices):
        if choices.key() not in plans:
            plans[choices.key()] = plan_for_choices(problem, choices)
        return plans[choices.key()]

    def is_scored(choices: GlobalChoices) -> bool:
        return choices.key() in plans

    current = GlobalChoices({h100: 1, a100: 2}, "file", quanta[1], False)
    here, quantum = _ring_key(problem, current)
    found = neighbours(problem, current, quanta, plan_of(current))
    rings, _, later = _worth_evaluating(problem, current, plan_of(current), found, is_scored)
    assert all(c.hp_degrees == current.hp_degrees for c in rings)
    keys = [_ring_key(problem, c) for c in rings]
    assert all((ring == here) != (q == quantum) for ring, q in keys)
    assert {q for ring, q in keys if ring == here} == set(quanta) - {quantum}
    others = {_ring_key(problem, c)[0] for c in found if c.hp_degrees == current.hp_degrees}
    assert {ring for ring, q in keys if q == quantum} == others - {here}
    speed_at_quantum = {here: throughput(plan_of(current))}
    for choices, (ring, q) in zip(rings, keys):
        if q == quantum:
            speed_at_quantum[ring] = throughput(plan_of(choices))
    second = later(plan_of)
    finalists = sorted(speed_at_quantum, key=speed_at_quantum.get, reverse=True)
    finalists = finalists[:POLISH_RING_FINALISTS]
    expected = {(r, q) for r in finalists for q in quanta} - {(here, q) for q in quanta}
    assert len(others) > POLISH_RING_FINALISTS  # the finalists leave some rings out
    assert {_ring_key(problem, c) for c in second} == {k for k in expected if k[1] != quantum}
    assert len(set(keys) | {_ring_key(problem, c) for c in second}) == len(keys) + len(second)


def test_polish_evaluates_the_regroupings_whose_first_simulation_is_fastest(monkeypatch):
    """Of the regroupings estimated fastest, the polish evaluates in full those whose first
    split simulates fastest, none over POLISH_FIRST_SLACK x the current step, and one whose
    first split cannot be laid out last (branch and bound may still find it a split)."""
    from hexiseq.search import polish as polish_module

    first_s = {1: 3.0, 2: 1.0, 3: math.inf, 4: 2.5, 5: 1.5, 6: 2.4}
    found = [GlobalChoices({"H100-SXM": degree}) for degree in first_s]

    def simulated(problem, choices):
        return first_s[choices.hp_degrees["H100-SXM"]]

    monkeypatch.setattr(polish_module, "simulated_first_s", simulated)
    monkeypatch.setattr(polish_module, "POLISH_FIRST_SLACK", 1.2)
    monkeypatch.setattr(polish_module, "POLISH_RERANKED", 4)
    picked = polish_module._first_simulated_best(None, found, current_s=2.0)
    assert [c.hp_degrees["H100-SXM"] for c in picked] == [2, 5, 6, 3]
    monkeypatch.setattr(polish_module, "POLISH_RERANKED", 2)
    picked = polish_module._first_simulated_best(None, found, current_s=2.0)
    assert [c.hp_degrees["H100-SXM"] for c in picked] == [2, 5]


def test_polish_leaves_out_the_starts_far_behind_the_fastest_plan_reached(monkeypatch):
    """A later start is polished only within POLISH_START_GAP of the fastest plan so far,
    the moves of the starts before it included."""
    from hexiseq.search import polish as polish_module

    moves = {"a": ["a faster"], "a faster": [], "b": [], "c": []}  # what a move reaches
    speed = {"a": 100.0, "a faster": 110.0, "b": 91.0, "c": 95.0}

    def worth_evaluating(problem, current, plan, found, is_scored, simulations=None):
        return moves[current], None, lambda plan_of: []

    monkeypatch.setattr(polish_module, "neighbours", lambda *args: [])
    monkeypatch.setattr(polish_module, "_worth_evaluating", worth_evaluating)
    monkeypatch.setattr(polish_module, "_regrouped_per_move", lambda problem: 0)
    monkeypatch.setattr(polish_module, "throughput", lambda plan: speed[plan])
    monkeypatch.setattr(polish_module, "POLISH_START_GAP", 0.08)

    def polished(starts: list[str]) -> list[str]:
        currents = []

        def plan_of(choices):
            currents.append(choices)
            return choices

        def plans_of(batch, more=None):
            return list(batch), list(batch)

        scored = [(c, speed[c]) for c in starts]
        polish_module.polish(None, scored, plan_of, plans_of, lambda c: False, [], 40, None)
        return currents

    moves["a"] = []
    assert polished(["a", "c", "b"]) == ["a", "c"]  # b: 9 % behind a
    moves["a"] = ["a faster"]
    assert polished(["a", "c", "b"]) == ["a", "a faster"]  # c: 13.6 % behind a's move
    monkeypatch.setattr(polish_module, "POLISH_START_GAP", 1.0)
    assert polished(["a", "c", "b"]) == ["a", "a faster", "c", "b"]
