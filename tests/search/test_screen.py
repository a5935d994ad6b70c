"""The screen: candidates priced from cached busy rates and the local LP, unsimulated."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from scaling_clusters import planner_scaling_cluster

import hexiseq.search.optuna_layer as optuna_layer
import hexiseq.search.screen as screen
import hexiseq.search.shortlist as shortlist_module
from hexiseq import Cluster, ModelSpec, Plan, TrainSpec, plan_search
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.local_milp import busy_bound_s, parts_bound_s
from hexiseq.search.objective import quantum_choices
from hexiseq.search.screen import estimate_s, memory_binds, simulated_first_s
from hexiseq.search.shortlist import (
    CLOSE_RATIO,
    HOPELESS_RATIO,
    hopeless_ratio,
    screen_degrees,
    shortlist,
)

H100_A100 = ("H100-SXM", "A100-80G")


def paper_problem(seq_len: int = 256 * 1024) -> Problem:
    cluster = Cluster.preset("h100x8-a100x8")
    return Problem(
        cluster, ModelSpec.preset("llama-30b"), TrainSpec(seq_len=seq_len), DatasheetCostModel()
    )


def simulations(problem: Problem) -> int:
    return sum(1 for key in problem.cache if key[0] == "simulate")


def test_one_probe_prices_every_mix_of_degrees_it_covers():
    problem = paper_problem()
    estimate_s(problem, GlobalChoices({"H100-SXM": 4, "A100-80G": 4}, chunk_quantum=128))
    after_first = simulations(problem)
    for h100, a100 in [(4, 4), (4, 4)]:
        estimate_s(problem, GlobalChoices({"H100-SXM": h100, "A100-80G": a100}, "file", 128))
    mixed = GlobalChoices({"H100-SXM": 4, "A100-80G": 4}, "interleaved", 256)
    estimate_s(problem, mixed)
    assert after_first == 1 and simulations(problem) == 1  # ring order and quantum: no probe
    estimate_s(problem, GlobalChoices({"H100-SXM": 2, "A100-80G": 4}, chunk_quantum=128))
    assert simulations(problem) == 2  # degree 2: one more probe, all types at once
    estimate_s(problem, GlobalChoices({"H100-SXM": 4, "A100-80G": 2}, chunk_quantum=128))
    assert simulations(problem) == 2


def test_the_estimate_tracks_the_simulator_and_marks_what_cannot_fit():
    problem = paper_problem()
    for degrees in ({"H100-SXM": 8, "A100-80G": 8}, {"H100-SXM": 4, "A100-80G": 4}):
        choices = GlobalChoices(degrees, "bandwidth", 128, True)
        plan = plan_for_choices(problem, choices)
        assert isinstance(plan, Plan)
        estimate = estimate_s(problem, choices)
        # busy time balanced by the LP: below the simulated step (exposed waits come on
        # top), and not far below it on NVLink-connected HP groups
        assert 0.85 * plan.predicted.step_time_s <= estimate <= plan.predicted.step_time_s
    tight = paper_problem(1024 * 1024)
    assert math.isinf(
        estimate_s(tight, GlobalChoices({"H100-SXM": 1, "A100-80G": 1}, "bandwidth", 256, False))
    )


def test_the_short_list_starts_with_the_greedy_default_and_has_no_repeats():
    problem = paper_problem()
    found = shortlist(problem, [64, 128, 256])
    assert found[0].hp_degrees == {"H100-SXM": 8, "A100-80G": 8}
    assert len({c.key() for c in found}) == len(found)
    assert all(math.isfinite(estimate_s(problem, c)) for c in found[1:-1])


def test_screen_degrees_cover_small_nodes_fully_and_large_ones_by_powers_of_two():
    small = paper_problem()
    assert screen_degrees(small, "H100-SXM") == list(range(1, 9))
    wide = Cluster.from_dict({"name": "wide", "nodes": [{"name": "n", "gpu": "cpu", "count": 16}]})
    problem = Problem(
        wide, ModelSpec.preset("llama3-8b"), TrainSpec(seq_len=65536), DatasheetCostModel()
    )
    assert screen_degrees(problem, "cpu") == [1, 2, 4, 8, 16]


def test_hopeless_short_list_candidates_are_left_out_without_changing_the_plan(monkeypatch):
    """512 GPUs: the descent's low HP degrees run many times slower than the best plan;
    those estimated over `hopeless_ratio` x a scored step are not scored, and scoring them
    anyway finds the same plan."""
    cluster = planner_scaling_cluster(512, H100_A100)
    listed = []
    real_shortlist = optuna_layer.shortlist

    def recording_shortlist(problem, quanta, ahead=None):
        listed[:] = real_shortlist(problem, quanta, ahead)
        return listed

    monkeypatch.setattr(optuna_layer, "shortlist", recording_shortlist)
    left_out = recorded_left_out(monkeypatch)
    pruned = plan_search(cluster, "llama3-8b", "1M")
    assert left_out and all(ratio > hopeless_ratio(cluster.world_size) for ratio in left_out)
    assert searched(pruned) == len(listed) - len(left_out)
    monkeypatch.setattr(shortlist_module, "HOPELESS_RATIO", math.inf)
    monkeypatch.setattr(shortlist_module, "CLOSE_RATIO", math.inf)
    everything = plan_search(cluster, "llama3-8b", "1M")
    assert searched(everything) == len(listed)
    assert everything.best.predicted.tokens_per_s == pruned.best.predicted.tokens_per_s
    assert everything.best.knobs == pruned.best.knobs


def test_on_large_clusters_candidates_estimated_slower_than_a_scored_plan_are_left_out(
    monkeypatch,
):
    """128 GPUs of 2 types: three of the short list's candidates are estimated 1.05-1.13x
    the fastest step scored before them; from CLOSE_FROM devices they are not scored (below
    it, only those over HOPELESS_RATIO x are), and scoring them finds the same plan."""
    cluster = planner_scaling_cluster(128, H100_A100)
    assert hopeless_ratio(cluster.world_size) == CLOSE_RATIO
    assert hopeless_ratio(shortlist_module.CLOSE_FROM - 1) == HOPELESS_RATIO
    left_out = recorded_left_out(monkeypatch)
    pruned = plan_search(cluster, "llama3-8b", "1M")
    assert left_out and all(CLOSE_RATIO < ratio <= HOPELESS_RATIO for ratio in left_out)
    closely_left_out = len(left_out)
    monkeypatch.setattr(shortlist_module, "CLOSE_FROM", math.inf)
    left_out.clear()
    everything = plan_search(cluster, "llama3-8b", "1M")
    assert not left_out
    assert searched(everything) == searched(pruned) + closely_left_out
    assert everything.best.predicted.tokens_per_s == pruned.best.predicted.tokens_per_s
    assert everything.best.knobs == pruned.best.knobs


def recorded_left_out(monkeypatch) -> list[float]:
    """The estimate / scored step of each short-list candidate the search's `hopeless`
    leaves out from now on."""
    left_out = []
    real_hopeless = optuna_layer.hopeless

    def recording_hopeless(problem, choices, best_step_s):
        verdict = real_hopeless(problem, choices, best_step_s)
        if verdict:
            left_out.append(estimate_s(problem, choices) / best_step_s)
        return verdict

    monkeypatch.setattr(optuna_layer, "hopeless", recording_hopeless)
    return left_out


def searched(result) -> int:
    """The trials a search scored (the baselines it reports beside them left out)."""
    return sum(1 for trial in result.trials if trial.name == "hexiseq")


def test_no_checkpointed_descent_where_every_pick_fits_without_recompute():
    """Where the greedy picks all fit without activation checkpointing, the recompute is
    pure cost: the short list descends without it only, and nothing is simulated with it.
    Where memory binds (1M tokens here), the checkpointed descent still runs."""
    cluster, train = Cluster.preset("h100x8-a100x8"), TrainSpec(seq_len=64 * 1024)
    roomy = Problem(cluster, ModelSpec.preset("llama3-8b"), train, DatasheetCostModel())
    found = shortlist(roomy, [32, 64, 128])
    assert found and not any(c.activation_checkpointing for c in found)
    checkpointed = [
        key for key in roomy.cache if key[0] == "simulate" and key[1].activation_checkpointing
    ]
    assert not checkpointed
    tight = paper_problem(1024 * 1024)
    assert any(c.activation_checkpointing for c in shortlist(tight, [256, 512, 1024]))


def eight_type_problem() -> Problem:
    """64 GPUs, a node of each of 8 types, Llama-3-8B at 1,040K tokens: every greedy pick fits
    without activation checkpointing, and in each of them memory binds the split (1M was
    the length before the runtime's one-step ring dropped its FP32 accumulators)."""
    gpus = ("H100-SXM", "A100-80G", "H200", "L40S", "A800-80G", "H800", "B200", "V100-32G")
    nodes = [{"name": f"node{i}", "gpu": gpu, "count": 8} for i, gpu in enumerate(gpus)]
    cluster = Cluster.from_dict(
        {"name": "eight-types", "nodes": nodes, "network": {"inter_node_GBps": 50.0}}
    )
    return Problem(
        cluster,
        ModelSpec.preset("llama3-8b"),
        TrainSpec(seq_len=1040 * 1024),
        DatasheetCostModel(),
    )


def test_a_pick_keeps_the_recompute_where_memory_binds_without_it_and_it_screens_faster():
    """Without the recompute the uniform picks fit (at the smaller quantum), but memory caps
    the slow cards' units and the screen estimates them about 1.4x slower than with it: the
    short list takes them with activation checkpointing, and the plan built from one runs
    faster than its lighter twin (the one the short list took before)."""
    problem = eight_type_problem()
    smaller, middle, _ = quanta = quantum_choices(problem)
    uniform = {gpu: 4 for gpu in problem.cluster.gpu_types}
    heavier = GlobalChoices(uniform, "bandwidth", middle, activation_checkpointing=True)
    lighter = replace(heavier, activation_checkpointing=False, chunk_quantum=smaller)
    assert not math.isfinite(estimate_s(problem, replace(lighter, chunk_quantum=middle)))
    assert math.isfinite(estimate_s(problem, lighter)) and memory_binds(problem, lighter)
    assert estimate_s(problem, heavier) * 1.3 < estimate_s(problem, lighter)
    found = shortlist(problem, quanta)
    assert heavier.key() in {c.key() for c in found}
    assert lighter.key() not in {c.key() for c in found}
    step_s = {c: plan_for_choices(problem, c).predicted.step_time_s for c in (lighter, heavier)}
    assert step_s[heavier] < step_s[lighter]


def test_groups_that_memory_rules_out_are_infeasible_without_a_probe():
    """30B at 256K on 16 GPUs cannot run without activation checkpointing: the screen says
    so from the memory rows alone, before simulating a probe for busy rates; with the
    recompute the same groups are probed and priced."""
    problem = paper_problem()
    for degrees in ({"H100-SXM": 8, "A100-80G": 8}, {"H100-SXM": 1, "A100-80G": 1}):
        assert estimate_s(problem, GlobalChoices(degrees, "bandwidth", 128, False)) == math.inf
    assert simulations(problem) == 0
    checkpointed = GlobalChoices({"H100-SXM": 8, "A100-80G": 8}, "bandwidth", 128, True)
    assert math.isfinite(estimate_s(problem, checkpointed)) and simulations(problem) == 1


def test_a_groups_busy_rates_once_found_are_kept():
    """Another layout's simulation of a group gives rates that differ in the last bits:
    the first found are kept, so a plan built from them is the same whenever it is built
    (`shortlist.ahead_of_descents`)."""
    from hexiseq.search.screen import _fill_from, _known_rates, grouping

    problem = paper_problem()
    choices = GlobalChoices({"H100-SXM": 4, "A100-80G": 4}, "bandwidth", 128)
    groups, heads = grouping(problem, choices)
    _fill_from(problem, groups, heads, 128)
    first = dict(_known_rates(problem))
    assert set(groups) <= set(first)
    wider = GlobalChoices({"H100-SXM": 4, "A100-80G": 2}, "bandwidth", 128)
    other_groups, other_heads = grouping(problem, wider)
    shared = set(groups) & set(other_groups)
    assert shared  # the H100s' groups are the same in both layouts
    _fill_from(problem, other_groups, other_heads, 64)
    known = _known_rates(problem)
    assert all(known[group] is first[group] for group in groups)
    assert set(other_groups) <= set(known)  # the new groups are added


def test_the_picks_built_ahead_are_the_short_lists_in_its_order():
    """`ahead_of_descents`: the picks with a finite estimate, in the order the short list
    will have them (the greedy default first)."""
    from hexiseq.search.objective import quantum_choices

    problem = paper_problem()
    quanta = quantum_choices(problem)
    given = []
    found = shortlist(problem, quanta, given.extend)
    assert given and all(math.isfinite(estimate_s(problem, c)) for c in given)
    keys = [c.key() for c in given]
    assert keys[0] == found[0].key() and len(keys) > 2
    assert [c.key() for c in found if c.key() in keys] == keys


def test_the_first_simulation_is_the_one_the_full_evaluation_starts_from():
    """`simulated_first_s` simulates the split the local stage lays out first (the estimate
    misses the ring's waits, the simulation does not), and a full evaluation of the same
    candidate reuses that simulation instead of running it again."""
    choices = GlobalChoices({"H100-SXM": 4, "A100-80G": 2}, "bandwidth", 128, True)
    alone = paper_problem()
    plan = plan_for_choices(alone, choices)
    ranked = paper_problem()
    first_s = simulated_first_s(ranked, choices)
    assert plan_for_choices(ranked, choices).predicted.step_time_s == plan.predicted.step_time_s
    # the same simulations as without the ranking: it simulated the split solve_local lays
    # out first, not another one
    assert simulations(ranked) == simulations(alone)
    # the full solve starts from that split and does not end much slower than it (its
    # relinearization is not monotone: here 0.7 % slower, since the model counts the
    # runtime's one-step ring and fused norm)
    assert estimate_s(ranked, choices) < first_s
    assert plan.predicted.step_time_s <= first_s * 1.01


def test_a_greedy_default_whose_first_split_runs_over_twice_the_next_plan_is_left_out(
    monkeypatch,
):
    """128 GPUs of 4 types at 1M tokens: the greedy default (HP 8 on the fast types, HP 1
    on the slow) is estimated within 5 % of the others (2.3 %), but its first split simulates over
    HOPELESS_RATIO x the step of the next candidate's plan, built first: the default is not
    scored. Built anyway, it runs slower than that plan, and a search that keeps every
    default (`DEFAULT_CHECKED_FROM` beyond the cluster) scores it and finds the same plan."""
    listed = []
    real_shortlist = optuna_layer.shortlist

    def recording_shortlist(problem, quanta, ahead=None):
        listed[:] = real_shortlist(problem, quanta, ahead)
        return listed

    monkeypatch.setattr(optuna_layer, "shortlist", recording_shortlist)
    pruned = plan_search("mix4-128", "llama3-8b", "1M")
    default, rival = listed[:2]
    problem = Problem(
        Cluster.preset("mix4-128"),
        ModelSpec.preset("llama3-8b"),
        TrainSpec(seq_len=2**20),
        DatasheetCostModel(),
    )
    rival_s = plan_for_choices(problem, rival).predicted.step_time_s
    assert estimate_s(problem, default) < 1.05 * estimate_s(problem, rival)
    assert simulated_first_s(problem, default) > HOPELESS_RATIO * rival_s
    assert plan_for_choices(problem, default).predicted.step_time_s > rival_s
    assert not any(scored_as(trial, default) for trial in pruned.trials)
    monkeypatch.setattr(optuna_layer, "DEFAULT_CHECKED_FROM", math.inf)
    kept = plan_search("mix4-128", "llama3-8b", "1M")
    assert any(scored_as(trial, default) for trial in kept.trials)
    assert kept.best.predicted.tokens_per_s == pruned.best.predicted.tokens_per_s
    assert kept.best.knobs == pruned.best.knobs


def scored_as(trial, choices: GlobalChoices) -> bool:
    """Whether a search's trial scored `choices`."""
    params = trial.params or {}
    degrees = {gpu: params.get(f"hp_degree[{gpu}]") for gpu in choices.hp_degrees}
    return (
        degrees == choices.hp_degrees
        and params.get("ring_order") == choices.ring_order
        and params.get("chunk_quantum") == choices.chunk_quantum
        and params.get("activation_checkpointing") == choices.activation_checkpointing
    )


def test_the_bound_from_each_types_classes_is_the_bound_of_the_whole_ring():
    """Where every group's rates are known, the bound is put together from each GPU type's
    classes at its degree (found once a search); on every HP mix, ring order and setting of
    4 GPU types it is bit for bit the bound priced over the whole ring (`_priced`)."""
    cluster = Cluster.preset("mix4-32")
    problem = Problem(
        cluster, ModelSpec.preset("llama3-8b"), TrainSpec(seq_len=2**19), DatasheetCostModel()
    )
    types = cluster.gpu_types
    quantum = quantum_choices(problem)[1]
    for degree in (1, 2, 4, 8):  # the probes: every type's groups at every degree known
        for checkpointing in (False, True):
            capped = {gpu: min(degree, max(screen_degrees(problem, gpu))) for gpu in types}
            estimate_s(problem, GlobalChoices(capped, "file", quantum, checkpointing))
    compared = 0
    for mix in itertools.product(*(screen_degrees(problem, gpu) for gpu in types)):
        for ring_order in ("bandwidth", "file", "interleaved"):
            for checkpointing in (False, True):
                choices = GlobalChoices(dict(zip(types, mix)), ring_order, quantum, checkpointing)
                parts = screen._parts_by_type(problem, choices)
                if parts is None:
                    continue
                priced = screen._priced(problem, choices)
                units = problem.train.seq_len // (2 * quantum)
                assert parts_bound_s(parts, units) == busy_bound_s(*priced)
                compared += 1
    assert compared > 100
    tables = [table for key, table in problem.cache.items() if key[0] == "type parts"]
    kept = sum(len(table) for table in tables)  # an entry per type, degree, quantum, order
    assert 0 < kept <= len(types) * 4 * 3 * 2  # and per setting: a table each
