"""The exact local stage: LP relaxation, exact integer units, state shares and memory."""

from __future__ import annotations

import numpy as np
import pytest
from scaling_clusters import planner_scaling_cluster

from hexiseq import Cluster, ModelSpec, Plan, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.search._evaluate import Problem, memory_shortfall, simulated
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.local_milp import (
    MILP_RELATIVE_GAP,
    _class_times,
    _classes,
    _group_units,
    _Model,
    even_layout,
    rates_of,
    relaxed_step_s,
    solve_local,
)
from hexiseq.search.screen import grouping


def problem_for(cluster, model: str, seq_len: int, checkpointing: bool = True) -> Problem:
    train = TrainSpec(seq_len=seq_len, activation_checkpointing=checkpointing)
    return Problem(cluster, ModelSpec.preset(model), train, DatasheetCostModel())


def three_types() -> Cluster:
    return Cluster.from_dict(
        {
            "name": "three-types",
            "nodes": [
                {"name": "n0", "gpu": "H100-SXM", "count": 4},
                {"name": "n1", "gpu": "A100-80G", "count": 3},
                {"name": "n2", "gpu": "L40S", "count": 2},
            ],
            "network": {"inter_node_GBps": 50},
        }
    )


THREE_TYPE_DEGREES = [
    {"H100-SXM": 1, "A100-80G": 1, "L40S": 1},
    {"H100-SXM": 4, "A100-80G": 3, "L40S": 2},
    {"H100-SXM": 2, "A100-80G": 1, "L40S": 2},
]
"""HP degrees per type of `three_types()`: all ones, whole nodes, and a mix."""


def model_and_times(problem: Problem, degrees: dict, quantum: int):
    groups, heads = grouping(problem, GlobalChoices(degrees, "bandwidth", quantum))
    classes = _classes(problem, groups, heads)
    layout = even_layout(problem, groups, heads, quantum)
    times = _class_times(classes, rates_of(simulated(problem, layout), layout), quantum)
    return _Model(problem, groups, heads, classes, quantum), times, classes


@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_exact_integer_units_match_branch_and_bound(degrees):
    """Where memory does not bind, the one-dimensional integer search finds the MILP's own
    optimum (HiGHS branch and bound with a 1e-6 gap)."""
    problem = problem_for(three_types(), "llama3-8b", 64 * 1024)
    model, times, _ = model_and_times(problem, degrees, 64)
    ours = model.solve(times)
    exact = model._branch_and_bound(times)
    assert ours is not None and exact is not None
    finish = model._finish_s(times, np.array(ours[0], dtype=float)).max()
    optimum = model._finish_s(times, np.array(exact[0], dtype=float)).max()
    assert finish <= optimum * (1 + 1e-6)
    bound = model.relaxed_step_s(times)
    assert bound <= finish * (1 + 1e-9)  # the relaxation bounds it from below


@pytest.mark.parametrize("seq_k", [64, 256])
@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_every_group_finishes_within_the_solved_step_time(degrees, seq_k):
    """The leftover units go one per group (`_group_units`), so the time rows price each
    class with one unit more: under the same times, no group of the integer layout runs
    past the step time the model solved for (before, a group given a leftover unit could:
    on 64 GPUs of 8 types at 1M tokens a V100's extra unit cost 7.7 s of a 50 s step)."""
    problem = problem_for(three_types(), "llama3-8b", seq_k * 1024)
    model, times, classes = model_and_times(problem, degrees, 64)
    class_units, _ = model.solve(times)
    step_s = model._finish_s(times, np.array(class_units, dtype=float)).max()
    units = _group_units(classes, class_units, model.total_units, len(model.groups))
    assert sum(units) == model.total_units
    leftover = 0
    for c, (per_unit, fixed) in enumerate(times):
        for position in classes[c].positions:
            busy_s = per_unit * units[position] + fixed
            assert np.all(busy_s <= step_s * (1 + 1e-12))
            leftover += units[position] - class_units[c]
    assert leftover > 0  # some group holds a leftover unit: the case in question


