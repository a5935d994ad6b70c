"""Exact local stage: a MILP (HiGHS, `search._highs`) for one grouping and ring order.

Heads are fixed per group beforehand (`greedy.split_heads`, exact for the time objective).
Groups inside a node hold identical devices, and groups with the same devices, size and head
split are interchangeable to the linear model below, so the MILP has one integer per *class*
of such groups rather than one per rank: that keeps it at a few dozen variables for 1024
GPUs. Group g of class c gets u_c segment units of 2q tokens (q tokens per zigzag chunk),
split evenly between its identical members; member m of class c holds a share f_cm of the
sharded model states. Minimize the step time T subject to

    T >= seg_cm·(u_c + 1) + tok_cm·(u_c + 1)/size_c   for every class c and member m
    Σ_c n_c·u_c <= S/2q <= Σ_c n_c·(u_c + 1)           (leftover units go one per group)
    Σ_c n_c·Σ_m f_cm = 1,   u_c + 1 <= B,   u_c >= size_c - 1
    memory_cm(tokens, segment, B, f_cm) <= 95 % of capacity (every phase of the memory model)

Time and memory rows both count each group's possible extra unit (memory also each member's
rounding, +1 unit), so the integer layout built afterwards runs within the step time solved
for and fits; a class at u_c = size_c - 1 has every group take a leftover unit, so each
member holds one (`_group_units`). (Time rows without the extra unit let a slow card's
leftover unit run past the step: on 64 GPUs of 8 types at 1M tokens one V100 unit is 7.7 s of
a 50 s step; pricing it made the best plans of those searches 3 % faster and the screen's
estimates of its candidates 3-10 % closer to the simulation.) The time coefficients are the
simulator's own per-rank times divided by the loads that drive them (a secant through zero at
the current operating point), so the MILP and the simulator agree on what each device does;
`solve_local` re-linearizes at the MILP's answer and solves again. The memory model is affine in
the loads (`costmodel.memory.rank_memory`), so its coefficients are exact. A second MILP keeps
the step time within `TIME_TOLERANCE` of the optimum and maximizes the fullest device's
headroom. The simulator then scores the result exactly, ring waits included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial

import numpy as np

from hexiseq.costmodel import memory_limit_bytes
from hexiseq.costmodel.memory import even_state_fractions
from hexiseq.layout import AttentionLayout, apportion, build_zigzag_layout
from hexiseq.plan import RankTime
from hexiseq.search._evaluate import Problem, memory_shortfall, simulated
from hexiseq.search._highs import solve
from hexiseq.search._memory_rows import (
    GrowingRows,
    kinds_of,
    phase_arrays,
    phase_rows,
    phases_of,
)
from hexiseq.search._program_rows import Block, Rows, stacked_blocks
from hexiseq.search._relaxation import busy_bound_s as _busy_bound_s
from hexiseq.search._relaxation import memory_rules_out, unconstrained_optimum
from hexiseq.search._unit_ranges import UnitRanges

Group = tuple[int, ...]
RELINEARIZATIONS = 2
MAX_LINEARIZATIONS = 8
RELINEARIZE_AGAIN = 0.25
KEEP_GAINING = 0.005
"""The secants are linearized RELINEARIZATIONS times, a third time where the last simulation
moved some class's times by over RELINEARIZE_AGAIN (relative): the split is then far from
where the secants were taken; and again, up to MAX_LINEARIZATIONS in all, while the last
split simulated at least KEEP_GAINING faster than the one before it. Where such a later
round's split is no faster than the one before it, the full solve runs at both rounds'
secants and keeps the faster (`_faster_solve`): on 1024 GPUs of 8 types the third round's
split was 0.17 % slower than the second's, and the solve at its secants alone gave a plan
0.17 % slower than the solve at the second's.
Measured on the search's local solves: on the planner-scaling cells of 16-128 GPUs the
second linearization moved the times by at most 18 %; on plan_quality #16 (seed 2024) by up
to 118 %, where the start from the screen's busy rates put four RTX 4090s at 256 tokens each
and the solve after one more linearization was 4.4 % faster. A third linearization on every
solve made 16-128 GPU searches 7-16 % slower for one plan 0.2 % faster. Stopping after the
third left #16's exhaustive winner (A100-40G and RTX 4090 at HP 2) 6 % slower than its
split from the even start (24.16 against 22.79 ms): the splits still gained 1.6-3.8 % a
round, and five rounds reach that split. Of 55 default searches (the 16 planner-scaling
cells of 16-128 GPUs, 39 on presets) one plan changed, in its last digit; plan_quality's 20
clusters kept their plans."""
MILP_TIME_LIMIT_S = 2.0
MILP_RELATIVE_GAP = 1e-6
TIME_TOLERANCE = 1e-4  # the headroom stage may give up this much step time
SECANT_TOLERANCE = 1e-3  # re-linearized times this close to the last ones change nothing
BISECTION_TOLERANCE = 1e-7  # relative width at which the integer step-time search stops
SEARCH_POINTS = 31  # step times tried at once in each round of that search
EVENT_STEPS = 4  # unit changes per member tried first (`UnitRanges.changes_after`)
BLOCK_RAISES = 4  # units the largest block may rise above the relaxation's (`_fastest_within`)


@dataclass(frozen=True)
class LocalSolution:
    """The MILP's answer as a layout and state shares, or the memory that is missing."""

    layout: AttentionLayout | None
    shares: Callable[[], tuple[float, ...]] | None = field(default=None, compare=False)
    missing_bytes: dict[int, int] | None = None

    @cached_property
    def state_fractions(self) -> tuple[float, ...]:
        """Each rank's share of the model states (solved on first use: the search runs even
        shares wherever they fit, and then never needs these)."""
        return self.shares() if self.shares is not None else ()


@dataclass(frozen=True)
class _Class:
    """Interchangeable groups: their ring positions and their (shared) member heads."""

    positions: tuple[int, ...]
    size: int
    heads: tuple[int, ...]


