"""The local LP relaxation without an LP, the busy-work bound, and the lazy screen ranking."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from test_local_milp import big_and_small, model_and_times, problem_for, random_16, three_types

from hexiseq import Cluster
from hexiseq.search._relaxation import _busy_root, _Ranges, busy_bound_s, unconstrained_optimum
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.screen import bound_s, estimate_s, fastest_estimated, tie_key
from hexiseq.search.shortlist import screen_degrees

DEGREES = [
    {"H100-SXM": h, "A100-80G": a, "L40S": s}
    for h, a, s in itertools.product((1, 2, 4), (1, 3), (1, 2))
]


def lp_step_s(model, times) -> float | None:
    x = model._relaxed(times)
    return None if x is None else float(x[model.step])


@pytest.mark.parametrize(
    ("seq_len", "checkpointing", "always"), [(64 * 1024, False, True), (512 * 1024, True, False)]
)
def test_the_shortcut_equals_the_lp_wherever_it_answers(seq_len, checkpointing, always):
    """Over many groupings, the shortcut either declines (memory may bind) or gives the LP's
    own optimum; at 64K without recompute memory binds nowhere, so it answers every time."""
    problem = problem_for(three_types(), "llama3-8b", seq_len, checkpointing)
    answered = 0
    for degrees in DEGREES:
        model, times, _ = model_and_times(problem, degrees, 64)
        lp = lp_step_s(model, times)
        optimum = unconstrained_optimum(model, times)
        if optimum is not None:
            fast = optimum[0]
            answered += 1
            assert lp is not None and fast == pytest.approx(lp, rel=1e-9)
    assert answered == len(DEGREES) if always else answered > 0


def test_the_shortcut_declines_where_memory_binds():
    """13B at 556K on H100s beside 24 GiB cards: the LP's optimum is set by the small
    cards' memory (at 536K it is not; from 568K nothing fits), so the shortcut must leave it
    to the LP, not report the busy-only time."""
    problem = problem_for(big_and_small(), "llama2-13b", 556 * 1024)
    model, times, classes = model_and_times(problem, {"H100-SXM": 4, "RTX-4090": 4}, 256)
    lp = lp_step_s(model, times)
    busy = busy_bound_s(classes, times, model.total_units)
    assert lp is not None and lp > busy * 1.01  # memory, not busy work, sets the optimum
    assert unconstrained_optimum(model, times) is None


@pytest.mark.parametrize("seq_len", [64 * 1024, 512 * 1024])
def test_the_busy_bound_never_exceeds_the_lp(seq_len):
    problem = problem_for(three_types(), "llama3-8b", seq_len)
    for degrees in DEGREES:
        model, times, classes = model_and_times(problem, degrees, 64)
        lp = lp_step_s(model, times)
        bound = busy_bound_s(classes, times, model.total_units)
        assert bound > 0
        if lp is not None:
            assert bound <= lp * (1 + 1e-12)


@pytest.mark.parametrize("quantum", [128, 256, 512])
def test_the_ring_bound_least_step_is_the_bisections(quantum):
    """Where the ring's rows bind, the least step time comes from the pairs' crossings and
    Newton steps on the classes' least units: the bisection's answer (1e-12 wide), and a
    point that fits, on every HP mix of plan_quality's cluster #16 (12.5 GB/s links)."""
    problem = problem_for(random_16(), "tiny-7h", 64 * 1024, checkpointing=False)
    ring_bound = 0
    for a80, a40, rtx in itertools.product((1, 5), (1, 2), (1, 2, 4)):
        degrees = {"A100-80G": a80, "A100-40G": a40, "RTX-4090": rtx}
        model, times, _ = model_and_times(problem, degrees, quantum)
        ranges = _Ranges(model, times)
        busy_s = _busy_root(ranges.counts, ranges.smallest, times, ranges.low_sum)
        if ranges.feasible(np.array([busy_s * (1 + 1e-12)]))[0]:
            continue  # busy work sets it: not this test's case
        ring_bound += 1
        exact_s, bisected_s = ranges._ring_root(busy_s), ranges._bisected_s()
        assert exact_s is not None and bisected_s is not None
        assert exact_s == pytest.approx(bisected_s, rel=2e-12)
        assert ranges.feasible(np.array([exact_s * (1 + 1e-12)]))[0]
        assert not ranges.feasible(np.array([exact_s * (1 - 1e-9)]))[0]
        assert ranges.least_step_s() == pytest.approx(bisected_s, rel=2e-12)
    assert ring_bound >= 6


def one_type_moves(problem) -> list[GlobalChoices]:
    """Every single-type HP degree change from all types at degree 1."""
    base = {gpu: 1 for gpu in problem.cluster.gpu_types}
    return [
        GlobalChoices({**base, gpu: degree}, "bandwidth", 256)
        for gpu in problem.cluster.gpu_types
        for degree in screen_degrees(problem, gpu)
    ]


def test_the_lazy_ranking_picks_what_sorting_every_estimate_picks():
    problem = problem_for(Cluster.preset("mix4-32"), "llama3-8b", 512 * 1024)
    candidates = one_type_moves(problem)
    for count, below_s in [(1, math.inf), (3, math.inf), (4, None)]:
        if below_s is None:  # a threshold inside the range of estimates
            below_s = float(np.median([estimate_s(problem, c) for c in candidates]))
        lazy = fastest_estimated(problem, candidates, count, below_s)
        finite = [c for c in candidates if tie_key(estimate_s(problem, c)) < tie_key(below_s)]
        eager = sorted(finite, key=lambda c: tie_key(estimate_s(problem, c)))[:count]
        assert [c.key() for c in lazy] == [c.key() for c in eager]
    for choices in candidates:
        assert bound_s(problem, choices) <= estimate_s(problem, choices)


def test_the_lazy_ranking_estimates_fewer_candidates():
    problem = problem_for(Cluster.preset("mix4-32"), "llama3-8b", 512 * 1024)
    candidates = one_type_moves(problem)
    fastest_estimated(problem, candidates, 2)
    estimated = sum(1 for key in problem.cache if key[0] == "estimate")
    assert estimated < len(candidates)