@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_the_linearization_point_without_an_lp_is_as_fast_as_the_lps(degrees, monkeypatch):
    """Where memory does not bind, `fastest_units` takes its units without an LP: a split
    that covers the sequence, fits with even state shares, and runs as fast under the
    linear model as the units the LP relaxation's ceilings give."""
    problem = problem_for(three_types(), "llama3-8b", 64 * 1024)
    model, times, classes = model_and_times(problem, degrees, 64)
    assert model._without_lp(times) is not None  # memory does not bind here
    ours = np.array(model.fastest_units(times), dtype=float)
    monkeypatch.setattr(_Model, "_without_lp", lambda self, times: None)
    with_lp = np.array(model.fastest_units(times), dtype=float)
    counts = np.array([len(cls.positions) for cls in classes])
    total = model.total_units
    assert total - counts.sum() <= ours @ counts <= total
    assert model._even_shares_fit(ours)
    finish = model._finish_s(times, ours).max()
    assert finish == pytest.approx(model._finish_s(times, with_lp).max(), rel=1e-6)


def test_the_linearization_point_asks_the_lp_where_even_shares_overflow():
    """13B on H100s and 4090s: even state shares would overflow a 4090 at the fastest
    units, so there is no LP-free answer, and the LP relaxation's shares give one."""
    problem = problem_for(big_and_small(), "llama2-13b", 256 * 1024)
    model, times, _ = model_and_times(problem, {"H100-SXM": 8, "RTX-4090": 4}, 256)
    assert model._without_lp(times) is None
    units = model.fastest_units(times)
    assert units is not None and not model._even_shares_fit(np.array(units, dtype=float))


def test_memory_rules_out_only_what_the_lp_finds_infeasible():
    """`memory_rules_out` (memory rows alone, relaxed) answers before any LP: wherever it
    rules a grouping out, the LP relaxation has no point either; here it catches every
    grouping that cannot hold 128K-512K tokens without activation checkpointing."""
    from hexiseq.search._relaxation import memory_rules_out

    ruled_out = 0
    for seq_k in (64, 128, 256, 512):
        for checkpointing in (False, True):
            problem = problem_for(three_types(), "llama3-8b", seq_k * 1024, checkpointing)
            for degrees in (
                {"H100-SXM": 1, "A100-80G": 1, "L40S": 1},
                {"H100-SXM": 4, "A100-80G": 3, "L40S": 2},
            ):
                model, times, _ = model_and_times(problem, degrees, 64)
                lp = model._run(model._rows(times), model.step, relaxed=True)
                if memory_rules_out(model):
                    ruled_out += 1
                    assert lp is None and model.relaxed_step_s(times) is None
                else:
                    assert (lp is None) == (seq_k > 64 and not checkpointing)
    assert ruled_out == 6  # 128K, 256K and 512K without the recompute, both groupings


@pytest.mark.parametrize("integer", [False, True])
def test_the_fastest_step_needs_no_utilization_rows(integer):
    """The fastest-step programs (the relaxation and branch and bound's first MILP) leave
    the utilization rows out: they bind only the utilization column, which those programs
    do not minimize, so the optimum is the same on fewer rows, whether memory binds, is
    slack or leaves nothing feasible."""
    cases = [
        (three_types(), "llama3-8b", seq_k, checkpointing, degrees)
        for seq_k in (64, 96, 256)  # 96K without checkpointing: memory binds
        for checkpointing in (False, True)
        for degrees in THREE_TYPE_DEGREES
    ]
    cases += [
        (big_and_small(), "llama2-13b", 512, True, {"H100-SXM": 1, "RTX-4090": 1}),
        (big_and_small(), "llama2-13b", 256, True, {"H100-SXM": 8, "RTX-4090": 8}),
    ]
    seen = set()
    for cluster, model_name, seq_k, checkpointing, degrees in cases:
        problem = problem_for(cluster, model_name, seq_k * 1024, checkpointing)
        model, times, _ = model_and_times(problem, degrees, 64)
        full = model._run(model._rows(times), model.step, relaxed=not integer)
        limits = model._run(model._rows(times, utilization=False), model.step, relaxed=not integer)
        objective = model._objective(model.step)
        programs = [
            model._rows(times, utilization=u).program(objective, *model._bounds())
            for u in (True, False)
        ]
        utilization_rows = sum(
            len(model.memory[c][member][0]) for c, kind in enumerate(model.kind_members)
            for member in kind
        )  # fmt: skip
        assert len(programs[0].row_lower) - len(programs[1].row_lower) == utilization_rows
        assert (full is None) == (limits is None)
        if full is None:
            seen.add("infeasible")
            continue
        seen.add("slack" if model._unconstrained(times) is not None else "memory binds")
        # an LP's optimum is exact; a MILP's within the gap it stops at
        tolerance = MILP_RELATIVE_GAP if integer else 1e-9
        assert limits[model.step] == pytest.approx(full[model.step], rel=tolerance)
    assert seen == {"infeasible", "slack", "memory binds"}


