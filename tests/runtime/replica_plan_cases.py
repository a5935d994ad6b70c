"""Workers for plans of several data-parallel replicas run by `runtime.train` (issue 15)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as functional
from model_cases import TOLERANCE, relative_error

from hexiseq import Cluster, Plan
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.search import plan_search
from hexiseq.search.replicas import ReplicaPart, compose

SEED = 20261125
CLUSTER = {
    "name": "cpu-3-1",
    "nodes": [
        {"name": "wide", "gpu": "cpu", "count": 3},
        {"name": "one", "gpu": "cpu", "count": 1},
    ],
    "network": {"inter_node_GBps": 2.0, "inter_node_latency_us": 50},
}


def replica_plan(fractions: dict[str, list[float]], sequences: dict[str, int]) -> Plan:
    """A plan of two replicas on `CLUSTER`: its 3-rank node and its 1-rank node, each with
    the state shares and sequences per step given by node name (fp32, tiny model, 48
    tokens per sequence)."""
    cluster = Cluster.from_dict(CLUSTER)
    parts = []
    for node in ("wide", "one"):
        sub = cluster.subset([node])
        plan = plan_search(sub, "tiny", 48, data_parallel=False, precision="fp32").best
        train = dataclasses.replace(plan.train, micro_batches=sequences[node])
        assignments = tuple(
            dataclasses.replace(a, state_fraction=f)
            for a, f in zip(plan.assignments, fractions[node], strict=True)
        )
        parts.append(ReplicaPart(dataclasses.replace(plan, train=train, assignments=assignments)))
    return compose(cluster, parts, DatasheetCostModel(), "two replicas", {})


class _CaptureGradients:
    """Stands in for AdamW: keeps the whole gradients the step produced (collective over the
    replica) instead of stepping."""

    def __init__(self, model) -> None:
        self.model = model
        self.gradients: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        states = getattr(self.model, "sharded_states", None)
        if states is not None:
            self.gradients = states.full_gradients()
        else:
            self.gradients = {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def reference(plan: Plan, tokens_NS: torch.Tensor):
    """The single-process float64 model on the whole batch: mean of each sequence's mean
    next-token cross-entropy, and its gradients."""
    from hexiseq.runtime.model import LocalAttention, build_model

    model = build_model(plan.model, LocalAttention(), seed=SEED, dtype=torch.float64)
    logits = model(tokens_NS, torch.arange(tokens_NS.shape[1]))
    loss = functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens_NS[:, 1:].flatten())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def check_replica_plan_step(rank: int, world_size: int, plan_text: str, sharded: bool) -> None:
    """This rank runs `runtime.train.run_step` of the plan; loss and every whole gradient
    equal the reference's."""
    from hexiseq.runtime import train
    from hexiseq.runtime._emulation import ComputePadding
    from hexiseq.runtime.model import token_positions
    from hexiseq.runtime.replicas import join_mesh

    torch.manual_seed(777 + rank)  # nothing may depend on the global RNG
    plan = Plan.from_json_text(plan_text)
    context = train.RankContext.cpu(rank, world_size, mesh=join_mesh(plan, rank))
    model = train.build_plan_model(plan, context, SEED, sharded)
    capture = _CaptureGradients(model)
    tokens = train.step_tokens(plan, SEED, 0)
    mesh = context.mesh
    positions = token_positions(mesh.layout, mesh.local_rank)
    padding = ComputePadding(model, 1.0)
    loss = train.run_step(plan, context, model, capture, padding, tokens, positions, sharded)
    want_loss, want_gradients = reference(plan, tokens)
    assert abs(loss - want_loss) / abs(want_loss) <= TOLERANCE, (rank, loss, want_loss)
    assert capture.gradients.keys() == want_gradients.keys()
    for name, gradient in capture.gradients.items():
        error = relative_error(gradient, want_gradients[name])
        assert error <= TOLERANCE, f"rank {rank} {name} gradient error {error:.2e}"


def check_replica_plan_steps(rank: int, world_size: int, cases: list[tuple[str, bool]]) -> None:
    """`check_replica_plan_step` of every (plan JSON, sharded) case, one after another."""
    for plan_text, sharded in cases:
        check_replica_plan_step(rank, world_size, plan_text, sharded)