def solve_local(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    quantum: int,
    rates: list[GroupRates] | None = None,
) -> LocalSolution:
    """Best segment lengths, token shares and state shares for fixed groups and heads.

    The first linearization's secants come from `rates` (busy seconds per segment token of
    each member, `search.screen`) when given, else from a simulation of the even layout;
    its fastest integer units are laid out and simulated, and the secants there (where they
    moved) are solved in full: fastest time, then most headroom, then state shares.

    The split found depends on where the secants start. On plan_quality's seed-2025 #0
    (a V100-32G node cut 2+1+1+1, ring n0 > n3 > n2 > n1, quantum 512) the start from the
    screen's rates settles at 21,549 tokens/s, the start from the even layout at 23,724 (the
    exhaustive optimum). Over the 80 clusters of seeds 2024, 2025, 2032 and 2040, every
    solve started from the even layout put 70 within 1 % of their exhaustive optima (1.30x
    the simulations), from the screen's rates 71, and the faster of the two starts 71 (1.55x
    the simulations; mean gap 0.23 % against 0.28 %)."""
    classes = _classes(problem, groups, heads)
    total_units = problem.train.seq_len // (2 * quantum)
    model = _model_of(problem, groups, heads, quantum)
    if rates is not None:
        times = _class_times(classes, rates, quantum)
    else:
        even = _layout(problem, groups, heads, quantum, _even_units(groups, total_units))
        times = _time_coefficients(problem, even, classes, quantum)
    tried = []  # the splits laid out and simulated on the way
    last_s = math.inf
    lost = None  # the secants at a later round's split that lost (solved at as well)
    for round_ in range(1, MAX_LINEARIZATIONS):
        class_units = model.fastest_units(times)
        if class_units is None:
            break  # the full solve below says what is missing (or branches and bounds)
        layout = _laid_out(problem, groups, heads, quantum, classes, class_units)
        tried.append(layout)
        fresh = _time_coefficients(problem, layout, classes, quantum)
        if _same_times(times, fresh):
            break  # the simulation agrees with the secants: solving again changes nothing
        far = not _same_times(times, fresh, RELINEARIZE_AGAIN)
        step_s = simulated(problem, layout).step_time_s  # simulated for `fresh`
        if round_ > RELINEARIZATIONS and step_s >= last_s:
            lost = fresh  # a round past the usual ones lost: solve at the faster split's too
            break
        gaining = step_s < last_s * (1.0 - KEEP_GAINING)
        times, last_s = fresh, step_s
        if round_ + 1 == RELINEARIZATIONS and not far:
            break
        if round_ >= RELINEARIZATIONS and not gaining:
            break
    found = model.solve(times)
    if found is None:
        return LocalSolution(None, missing_bytes=model.missing_bytes())
    class_units, class_shares = found
    solved = _laid_out(problem, groups, heads, quantum, classes, class_units)
    if lost is not None:
        lay_out = partial(_laid_out, problem, groups, heads, quantum, classes)
        (_, class_shares), solved = _faster_solve(problem, model, lost, found, solved, lay_out)
    faster = _faster_tried(problem, solved, tried)
    if faster is not None:
        even = tuple(even_state_fractions(problem.cluster.world_size))
        return LocalSolution(faster, lambda: even)
    return LocalSolution(solved, lambda: _rank_fractions(groups, classes, class_shares()))


def _faster_solve(problem: Problem, model: _Model, secants: list, found, solved, laid_out):
    """The full solve at `secants` (its units laid out by `laid_out`) where it simulates
    faster than `solved`, the solve `found` at the other secants; else those two."""
    other = model.solve(secants)
    if other is None:
        return found, solved
    layout = laid_out(other[0])
    if simulated(problem, layout).step_time_s < simulated(problem, solved).step_time_s:
        return other, layout
    return found, solved


def _faster_tried(
    problem: Problem, solved: AttentionLayout, tried: list[AttentionLayout]
) -> AttentionLayout | None:
    """The split tried on the way that simulates faster than the full solve's by more than
    TIME_TOLERANCE, with even state shares fitting both (else None: the solve's stands).
    The secants are re-linearized a fixed number of times, and the last round may overshoot
    (plan_quality #0 at three linearizations: the solve's split 1.9 % slower than the one
    before it); every tried split is simulated already, so keeping the fastest costs nothing."""
    even = even_state_fractions(problem.cluster.world_size)
    if memory_shortfall(problem, solved, even):
        return None
    best, best_s = None, simulated(problem, solved).step_time_s * (1.0 - TIME_TOLERANCE)
    for layout in tried:
        if layout is solved or memory_shortfall(problem, layout, even):
            continue
        seconds = simulated(problem, layout).step_time_s
        if seconds < best_s:
            best, best_s = layout, seconds
    return best


def first_simulated_s(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    quantum: int,
    rates: list[GroupRates],
) -> float | None:
    """The simulated step seconds of the first split `solve_local` lays out (the fastest
    integer units under `rates`, even state shares): the simulation a full evaluation starts
    from, kept for it. None where nothing fits."""
    classes = _classes(problem, groups, heads)
    model = _model_of(problem, groups, heads, quantum)
    class_units = model.fastest_units(_class_times(classes, rates, quantum))
    if class_units is None:
        return None
    layout = _laid_out(problem, groups, heads, quantum, classes, class_units)
    return simulated(problem, layout).step_time_s


def _laid_out(problem, groups, heads, quantum, classes, class_units) -> AttentionLayout:
    """The layout of `class_units` per class, the leftover units one per group."""
    total_units = problem.train.seq_len // (2 * quantum)
    units = _group_units(classes, class_units, total_units, len(groups))
    return _layout(problem, groups, heads, quantum, units)


