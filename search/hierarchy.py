"""Global choices -> groups and ring order (greedy) -> heads -> loads (MILP) -> scored plan."""

from __future__ import annotations

from hexiseq.costmodel.memory import even_state_fractions
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem, evaluate, memory_shortfall, out_of_memory
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.local_milp import LocalSolution, solve_local
from hexiseq.search.screen import group_rates, grouping, resolved_quantum, with_checkpointing

PLAN_NAME = "hexiseq"


def plan_for_choices(problem: Problem, choices: GlobalChoices) -> Plan | InfeasiblePlan:
    """The plan the hierarchy builds for one set of global choices, scored by the simulator."""
    problem = with_checkpointing(problem, choices.activation_checkpointing)
    quantum = resolved_quantum(problem, choices)
    if problem.train.seq_len % (2 * quantum):
        return InfeasiblePlan(
            PLAN_NAME, f"seq_len is not a multiple of 2 x chunk quantum {quantum}"
        )
    groups, heads = grouping(problem, choices)
    if sum(len(g) for g in groups) * 2 * quantum > problem.train.seq_len:
        return InfeasiblePlan(PLAN_NAME, "the sequence is too short for one quantum per rank")
    rates = group_rates(problem, groups, heads, quantum)
    solution = solve_local(problem, groups, heads, quantum, rates)
    if solution.layout is None:
        return out_of_memory(PLAN_NAME, solution.missing_bytes or {})
    fractions, sharding = _state_fractions(problem, solution)
    knobs = {**_knobs(choices, groups, quantum), "state_sharding": sharding}
    return evaluate(problem, solution.layout, fractions, PLAN_NAME, knobs)


def _state_fractions(problem: Problem, solution: LocalSolution) -> tuple[list[float], str]:
    """Even state shares whenever they fit in memory; the MILP's uneven shares (solved only
    then) where even ones would overflow a device (`hexiseq.runtime.sharding` runs either as
    planned)."""
    even = even_state_fractions(problem.cluster.world_size)
    if not memory_shortfall(problem, solution.layout, even):
        return even, "even"
    return list(solution.state_fractions), "MILP (by memory): even shares do not fit"


def _knobs(choices: GlobalChoices, groups, quantum: int) -> dict:
    knobs = {
        "planner": "greedy global + MILP local",
        "hp_degree_by_gpu": dict(choices.hp_degrees),
        "hp_group_sizes": [len(g) for g in groups],
        "ring_order": choices.ring_order,
        "chunk_quantum": quantum,
        "activation_checkpointing": choices.activation_checkpointing,
    }
    if choices.node_groups:  # these nodes' groups, whatever their type's degree
        knobs["hp_node_groups"] = {node: list(sizes) for node, sizes in choices.node_groups}
    return knobs