def test_limit_rows_are_the_memory_rows_but_utilization():
    """The limit rows alone (the fastest-step programs' memory rows) are the memory rows'
    limit rows, every other one: the same entries, columns and bounds, no utilization."""
    from hexiseq.search._program_rows import Rows

    for degrees in THREE_TYPE_DEGREES:
        problem = problem_for(three_types(), "llama3-8b", 64 * 1024)
        model, _, _ = model_and_times(problem, degrees, 64)
        full, limits = Rows(), Rows()
        model._memory_rows(full, slack=None)
        model._memory_rows(limits, slack=None, utilization=False)
        rows, columns, values = full._entries()
        kept = rows % 2 == 0  # each phase: its limit row, then its utilization row
        assert len(limits.upper) == len(full.upper) // 2 > 0
        assert limits.upper == full.upper[::2] and set(limits.lower) == {-np.inf}
        ours = limits._entries()
        assert np.array_equal(ours[0], rows[kept] // 2)
        assert np.array_equal(ours[1], columns[kept]) and np.array_equal(ours[2], values[kept])
        assert model.utilization not in set(ours[1].tolist())


def _ceilings_one_kind_at_a_time(model, x) -> np.ndarray:
    """`_Model._unit_ceilings` worked out member kind by member kind (the reference)."""
    from hexiseq.costmodel import memory_limit_bytes
    from hexiseq.search._memory_rows import phase_arrays

    ceilings = np.full(len(model.classes), np.inf)
    largest = np.floor(np.max(x[model.u]) + 1e-9) + 2.0
    for c, members in enumerate(model.kind_members):
        for member in members:
            phases, capacity = model.memory[c][member]
            coefficients, constants = phase_arrays(model.problem, phases)
            per_unit, per_largest, per_share = coefficients[coefficients[:, 0] > 0].T
            room = memory_limit_bytes(int(capacity)) - constants[coefficients[:, 0] > 0]
            room = room - (per_largest * largest + per_share * x[model.f[c][member]])
            ceilings[c] = min([ceilings[c], *(room / per_unit)])
        if model.multi_group:
            ceilings[c] = min(ceilings[c], largest - 1.0)
    return ceilings


@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_unit_ceilings_are_each_member_kinds_least_room(degrees):
    """The unit ceilings, from every growing memory row at once, are what each member kind's
    rows allow worked out one kind at a time, to the bit, at random units and shares."""
    rng = np.random.default_rng(7)
    for seq_k, checkpointing in ((64, False), (256, True)):
        problem = problem_for(three_types(), "llama3-8b", seq_k * 1024, checkpointing)
        model, _, _ = model_and_times(problem, degrees, 64)
        for _ in range(10):
            x = np.zeros(model.size)
            x[model.u] = rng.uniform(1, model.total_units / 4, len(model.u))
            shares = np.concatenate(model.f)
            x[shares] = rng.uniform(0, 1, len(shares))
            expected = _ceilings_one_kind_at_a_time(model, x)
            assert np.isfinite(expected).any()
            assert np.array_equal(model._unit_ceilings(x), expected)


def test_memory_rules_out_what_only_the_largest_block_makes_too_long():
    """64 GPUs of 8 types at 1,152K tokens without the recompute: each class must also hold
    the largest class's block (the ring's buffer), and no grouping fits; memory_rules_out
    sees it, as the LP does. At 512K every grouping fits, and nothing is ruled out. (Before
    the runtime's one-step ring dropped its FP32 accumulators, 1M was already too long.)"""
    from hexiseq.search._relaxation import memory_rules_out

    gpus = ["H100-SXM", "A100-80G", "H200", "L40S", "A800-80G", "H800", "B200", "V100-32G"]
    nodes = [{"name": f"n{i}", "gpu": gpu, "count": 8} for i, gpu in enumerate(gpus)]
    cluster = Cluster.from_dict(
        {"name": "eight-types", "nodes": nodes, "network": {"inter_node_GBps": 50}}
    )
    for seq_k, too_long in ((1152, True), (512, False)):
        problem = problem_for(cluster, "llama3-8b", seq_k * 1024, checkpointing=False)
        for degree in (1, 2, 4, 8):
            model, times, _ = model_and_times(problem, dict.fromkeys(gpus, degree), 256)
            lp = model._run(model._rows(times), model.step, relaxed=True)
            assert memory_rules_out(model) is too_long
            assert (lp is None) is too_long


@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_the_least_step_time_from_the_ranges_changes_matches_the_bisection(degrees, monkeypatch):
    """`_fastest_units` tries the step times where a class's unit range changes before
    any search: the same units as the bisection finds, at a step time no longer."""
    from hexiseq.search._unit_ranges import UnitRanges

    problem = problem_for(three_types(), "llama3-8b", 256 * 1024)
    model, times, classes = model_and_times(problem, degrees, 64)
    ceilings = np.full(len(classes), np.inf)
    bound_s = model.relaxed_step_s(times)
    from_changes = model._fastest_units(times, ceilings, bound_s)
    monkeypatch.setattr(UnitRanges, "changes_after", lambda self, s, steps: np.zeros(0))
    bisected = model._fastest_units(times, ceilings, bound_s)
    assert np.array_equal(from_changes, bisected)
    ours, theirs = (model._finish_s(times, u).max() for u in (from_changes, bisected))
    assert ours <= theirs * (1 + 1e-9)


def scanned_trim(ranges, units: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The trim as a scan: each cut from the first class of the latest finish above `low`."""
    finish = ranges.finish_all_s(units)
    while units @ ranges.counts > ranges.total_units:
        slowest = int(np.argmax(np.where(units - 1 >= low, finish, -np.inf)))
        units[slowest] -= 1
        finish[slowest] = ranges.finish_all_s(units)[slowest]
    return units


@pytest.mark.parametrize("degrees", THREE_TYPE_DEGREES)
def test_the_heap_trim_cuts_the_units_a_scan_cuts(degrees):
    """`UnitRanges.trimmed` against a scan of every class per cut, from the units at step
    times up to 3x the least (hundreds of cuts, ties between equal classes included)."""
    from hexiseq.search._unit_ranges import UnitRanges

    problem = problem_for(three_types(), "llama3-8b", 256 * 1024)
    model, times, classes = model_and_times(problem, degrees, 64)
    ranges = UnitRanges(model, times, np.full(len(classes), np.inf))
    least_s = float(
        model._finish_s(
            times,
            model._fastest_units(
                times, np.full(len(classes), np.inf), model.relaxed_step_s(times)
            ),
        ).max()
    )
    cuts = 0
    for step_s in least_s * np.linspace(1.0, 3.0, 9):
        low, high = (row[0] for row in ranges.at(np.array([step_s])))
        if not np.all(np.isfinite(high)) or high @ ranges.counts <= ranges.total_units:
            continue
        cuts += int((high @ ranges.counts - ranges.total_units) // ranges.counts.max())
        held = low.copy()  # the first class may give up one unit only
        held[0] = max(low[0], high[0] - 1)
        for floor in (low, held):
            if floor @ ranges.counts > ranges.total_units:
                continue
            theirs = scanned_trim(ranges, high.copy(), floor)
            assert np.array_equal(ranges.trimmed(high.copy(), floor), theirs)
    assert cuts > 50


@pytest.mark.parametrize("slack", [None, 100])
def test_memory_rows_come_as_blocks_equal_to_rows_added_one_by_one(slack):
    """`phase_rows` builds each member kind's rows at once: the same entries, in the same
    order, as adding each phase's limit (and utilization, or slack) row on its own."""
    from hexiseq.costmodel import memory_limit_bytes
    from hexiseq.search._program_rows import Rows

    problem = problem_for(three_types(), "llama3-8b", 64 * 1024)
    model, _, _ = model_and_times(problem, {"H100-SXM": 2, "A100-80G": 3, "L40S": 1}, 64)
    blocks = Rows()
    model._memory_rows(blocks, slack)
    one_by_one, slacks = Rows(), 0
    for c, members in enumerate(model.memory):
        for member, (phases, capacity) in enumerate(members):
            if model.kinds[c].index(model.kinds[c][member]) != member:
                continue
            slacks += 1
            for (per_unit, per_largest, per_share), constant in phases:
                columns = {
                    int(model.u[c]): per_unit / capacity,
                    model.largest: per_largest / capacity,
                    int(model.f[c][member]): per_share / capacity,
                }
                limit = (memory_limit_bytes(int(capacity)) - constant) / capacity
                if slack is not None:
                    one_by_one.add({**columns, slack + slacks - 1: -1.0}, -np.inf, limit)
                    continue
                one_by_one.add(columns, -np.inf, limit)
                one_by_one.add({**columns, model.utilization: -1.0}, -np.inf, -constant / capacity)
    assert len(blocks.lower) == len(one_by_one.lower) > 0
    assert blocks.lower == one_by_one.lower and blocks.upper == one_by_one.upper
    for ours, theirs in zip(blocks._entries(), one_by_one._entries()):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_units_cover_the_sequence_and_every_member_has_a_quantum():
    problem = problem_for(three_types(), "llama3-8b", 64 * 1024)
    groups, heads = grouping(problem, GlobalChoices({"H100-SXM": 2, "A100-80G": 3, "L40S": 1}))
    solution = solve_local(problem, groups, heads, 64)
    layout = solution.layout
    layout.validate()
    assert sum(layout.segment_length(g) for g in range(len(groups))) == 64 * 1024
    assert all(layout.num_tokens(r) >= 64 for r in range(layout.world_size))
    assert sum(solution.state_fractions) == pytest.approx(1.0)
    assert not memory_shortfall(problem, layout, solution.state_fractions)


def test_identical_members_share_one_state_share_column():
    cluster = Cluster.from_dict(
        {"name": "one-node", "nodes": [{"name": "n0", "gpu": "H100-SXM", "count": 8}]}
    )
    problem = problem_for(cluster, "llama3-8b", 128 * 1024)
    model, _, classes = model_and_times(problem, {"H100-SXM": 8}, 128)
    assert len(classes) == 1 and classes[0].size == 8
    assert len(set(model.f[0])) == 1  # eight members, one column


def big_and_small() -> Cluster:
    """8 H100s beside 8 cards of 24 GiB."""
    return Cluster.from_dict(
        {
            "name": "big-and-small",
            "nodes": [
                {"name": "n0", "gpu": "H100-SXM", "count": 8},
                {"name": "n1", "gpu": "RTX-4090", "count": 8},
            ],
            "network": {"inter_node_GBps": 50},
        }
    )


def test_a_memory_bound_split_gives_the_small_card_less_and_still_fits():
    # 70B over H100s and 24 GiB cards: the 4090s' memory, not their speed, caps their share.
    problem = problem_for(big_and_small(), "llama2-13b", 256 * 1024)
    plan = plan_for_choices(problem, GlobalChoices({"H100-SXM": 8, "RTX-4090": 8}))
    assert isinstance(plan, Plan)
    by_gpu = {}
    for a in plan.assignments:
        by_gpu.setdefault(a.gpu, []).append(a)
    h100_tokens = sum(a.tokens for a in by_gpu["H100-SXM"])
    small_tokens = sum(a.tokens for a in by_gpu["RTX-4090"])
    assert small_tokens < h100_tokens
    assert plan.predicted.max_memory_fraction <= 0.95


def test_the_relaxed_bound_is_none_when_nothing_fits():
    problem = problem_for(Cluster.preset("mix4-32"), "llama-30b", 1024 * 1024)
    choices = GlobalChoices({"H200": 8, "H100-SXM": 8, "A100-80G": 8, "L40S": 1})
    groups, heads = grouping(problem, choices)
    layout = even_layout(problem, groups, heads, 256)
    rates = rates_of(simulated(problem, layout), layout)
    assert relaxed_step_s(problem, groups, heads, 256, rates) is None


def test_an_infeasible_plan_with_no_rank_short_of_memory_says_so():
    from hexiseq.search._evaluate import out_of_memory

    plan = out_of_memory("hexiseq", {})
    assert "no split" in plan.reason
    assert "OOM" in out_of_memory("hexiseq", {3: 2**30}).reason


def test_a_class_at_one_unit_below_its_size_gets_a_leftover_unit_in_every_group():
    """A class may take size - 1 units (the time rows price its groups with one more): each
    of its groups then takes a leftover unit, so every member holds one. Where the leftover
    is too short for that, the largest class gives up a unit per group, which the time rows
    priced anyway."""
    from hexiseq.search.local_milp import _Class

    fast = _Class(positions=(0, 1), size=1, heads=(32,))
    slow = _Class(positions=(2, 3, 4), size=2, heads=(16, 16))
    # 10 + 10 + 3 x 1 = 23 of 24 units: one leftover, three slow groups below their size
    units = _group_units([fast, slow], [10, 1], total=24, count=5)
    assert sum(units) == 24
    assert units[2:] == [2, 2, 2]  # every slow group at its size
    assert all(u in (9, 10, 11) for u in units[:2])  # the fast groups gave room, <= priced
    # with room to spare, the slow groups still come first
    assert _group_units([fast, slow], [9, 1], total=25, count=5) == [10, 9, 2, 2, 2]


def random_16() -> Cluster:
    """benchmarks/plan_quality.py's cluster #16 (seed 2024)."""
    nodes = [("n0", "A100-80G", 1), ("n1", "A100-80G", 5), ("n2", "A100-40G", 2)]
    nodes.append(("n3", "RTX-4090", 4))
    return Cluster.from_dict(
        {
            "name": "random-16",
            "nodes": [{"name": n, "gpu": gpu, "count": count} for n, gpu, count in nodes],
            "network": {"inter_node_GBps": 12.5},
        }
    )


def test_the_local_solve_goes_on_while_its_splits_gain(monkeypatch):
    """#16's exhaustive winner: from the screen's busy rates the first split starves the
    RTX 4090 pairs (2,048 tokens each), the next the A100-40G pair, which each
    re-linearization then lifts by one unit (25.8, 24.6, 24.2, 23.3, 22.8 ms). Stopped
    after the third, the plan was 6 % slower than the split a start from the even layout
    reaches."""
    from hexiseq.search import local_milp

    problem = problem_for(random_16(), "tiny-7h", 1 << 16, checkpointing=False)
    choices = GlobalChoices(
        {"A100-80G": 1, "A100-40G": 2, "RTX-4090": 2}, "nodes:n0,n3,n2,n1", 512, False
    )
    groups, heads = grouping(problem, choices)
    from_even = solve_local(problem, groups, heads, 512)  # no rates: the even start
    even_s = simulated(problem, from_even.layout).step_time_s

    def step_s() -> float:
        problem.cache.clear()
        return plan_for_choices(problem, choices).predicted.step_time_s

    assert step_s() == pytest.approx(even_s, rel=1e-9)
    monkeypatch.setattr(local_milp, "KEEP_GAINING", 1.0)  # stops after the third, as before
    assert step_s() > 1.05 * even_s


def test_a_later_round_whose_split_lost_is_solved_at_the_secants_before_it_too(monkeypatch):
    """1024 GPUs of 8 types, HP 8 everywhere, at 1M tokens (quantum 64): the second split
    gains over 0.5 % on the first, so a third round runs, and its split is slower than the
    second's. The full solve at the third's secants alone (as before) gives a plan 0.17 %
    slower than the solve at the second's, which the local solve now also makes and keeps."""
    from hexiseq.search import local_milp

    gpus = ("H100-SXM", "A100-80G", "H200", "L40S", "A800-80G", "H800", "B200", "V100-32G")
    cluster = planner_scaling_cluster(1024, gpus, slow_pair_GBps=25.0)
    problem = problem_for(cluster, "llama3-8b", 1 << 20, checkpointing=False)
    choices = GlobalChoices(dict.fromkeys(gpus, 8), "bandwidth", 64, False)
    kept = []
    real_faster_solve = local_milp._faster_solve

    def recording(problem, model, secants, found, solved, laid_out):
        chosen = real_faster_solve(problem, model, secants, found, solved, laid_out)
        kept.append("earlier" if chosen[1] is solved else "lost round's")
        return chosen

    monkeypatch.setattr(local_milp, "_faster_solve", recording)
    both_s = plan_for_choices(problem, choices).predicted.step_time_s
    assert kept == ["earlier"]

    def lost_round_only(problem, model, secants, found, solved, laid_out):
        found = model.solve(secants)
        return found, laid_out(found[0])

    monkeypatch.setattr(local_milp, "_faster_solve", lost_round_only)
    problem.cache.clear()
    lost_only_s = plan_for_choices(problem, choices).predicted.step_time_s
    assert both_s < lost_only_s / 1.001