def _times_key(times: list) -> tuple:
    """Class times as a memo key."""
    return tuple((unit.tobytes(), fixed.tobytes()) for unit, fixed in times)


def _same_times(old: list, new: list, tolerance: float = SECANT_TOLERANCE) -> bool:
    """Whether two sets of class times agree within `tolerance` (relative)."""
    for (old_unit, old_fixed), (new_unit, new_fixed) in zip(old, new):
        scale = np.maximum(np.abs(old_unit), 1e-300)
        if np.any(np.abs(new_unit - old_unit) > tolerance * scale):
            return False
        if np.any(np.abs(new_fixed - old_fixed) > tolerance * np.maximum(old_fixed, 1e-9)):
            return False
    return True


def relaxed_step_s(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    quantum: int,
    rates: list[GroupRates],
) -> float | None:
    """The LP relaxation's busy step seconds for these groups under `rates` (a lower bound of
    the local MILP's), or None when no split fits in memory."""
    classes = _classes(problem, groups, heads)
    model = _model_of(problem, groups, heads, quantum)
    return model.relaxed_step_s(_class_times(classes, rates, quantum))


def memory_may_bind(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    quantum: int,
    rates: list[GroupRates],
) -> bool:
    """Whether memory may bind at the LP relaxation's optimum under `rates` (the optimum
    does not come without an LP, `_relaxation.unconstrained_optimum`)."""
    classes = _classes(problem, groups, heads)
    model = _model_of(problem, groups, heads, quantum)
    return model._unconstrained(_class_times(classes, rates, quantum)) is None


def memory_rules_out_groups(
    problem: Problem, groups: list[Group], heads: list[list[int]], quantum: int
) -> bool:
    """Whether memory alone leaves these groups no split (`_relaxation.memory_rules_out`,
    certain where True): asked before their busy rates are probed."""
    return _model_of(problem, groups, heads, quantum)._memory_rules_out()


def _model_of(problem: Problem, groups: list[Group], heads, quantum: int) -> _Model:
    """The local stage's model of these groups, head split and quantum, once per search
    (the screen's bound and estimate and the full evaluation ask for the same one; a model
    is not changed once built)."""
    key = ("model", problem.train, tuple(groups), tuple(map(tuple, heads)), quantum)
    return problem.memo(
        key, lambda: _Model(problem, groups, heads, _classes(problem, groups, heads), quantum)
    )


def busy_bound_s(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    quantum: int,
    rates: list[GroupRates],
) -> float:
    """A lower bound of `relaxed_step_s` from the busy time rows alone: cheaper (no memory
    rows, no ring traffic, no LP), for ruling out candidates that cannot beat a step time."""
    classes = _classes(problem, groups, heads)
    total_units = problem.train.seq_len // (2 * quantum)
    return _busy_bound_s(classes, _class_times(classes, rates, quantum), total_units)


@dataclass(frozen=True)
class ClassPart:
    """One class of interchangeable groups in a part of a ring (`class_parts`): where its
    first group stands (keys that sort as the ring's positions do), the class (its groups'
    positions in the part, their size and heads) and its members' (seconds per segment
    unit, fixed seconds) as `_class_times` gives them."""

    first: tuple
    groups: _Class  # its positions: in the part
    times: tuple[np.ndarray, np.ndarray]


def class_parts(
    problem: Problem,
    groups: list[Group],
    heads: list[list[int]],
    places: list[tuple],
    rates: list[GroupRates],
    quantum: int,
) -> list[ClassPart]:
    """The classes of `groups` (a part of a ring no class of the rest shares: one GPU
    type's groups) with their times, each group at its place in the ring (`places`).
    `parts_bound_s` of every part of a ring is `busy_bound_s` of the ring."""
    classes = _new_classes(problem, groups, heads)
    return [
        ClassPart(min(places[p] for p in cls.positions), cls, times)
        for cls, times in zip(classes, _class_times(classes, rates, quantum))
    ]


def parts_bound_s(parts: list[ClassPart], total_units: int) -> float:
    """`busy_bound_s` of a ring from its classes (`class_parts`), in ring order."""
    ordered = sorted(parts, key=lambda part: part.first)
    return _busy_bound_s([p.groups for p in ordered], [p.times for p in ordered], total_units)


