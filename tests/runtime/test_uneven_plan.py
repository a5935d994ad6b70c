"""Tier 2: a plan whose model-state shares are uneven (a CPU cluster whose nodes set
`memory_GiB` so tight that even shares do not fit) runs as planned on gloo ranks (issue 12).

The planner gives uneven `state_fraction`s only when even ones overflow a device
(`search/hierarchy.py`); each node's `memory_GiB` is derived from the memory model's own terms
for the even plan, so the test follows the model as it changes. Each rank then holds exactly
its planned share of the FP32 master weights and twice that in AdamW states, and the step's
loss equals the replicated run of the same plan.
"""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_distributed

import hexiseq
from hexiseq import Cluster, Plan
from hexiseq.catalog import GiB
from hexiseq.costmodel.memory import MEMORY_LIMIT_FRACTION

pytestmark = pytest.mark.multiproc

MODEL = "tiny"
SEQ_LEN = 128
# Each node's room for model states beside the rest of what it holds, in shares of the whole
# model's (None: the catalog's memory). Three tight nodes: they add up to more than one (a plan
# fits) but the last is below an even third (even shares do not). One cramped node: the others
# have the catalog's 24 GiB, the last too little for a third (the MILP, keeping every device
# roomiest, may give it no share at all: an empty shard, which must run too).
STATE_ROOM = {
    "three-tight-nodes": (0.5, 0.4, 0.3),
    "one-cramped-node": (None, None, 0.15),
}
WORLD_SIZE = 3


def _cluster(memory_GiB: list[float | None]) -> Cluster:
    nodes = []
    for index, memory in enumerate(memory_GiB):
        node = {"name": f"n{index}", "gpu": "cpu", "count": 1}
        if memory is not None:
            node["memory_GiB"] = memory
        nodes.append(node)
    network = {"inter_node_GBps": 2.0, "inter_node_latency_us": 50}
    return Cluster.from_dict({"name": "cpu-tight-memory", "nodes": nodes, "network": network})


def _search(cluster: Cluster) -> Plan:
    # Checkpointing forced off: the search could otherwise trade it for memory.
    return hexiseq.plan_search(cluster, MODEL, SEQ_LEN, activation_checkpointing=False).best


def _tight_plan(rooms: tuple[float | None, ...]) -> Plan:
    """The best plan on a cluster whose node r has room for `rooms[r]` of the model states
    beside what else it holds in the even plan, below the 95 % limit."""
    even = _search(_cluster([None] * len(rooms)))
    ranks = even.predicted.ranks
    all_states = sum(rank.memory_terms["model_states"] for rank in ranks)
    memory_GiB = [
        None
        if room is None
        else (rank.memory_bytes - rank.memory_terms["model_states"] + room * all_states)
        / MEMORY_LIMIT_FRACTION
        / GiB
        for rank, room in zip(ranks, rooms)
    ]
    return _search(_cluster(memory_GiB))


@pytest.fixture(scope="module")
def tight_plans() -> dict[str, Plan]:
    return {name: _tight_plan(rooms) for name, rooms in STATE_ROOM.items()}


@pytest.mark.parametrize("case", sorted(STATE_ROOM))
def test_tight_memory_makes_the_milp_choose_uneven_state_shares(tight_plans, case):
    plan = tight_plans[case]
    fractions = [a.state_fraction for a in plan.assignments]
    assert plan.knobs["state_sharding"].startswith("MILP (by memory)")
    assert math.isclose(sum(fractions), 1.0, rel_tol=1e-9)
    assert max(fractions) - min(fractions) > 0.1  # uneven, not a rounding of even
    assert fractions[-1] < 1 / 3 < fractions[0]  # the tightest node holds the least
    for rank in plan.predicted.ranks:  # and each fits under its own node's limit
        assert rank.memory_bytes <= MEMORY_LIMIT_FRACTION * rank.memory_capacity_bytes
    capacities = [rank.memory_capacity_bytes for rank in plan.predicted.ranks]
    assert capacities == [plan.cluster.gpu(r).memory_bytes for r in range(WORLD_SIZE)]
    assert capacities[-1] < GiB  # the node's memory_GiB, not the catalog's


def test_uneven_plans_run_as_planned_and_match_the_replicated_loss(tight_plans):
    plans_json = [plan.to_json_text() for plan in tight_plans.values()]
    run_distributed(_check_uneven_plans, WORLD_SIZE, plans_json)


def _check_uneven_plans(rank: int, world_size: int, plans_json: list[str]) -> None:
    for plan_json in plans_json:  # one spawn for all: starting ranks costs more than a step
        _check_uneven_plan(rank, world_size, plan_json)


def _check_uneven_plan(rank: int, world_size: int, plan_json: str) -> None:
    from hexiseq.runtime import train as training
    from hexiseq.runtime._emulation import ComputePadding
    from hexiseq.runtime.model import token_positions

    plan = Plan.from_json_text(plan_json)
    context = training.RankContext.cpu(rank, world_size)
    positions = token_positions(plan.layout(), rank)
    tokens = training.step_tokens(plan, 0, 0)

    def one_step(sharded: bool):
        model = training.build_plan_model(plan, context, 0, sharded)
        optimizer = training.build_optimizer(model, 1e-3)
        padding = ComputePadding(model, 1.0)
        loss = training.run_step(
            plan, context, model, optimizer, padding, tokens, positions, sharded
        )
        return model, optimizer, loss

    model, optimizer, sharded_loss = one_step(sharded=True)
    states = model.sharded_states
    share = plan.assignments[rank].state_fraction
    whole = sum(unit.numel for unit in states.units)
    assert whole == plan.model.params
    # Each unit rounds its share to whole elements (shard_counts): off by under one per unit.
    assert abs(states.master_elements() - share * whole) <= len(states.units)
    adam_elements = 0
    for parameter in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state[parameter][key]
            assert state.dtype == torch.float32
            adam_elements += state.numel()
    assert adam_elements == 2 * states.master_elements()
    _, _, replicated_loss = one_step(sharded=False)
    assert math.isclose(sharded_loss, replicated_loss, rel_tol=1e-5), (
        rank,
        sharded_loss,
        replicated_loss,
    )