def even_layout(problem: Problem, groups: list[Group], heads, quantum: int):
    """Segments in proportion to group size (the first linearization's point); None when the
    sequence is too short for one quantum per rank."""
    try:
        units = _even_units(groups, problem.train.seq_len // (2 * quantum))
    except ValueError:
        return None
    return _layout(problem, groups, heads, quantum, units)


@dataclass(frozen=True)
class GroupRates:
    """What a simulation says of one group's members: busy seconds per segment token (the
    parts that grow with the load) and the seconds that do not (exposed sharding
    communication, optimizer, launch overhead), each [member]. Exposed ring communication
    is neither: `_ring_rates` bounds it from the ring's traffic instead."""

    per_token_s: np.ndarray
    fixed_s: np.ndarray


def rates_of(prediction, layout: AttentionLayout) -> list[GroupRates]:
    """Each group's rates in a simulated step of `layout`."""
    seconds = {key: np.array(value) for key, value in prediction.seconds_by_part.items()}
    busy = _busy(seconds)
    step = sum(seconds[key] for key in RankTime.__dataclass_fields__)  # as `RankTime.step_s`
    fixed = step - seconds["idle_s"] - seconds["ring_exposed_comm_s"] - busy
    return [
        GroupRates(busy[list(group)] / layout.segment_length(position), fixed[list(group)])
        for position, group in enumerate(layout.groups)
    ]


def _busy(seconds: dict[str, np.ndarray]) -> np.ndarray:
    """[rank] seconds of the parts that grow with the tokens."""
    return (
        seconds["attention_s"]
        + seconds["all_to_all_s"]
        + seconds["linear_s"]
        + seconds["elementwise_s"]
        + seconds["cast_s"]
        + seconds["loss_s"]
    )


def _class_times(classes: list[_Class], rates: list[GroupRates], quantum: int) -> list:
    """Per class: (seconds per segment unit, fixed seconds) of each member, the slowest
    group of the class speaking for it (its groups are all of its size: one [group, member]
    table per class, one maximum over its groups)."""
    unit_tokens = 2 * quantum
    times = []
    for cls in classes:
        if len(cls.positions) == 1:
            only = rates[cls.positions[0]]
            per_token, fixed = only.per_token_s, only.fixed_s
        else:
            per_token = np.array([rates[p].per_token_s for p in cls.positions]).max(axis=0)
            fixed = np.array([rates[p].fixed_s for p in cls.positions]).max(axis=0)
        times.append((np.maximum(per_token * unit_tokens, 0.0), np.maximum(fixed, 0.0)))
    return times


def _ring_rates(problem: Problem, groups: list[Group], classes: list[_Class]) -> list:
    """Per class, per member: seconds per token of the *other* groups' segments that the
    ring moves into it in one step (K/V blocks in the compute dtype forward, again for the
    recompute and the backward, and the FP32 dK/dV accumulators), over the link from the
    previous group. Ring steps overlap compute and communication, so a member's step takes
    at least that long whatever its own load: the bound the busy rows miss where a slow link
    feeds a fast group."""
    if len(groups) == 1:
        return [np.zeros(cls.size) for cls in classes]
    devices = problem.cluster.devices
    known = problem.memo(("ring rates", problem.train), dict)  # one table per step
    rates = []
    for cls in classes:
        links = {
            (devices[groups[p - 1][0]].node, devices[groups[p][0]].node, len(groups[p - 1]))
            for p in cls.positions
        }
        # the rate depends on a link only through its seconds per byte
        feeds = {(_link_seconds_per_byte(problem, a, b), size) for a, b, size in links}
        per_member = np.zeros(cls.size)
        for seconds_per_byte, size in feeds:
            key = (seconds_per_byte, size, cls.heads)
            moved = known.get(key)
            if moved is None:
                moved = known[key] = _ring_rate(problem, seconds_per_byte, size, cls.heads)
            np.maximum(per_member, moved, out=per_member)
        rates.append(per_member)
    return rates


def _ring_rate(problem: Problem, seconds_per_byte: float, sender_size: int, heads) -> np.ndarray:
    """`_ring_rates` of one receiving group's members, fed by a group of `sender_size` over a
    link of `seconds_per_byte`."""
    model, train = problem.model, problem.train
    kv_passes = 3 if train.activation_checkpointing else 2
    per_head_bytes = 2 * model.head_dim * (kv_passes * train.compute_dtype_bytes + 4)
    repeats = model.layers * train.micro_batches
    ratio = model.heads // model.kv_heads
    starts = np.concatenate([[0], np.cumsum(heads)[:-1]])
    per_member = np.zeros(len(heads))
    for m, (start, count) in enumerate(zip(starts, heads)):
        kv_in = -(-(start + count) // ratio) - start // ratio
        kv_out = -(-model.kv_heads // sender_size)
        per_member[m] = max(kv_in, kv_out) * per_head_bytes * repeats * seconds_per_byte
    return per_member


def _link_seconds_per_byte(problem: Problem, sender_node: str, receiver_node: str) -> float:
    return problem.memo(
        ("ring link s/B", sender_node, receiver_node),
        lambda: _seconds_per_byte(problem, sender_node, receiver_node),
    )


def _seconds_per_byte(problem: Problem, sender_node: str, receiver_node: str) -> float:
    """Seconds a byte of a large message takes from `sender_node` to `receiver_node`."""
    bandwidth, node_index = problem.links()[0], problem.node_index()
    sample_bytes = float(2**30)
    link = (node_index[sender_node], node_index[receiver_node])
    return problem.cost.transfer_time_s(sample_bytes, bandwidth[link], 0.0) / sample_bytes


def _classes(problem: Problem, groups: list[Group], heads: list[list[int]]) -> list[_Class]:
    """The classes of interchangeable groups, once per grouping in a search (the screen's
    bound, its estimate and the local solve all ask)."""
    key = ("classes", tuple(groups), tuple(map(tuple, heads)))
    return problem.memo(key, lambda: _new_classes(problem, groups, heads))


def _new_classes(problem: Problem, groups: list[Group], heads: list[list[int]]) -> list[_Class]:
    kind_of = problem.memo("rank kinds", lambda: _rank_kinds(problem.cluster))
    members: dict[tuple, list[int]] = {}
    for position, group in enumerate(groups):
        kind = tuple(map(kind_of.__getitem__, group))
        members.setdefault((kind, tuple(heads[position])), []).append(position)
    return [
        _Class(tuple(positions), len(groups[positions[0]]), key[1])
        for key, positions in members.items()
    ]


def _rank_kinds(cluster) -> list[int]:
    """Per rank, a number standing for what makes its groups interchangeable: GPU type,
    compute slowdown and memory capacity (a class shares its first group's memory rows, so
    its groups must share capacities too: a CPU test node may set its own `memory_GiB`)."""
    devices, ids = cluster.devices, {}
    looks = [
        (devices[r].gpu, devices[r].compute_slowdown, cluster.gpu(r).memory_bytes)
        for r in range(cluster.world_size)
    ]
    return [ids.setdefault(look, len(ids)) for look in looks]


def _even_units(groups: list[Group], total: int) -> list[int]:
    """Units in proportion to group size: the starting point of the first linearization."""
    units = apportion(total, [float(len(g)) for g in groups], minimum=1)
    if any(u < len(g) for u, g in zip(units, groups)):
        raise ValueError("the sequence is too short for one quantum per rank")
    return units


def _group_units(
    classes: list[_Class], class_units: list[int], total: int, count: int
) -> list[int]:
    """Each group its class's units and the leftover units one per group: first to every
    group of a class at one unit below its size (each member needs a unit), then the
    largest classes first. The time rows price every group with one unit more, so a class
    may give up a unit (`_with_room_for_minimum`) without slowing the step."""
    class_units = _with_room_for_minimum(classes, list(class_units), total)
    units = [0] * count
    for cls, value in zip(classes, class_units):
        for position in cls.positions:
            units[position] = value
    size_of = {p: cls.size for cls in classes for p in cls.positions}
    order = sorted(range(count), key=lambda p: (units[p] >= size_of[p], -units[p], p))
    for position in order[: total - sum(units)]:
        units[position] += 1
    return units


def _with_room_for_minimum(classes: list[_Class], class_units: list[int], total: int) -> list:
    """`class_units` with enough leftover for every group below its size: while there is
    not, the largest class above its minimum takes one unit less per group (its groups then
    hold no more than the time rows priced). There always is such a class: were every class
    at its minimum, every group would have a leftover unit."""
    counts = [len(cls.positions) for cls in classes]

    def short() -> bool:
        below = sum(n for cls, n, u in zip(classes, counts, class_units) if u < cls.size)
        return total - sum(n * u for n, u in zip(counts, class_units)) < below

    while short():
        spare = [c for c, cls in enumerate(classes) if class_units[c] >= cls.size]
        class_units[max(spare, key=lambda c: (class_units[c], -c))] -= 1
    return class_units


def _rank_fractions(groups, classes: list[_Class], fractions: list[list[float]]) -> tuple:
    shares = {}
    for cls, members in zip(classes, fractions):
        for position in cls.positions:
            for rank, share in zip(groups[position], members):
                shares[rank] = max(share, 0.0)
    total = sum(shares.values())
    return tuple(shares[r] / total for r in sorted(shares))


def _layout(problem, groups, heads, quantum, units: list[int]) -> AttentionLayout:
    """The zigzag layout of `units` per group, once per search (the relinearization's
    layout is often the one the full solve settles on; one object keeps its simulation)."""
    key = ("layout", problem.train.seq_len, tuple(groups), tuple(map(tuple, heads)), quantum)
    key += (tuple(units),)
    return problem.memo(key, lambda: _new_layout(problem, groups, heads, quantum, units))


def _new_layout(problem, groups, heads, quantum, units: list[int]) -> AttentionLayout:
    model = problem.model
    return build_zigzag_layout(
        problem.train.seq_len,
        model.heads,
        model.kv_heads,
        groups,
        [2 * quantum * u for u in units],
        [[1.0] * len(g) for g in groups],
        heads,
        chunk_quantum=quantum,
    )


def _time_coefficients(problem, layout, classes, quantum: int) -> list:
    """`_class_times` from a simulation of `layout` (a secant through zero at its loads)."""
    return _class_times(classes, rates_of(simulated(problem, layout), layout), quantum)


class _Model:
    """Builds and solves the class-level MILP; also its memory-slack variant."""

    def __init__(self, problem, groups, heads, classes, quantum) -> None:
        self.problem, self.groups, self.classes = problem, groups, classes
        self.quantum = quantum
        self.ring = _ring_rates(problem, groups, classes)
        self.total_units = problem.train.seq_len // (2 * quantum)
        self.multi_group = len(groups) > 1
        self.ring_groups = min(len(groups), 3)  # the memory model tells 1, 2 and more apart
        self.memory = [self._member_memory(cls) for cls in classes]
        # Members of a class with the same memory rows are interchangeable: one state-share
        # column and one set of memory rows for all of them (`kinds[c][member]`).
        self.kinds = [kinds_of(members) for members in self.memory]
        # The first member of each kind, per class: the others repeat its rows and share.
        self.kind_members = [
            [m for m, kind in enumerate(kinds) if kinds.index(kind) == m] for kinds in self.kinds
        ]
        self.u = np.arange(len(classes))
        column = len(classes)
        self.f = []
        for kinds in self.kinds:
            self.f.append(column + np.array(kinds))
            column += max(kinds) + 1
        self.largest = column
        self.step = self.largest + 1
        self.utilization = self.step + 1
        self.size = self.utilization + 1

    def solve(self, times: list[np.ndarray]):
        """(units per class, a function giving the state share of each class member), or
        None if nothing fits.

        The LP relaxation first (min step time, then the most headroom within
        TIME_TOLERANCE of it). For its state shares and largest block the memory rows are
        per-class unit ceilings, and the integer problem left is one-dimensional in the
        step time: `_fastest_units` solves it exactly, and an LP re-solves the state shares
        and headroom for those units: when first asked, where even shares keep every memory
        row (that LP is then feasible, and the search runs even shares), else at once.
        Branch and bound runs only where that finds no split (the relaxed shares leave no
        integer room)."""
        bound_s = self.relaxed_step_s(times)
        if bound_s is None:  # the relaxation is infeasible, so is every integer split
            return None
        rows = self._rows(times)
        rows.add({self.step: 1.0}, -np.inf, bound_s * (1 + TIME_TOLERANCE))
        roomiest = self._run(rows, self.utilization, relaxed=True)
        relaxed = roomiest if roomiest is not None else self._relaxed(times)
        units = self._fastest_within(times, relaxed, bound_s)
        if units is not None and self._even_shares_fit(units):
            return [int(u) for u in units], lambda: self._shares(rows, times, units)
        rounded = None if units is None else self._rounded(rows, times, units)
        if rounded is not None:
            return self._split(self._answer(rounded))
        return self._split(self._branch_and_bound(times))

    def _without_lp(self, times) -> np.ndarray | None:
        """The fastest integer units with no LP, where memory does not bind at the
        relaxation's optimum (`_relaxation.unconstrained_optimum`): unit ceilings from even
        state shares and the optimum's units (its largest class sets the largest block),
        and only where even shares keep every memory row at the units found. None: ask the
        LP. (The full solve keeps its LPs: among splits of one step time, the roomiest
        LP's ceilings pick layouts that simulate faster; without them 3 of 50 searches
        found plans 0.3-8 % slower.)"""
        optimum = self._unconstrained(times)
        if optimum is None:
            return None
        bound_s, relaxed_units = optimum
        x = np.zeros(self.size)
        x[self.u] = relaxed_units
        x[np.concatenate(self.f)] = 1.0 / self.problem.cluster.world_size
        units = self._fastest_within(times, x, bound_s)
        if units is None or not self._even_shares_fit(units):
            return None
        return units

    def _unconstrained(self, times) -> tuple[float, np.ndarray] | None:
        """`_relaxation.unconstrained_optimum`, once per groups, quantum and times."""
        key = (*self._key("unconstrained"), _times_key(times))
        return self.problem.memo(key, lambda: unconstrained_optimum(self, times))

    @staticmethod
    def _split(found):
        """(units, shares) as (units, a function giving the shares)."""
        return None if found is None else (found[0], lambda: found[1])

    def _shares(self, rows, times, units: np.ndarray) -> list[list[float]]:
        """The state shares `_rounded` solves for `units` (even shares where the program,
        feasible by `_even_shares_fit`, comes back without a point)."""
        x = self._rounded(rows, times, units)
        if x is None:
            share = 1.0 / self.problem.cluster.world_size
            return [[share] * len(columns) for columns in self.f]
        return self._answer(x)[1]

    def _even_shares_fit(self, units: np.ndarray) -> bool:
        """Whether even state shares keep every memory row at `units` (with the smallest
        largest block the units allow): bytes, not the program's scaled rows."""
        share = 1.0 / self.problem.cluster.world_size
        largest = float(np.max(units)) + 1.0 if self.multi_group else 0.0
        for c, members in enumerate(self.kind_members):
            for member in members:
                phases, capacity = self.memory[c][member]
                coefficients, constants = phase_arrays(self.problem, phases)
                per_unit, per_largest, per_share = coefficients.T
                used = per_unit * units[c] + per_largest * largest + per_share * share
                if np.any(used > memory_limit_bytes(int(capacity)) - constants):
                    return False
        return True

    def fastest_units(self, times) -> list[int] | None:
        """Integer units of the fastest split (`_without_lp` where memory does not bind, else
        for the LP relaxation's state shares; no headroom stage): where the next
        linearization is taken, once per groups, quantum and times in a search (the polish's
        ranking, `first_simulated_s`, and the full evaluation ask for the same). None if
        nothing fits."""
        key = (*self._key("fastest units"), _times_key(times))
        return self.problem.memo(key, lambda: self._new_fastest_units(times))

    def _new_fastest_units(self, times) -> list[int] | None:
        units = self._without_lp(times)
        if units is not None:
            return [int(u) for u in units]
        fastest = self._relaxed(times)
        if fastest is None:
            return None
        units = self._fastest_within(times, fastest, fastest[self.step])
        return None if units is None else [int(u) for u in units]

    def relaxed_step_s(self, times: list) -> float | None:
        """The LP relaxation's fastest step seconds: without an LP where memory does not bind
        at its optimum (`search._relaxation`), else from the LP."""
        optimum = self._unconstrained(times)
        if optimum is not None:
            return optimum[0]
        fastest = self._relaxed(times)
        return None if fastest is None else float(fastest[self.step])

    def _rows(self, times, utilization: bool = True) -> Rows:
        rows = Rows()
        self._time_rows(rows, times)
        rows.extend(self._fixed_rows(utilization))
        return rows

    def _fixed_rows(self, utilization: bool = True) -> Block:
        """The sum and memory rows, which do not depend on the times: built once per groups,
        heads and quantum in a search (every program of the screen and the local stage for
        that grouping shares them). Without `utilization`, the memory limit rows alone: the
        utilization rows bind nothing but the utilization column (unbounded above), so a
        program that does not minimize it (the fastest step time) has the same least step
        time without them, on half the memory rows. Where several points reach that time,
        HiGHS may return another of them (on 54 memory-bound relaxations 24 points differed,
        10 with other unit ceilings; the fastest units were the same in all, and 50 of 50
        searches found the same plans)."""
        key = self._key("fixed rows" if utilization else "fixed limit rows")

        def build() -> Block:
            rows = Rows()
            self._sum_rows(rows)
            self._memory_rows(rows, slack=None, utilization=utilization)
            return rows.block()

        return self.problem.memo(key, build)

    def _key(self, what: str) -> tuple:
        """A memo key of `what` for this grouping, head split and quantum in a search."""
        classes = tuple((cls.positions, cls.heads) for cls in self.classes)
        return what, self.problem.train, tuple(self.groups), classes, self.quantum

    def _relaxed(self, times):
        """The LP relaxation's fastest solution, once per groups, quantum and times in a
        search (the screen and the full evaluation ask for the same one)."""
        if self._memory_rules_out():
            return None
        key = (*self._key("relaxed"), _times_key(times))
        return self.problem.memo(
            key, lambda: self._run(self._rows(times, utilization=False), self.step, relaxed=True)
        )

    def _memory_rules_out(self) -> bool:
        """`_relaxation.memory_rules_out`, once per grouping, head split and quantum."""
        return self.problem.memo(self._key("memory rules out"), lambda: memory_rules_out(self))

    def _branch_and_bound(self, times: list[np.ndarray]):
        fastest = self._run(self._rows(times, utilization=False), self.step)
        if fastest is None:
            return None
        rows = self._rows(times)
        rows.add({self.step: 1.0}, -np.inf, fastest[self.step] * (1 + TIME_TOLERANCE))
        roomiest = self._run(rows, self.utilization)
        return self._answer(roomiest if roomiest is not None else fastest)

    def _answer(self, x):
        units = [int(round(x[c])) for c in self.u]
        return units, [list(x[columns]) for columns in self.f]

    def _rounded(self, rows, times, units: np.ndarray):
        """The state shares and headroom re-solved for `units` (the fastest integer units for
        the relaxed answer's state shares and largest block, `_fastest_units`); None when no
        shares fit them."""
        lower, upper = self._bounds()
        lower[self.u] = upper[self.u] = units
        rows = Rows.without_last(rows)  # the time tolerance row: the units set the time
        program = rows.program(self._objective(self.utilization), lower, upper)
        x = solve(program, time_limit_s=MILP_TIME_LIMIT_S)
        if x is None:
            return None
        x[self.step] = float(np.max(self._finish_s(times, units)))
        return x

    def _fastest_units(
        self, times, ceilings: np.ndarray, bound_s: float, ranges: UnitRanges | None = None
    ) -> np.ndarray | None:
        """Integer units per class minimizing the step time under fixed memory ceilings:
        at a step time T each class may take between the units its ring traffic needs and
        the units its members finish by T (and its ceiling allows); the least T at which
        those ranges can cover the sequence is the LP's bound or one of the step times where
        a range changes (`UnitRanges.changes_after`, the next EVENT_STEPS of each member),
        all tried at once; beyond those it is searched (doublings, then SEARCH_POINTS times
        at once per round until BISECTION_TOLERANCE). The units taken at it are trimmed
        (slowest class first) to the sequence's length."""
        ceilings = np.floor(ceilings + 1e-9)
        ranges = UnitRanges(self, times, ceilings) if ranges is None else ranges.under(ceilings)
        feasible = ranges.covers
        start_s = max(bound_s, 1e-12)
        events = ranges.changes_after(start_s, EVENT_STEPS)  # where the ranges change
        fits = np.flatnonzero(feasible(np.concatenate([[start_s], events])))
        if len(fits):  # the least step time is the start or a change: exact
            high_s = start_s if fits[0] == 0 else events[fits[0] - 1]
            low_s = high_s
        else:
            doublings = start_s * 2.0 ** np.arange(64)
            fits = np.flatnonzero(feasible(doublings))
            if not len(fits):
                return None
            high_s = doublings[fits[0]]
            low_s = doublings[fits[0] - 1] if fits[0] else bound_s * (1 - 1e-9)
        while high_s - low_s > BISECTION_TOLERANCE * high_s:
            points = np.linspace(low_s, high_s, SEARCH_POINTS + 2)[1:-1]
            fits = feasible(points)
            first = int(np.argmax(fits)) if fits.any() else len(points)
            low_s = points[first - 1] if first else low_s
            high_s = points[first] if first < len(points) else high_s
        low, units = (row[0] for row in ranges.at(np.array([high_s])))
        return ranges.trimmed(units, low)

    def missing_bytes(self) -> dict[int, int]:
        """Bytes each rank lacks in the least-short split: slack on every memory row."""
        rows = Rows()
        self._sum_rows(rows)
        slack = self._memory_rows(rows, slack=self.size)
        objective = np.zeros(self.size + len(slack))
        weights = [len(self.classes[c].positions) for c, _ in slack]
        objective[self.size :] = weights
        program = rows.program(objective, *self._bounds(extra=len(slack)))
        x = solve(
            program, integer=self._integrality(extra=len(slack)), time_limit_s=MILP_TIME_LIMIT_S
        )
        values = x[self.size :] if x is not None else np.zeros(len(slack))
        return self._missing_by_rank(slack, values)

    def _missing_by_rank(self, slack, values) -> dict[int, int]:
        missing = {}
        for (c, member), value in zip(slack, values):
            same = [m for m, kind in enumerate(self.kinds[c]) if kind == self.kinds[c][member]]
            for position in self.classes[c].positions:
                for rank in (self.groups[position][m] for m in same):
                    lack = int(np.ceil(value * self.problem.cluster.gpu(rank).memory_bytes))
                    if lack > 0:
                        missing[rank] = lack
        return missing

    def _time_rows(self, rows, times) -> None:
        """T >= busy + fixed, and T >= ring traffic in + fixed, for every member."""
        total_tokens = float(self.problem.train.seq_len)
        block = 2.0 * self.quantum
        for c, (per_unit, fixed) in enumerate(times):
            u = int(self.u[c])
            for seconds_per_unit, fixed_s, ring_s in set(zip(per_unit, fixed, self.ring[c])):
                busy_upper = -fixed_s - seconds_per_unit  # with the leftover unit
                rows.add({u: seconds_per_unit, self.step: -1.0}, -np.inf, busy_upper)
                if ring_s > 0:
                    upper = -fixed_s - ring_s * total_tokens
                    rows.add({u: -ring_s * block, self.step: -1.0}, -np.inf, upper)

    def _finish_s(self, times, units: np.ndarray) -> np.ndarray:
        """Per class, its slowest member's seconds at `units` (the time rows' maximum)."""
        total_tokens = float(self.problem.train.seq_len)
        finish = []
        for (per_unit, fixed), ring, u in zip(times, self.ring, units):
            busy = per_unit * (u + 1) + fixed
            traffic = ring * (total_tokens - 2.0 * self.quantum * u) + fixed
            finish.append(float(np.max(np.maximum(busy, traffic))))
        return np.array(finish)

    def _sum_rows(self, rows) -> None:
        counts = [len(cls.positions) for cls in self.classes]
        units = {int(self.u[c]): float(n) for c, n in enumerate(counts)}
        rows.add(units, self.total_units - sum(counts), self.total_units)
        shares: dict[int, float] = {}
        for n, columns in zip(counts, self.f):
            for column in columns:
                shares[int(column)] = shares.get(int(column), 0.0) + float(n)
        rows.add(shares, 1.0, 1.0)
        if self.multi_group:
            for c in self.u:
                rows.add({int(c): 1.0, self.largest: -1.0}, -np.inf, -1.0)

    def _memory_rows(
        self, rows, slack: int | None, utilization: bool = True
    ) -> list[tuple[int, int]]:
        """Memory limit rows (with a slack column each when `slack` gives the first one) and
        utilization rows (none where not `utilization`: the limit rows alone), in fractions
        of the device's capacity (well scaled beside seconds), added as one block
        (`phase_rows`)."""
        slacks, blocks = [], []
        form = "slack" if slack is not None else "utilization" if utilization else "limits"
        for c, members in enumerate(self.kind_members):  # an identical member repeats them
            for member in members:
                phases, capacity = self.memory[c][member]
                columns = (int(self.u[c]), self.largest, int(self.f[c][member]))
                extra = None
                if form == "slack":
                    slacks.append((c, member))
                    extra = slack + len(slacks) - 1  # the row's own slack column
                elif form == "utilization":
                    extra = self.utilization
                blocks.append(phase_rows(self.problem, phases, capacity, columns, extra, form))
        if blocks:
            row_of, column_of, values, upper = stacked_blocks(blocks)
            rows.add_block(row_of, column_of, values, np.full(len(upper), -np.inf), upper)
        return slacks

    def _member_memory(self, cls: _Class):
        """For each member: each phase of its peak memory as an affine function of (u_c, B,
        f_cm), with the rounding margins folded into the constant, and its capacity. Once per
        group, head split and quantum in a search (candidates share most of their groups)."""
        group = self.groups[cls.positions[0]]
        key = ("members", self.problem.train, group, cls.heads, self.quantum, self.ring_groups)
        return self.problem.memo(key, lambda: self._new_member_memory(cls))

    def _new_member_memory(self, cls: _Class):
        ratio = self.problem.model.heads // self.problem.model.kv_heads
        starts = np.concatenate([[0], np.cumsum(cls.heads)[:-1]]).astype(int)
        members = []
        for rank, start, heads in zip(self.groups[cls.positions[0]], starts, cls.heads):
            kv_heads = -(-(start + heads) // ratio) - start // ratio
            capacity = self.problem.cluster.gpu(rank).memory_bytes
            gpu = self.problem.cluster.devices[rank].gpu
            key = (gpu, heads, kv_heads, self.quantum, cls.size, self.ring_groups)
            phases = self.problem.memo(
                ("phases", self.problem.train, key),
                lambda key=key: phases_of(self.problem, *key),
            )
            members.append((phases, float(capacity)))
        return members

    def _unit_ceilings(self, x, largest: float | None = None) -> np.ndarray:
        """Per class, the most units its members' memory allows with the state shares of `x`
        and a largest block of `largest` units (by default one unit above `x`'s largest
        class rounded down, so any class may round up), and across groups below that
        block."""
        if largest is None:
            largest = self._least_block(x)
        rows = self._growing_rows()
        ceilings = np.full(len(self.classes), np.inf)
        if len(rows.owner):
            room = rows.room - (rows.per_largest * largest + rows.per_share * x[rows.share])
            np.minimum.at(ceilings, rows.owner, room / rows.per_unit)
        if self.multi_group:
            ceilings = np.minimum(ceilings, largest - 1.0)
        return ceilings

    def _least_block(self, x) -> float:
        """One unit above `x`'s largest class rounded down, plus its possible leftover unit."""
        return float(np.floor(np.max(x[self.u]) + 1e-9) + 2.0)

    def _fastest_within(self, times, x, bound_s: float) -> np.ndarray | None:
        """`_fastest_units` under the unit ceilings of `x`'s state shares, the largest block
        raised (up to BLOCK_RAISES units) while it is the ceiling that stops a class: the
        integer optimum may put more than one unit above the relaxation's largest class,
        and where memory does not bind, the block is no limit at all."""
        largest = self._least_block(x)
        ranges = UnitRanges(self, times, np.zeros(0))  # its ceilings set per block
        best, best_s = None, np.inf
        for _ in range(BLOCK_RAISES + 1):
            ceilings = self._unit_ceilings(x, largest)
            units = self._fastest_units(times, ceilings, bound_s, ranges)
            finish_s = np.inf if units is None else float(np.max(self._finish_s(times, units)))
            if finish_s >= best_s:
                break  # the raise gained nothing (or nothing fits)
            best, best_s = units, finish_s
            if not self.multi_group or np.max(units) < largest - 1.0:
                break  # the block did not bind
            higher = ranges.under(np.floor(self._unit_ceilings(x, largest + 1) + 1e-9))
            if not higher.covers(np.array([best_s * (1 - 1e-9)]))[0]:
                break  # a block one unit higher leaves no shorter step
            largest += 1.0
        return best

    def _growing_rows(self) -> GrowingRows:
        """Every member kind's memory rows that grow with its class's units, stacked (once
        per grouping, head split and quantum in a search)."""
        return self.problem.memo(self._key("growing rows"), lambda: GrowingRows.of(self))

    def _objective(self, column: int) -> np.ndarray:
        objective = np.zeros(self.size)
        objective[column] = 1.0
        return objective

    def _run(self, rows, column: int, relaxed: bool = False):
        """Minimize `column` under `rows`: the MILP, or its LP relaxation."""
        return solve(
            rows.program(self._objective(column), *self._bounds()),
            integer=None if relaxed else self._integrality(),
            time_limit_s=MILP_TIME_LIMIT_S,
            relative_gap=MILP_RELATIVE_GAP,
        )

    def _bounds(self, extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
        lower = np.zeros(self.size + extra)
        upper = np.full(self.size + extra, np.inf)
        for c, cls in enumerate(self.classes):
            lower[self.u[c]] = cls.size - 1  # its groups then all take a leftover unit
            upper[self.f[c]] = 1.0
        return lower, upper

    def _integrality(self, extra: int = 0) -> np.ndarray:
        integrality = np.zeros(self.size + extra)
        integrality[self.u] = 1
        return integrality
