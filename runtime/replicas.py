"""Uneven data parallelism over CP-HP meshes (HexiScale's uneven batch, for long sequences).

The world is split into replicas. Each replica is a process group running its own
`AttentionLayout` over its own ranks (layout rank i is the replica's `ranks[i]`), so each can
have its own GPU mix and size, and takes its own number of sequences per step, so that the
replicas finish together. One step:

1. every rank counts the labelled tokens of its shards of its replica's sequences; one
   all-reduce over the world gives the step's total (all replicas, all sequences);
2. each replica runs its sequences one after another through the model over `CPHPAttention`
   on its group; each rank back-propagates the sum of its tokens' losses / the step's total,
   so the shares of every rank of every replica add up to the mean over all the step's
   labelled tokens: a replica weighs by the tokens it took, whatever its size;
3. the gradients are summed over the world (`loss.all_reduce_gradients`): every rank then
   holds the gradient of that mean, as one process training on the whole batch would.

Model states are whole on every rank here (the replicated mode); sharding them inside a
replica, with a reduction across replicas of unevenly sharded gradients, is not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as functional
from torch import nn

from hexiseq.errors import InputError
from hexiseq.layout import AttentionLayout
from hexiseq.plan import Plan, Replica, replica_problems
from hexiseq.runtime.loss import IGNORE_LABEL, all_reduce_gradients, next_token_labels
from hexiseq.runtime.model import token_positions


def check_replicas(replicas: Sequence[Replica], world_size: int) -> None:
    """Every rank of the world in exactly one replica, each replica's layout made for its
    size, one sequence length for all, at least one sequence each; else InputError."""
    seq_len = replicas[0].layout.seq_len if replicas else 0
    problems = replica_problems(tuple(replicas), world_size, seq_len)
    if problems:
        raise InputError("; ".join(problems))


def replica_groups(replicas: Sequence[Replica]) -> list[dist.ProcessGroup]:
    """One process group per replica, its ranks in layout order (collective over the world:
    every rank makes every group, in the same order)."""
    return [dist.new_group(list(replica.ranks), sort_ranks=False) for replica in replicas]


def own_replica(replicas: Sequence[Replica], rank: int) -> int:
    """The index of the replica that holds global `rank`."""
    return next(i for i, replica in enumerate(replicas) if rank in replica.ranks)


def sequence_indices(replicas: Sequence[Replica]) -> list[range]:
    """Which of the step's sequences each replica takes: replica r the next `sequences` after
    the earlier replicas'."""
    indices, first = [], 0
    for replica in replicas:
        indices.append(range(first, first + replica.sequences))
        first += replica.sequences
    return indices


@dataclass(frozen=True)
class ReplicaStepLoss:
    """This rank's part of a step over replicas, after its backward."""

    loss: float
    """The mean next-token loss over every labelled token of the step (every rank the same)."""
    labelled_tokens: int
    """Labelled tokens of the whole step: all replicas, all sequences."""


def replica_step(
    model: nn.Module,
    replicas: Sequence[Replica],
    rank: int,
    tokens_NS: torch.Tensor,
) -> ReplicaStepLoss:
    """Forward and backward of one step of `tokens_NS` (every sequence of the step, the same
    on every rank) on this rank's replica, gradients summed over the world (module
    docstring). `model` runs over `CPHPAttention` of this rank's replica group and holds
    whole parameters."""
    index = own_replica(replicas, rank)
    replica = replicas[index]
    layout_rank = replica.ranks.index(rank)
    positions_T = token_positions(replica.layout, layout_rank)
    mine = sequence_indices(replicas)[index]
    if tokens_NS.shape[0] != sum(r.sequences for r in replicas):
        raise InputError(
            f"the step has {tokens_NS.shape[0]} sequences but the replicas take "
            f"{sum(r.sequences for r in replicas)}"
        )
    labels = [next_token_labels(tokens_NS[n : n + 1], positions_T) for n in mine]
    counted = torch.tensor([float(sum((row != IGNORE_LABEL).sum().item() for row in labels))])
    dist.all_reduce(counted)  # the step's labelled tokens, every replica's
    total = counted.item()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for n, labels_BT in zip(mine, labels):
        logits_BTV = model(tokens_NS[n : n + 1, positions_T], positions_T)
        token_losses = functional.cross_entropy(
            logits_BTV.flatten(0, 1).float(), labels_BT.flatten(),
            ignore_index=IGNORE_LABEL, reduction="sum",
        )  # fmt: skip
        (token_losses / total).backward()
        loss_sum += token_losses.detach().double()
    dist.all_reduce(loss_sum)
    all_reduce_gradients(list(model.parameters()))  # over the world: every replica's share
    return ReplicaStepLoss(loss_sum.item() / total, int(total))


@dataclass(frozen=True)
class Mesh:
    """This rank's CP-HP mesh in a plan: the replica it belongs to (the whole world for a
    plan of one mesh), its process group, its rank and layout there, and which of the step's
    sequences it trains."""

    index: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    """None: the default group (a plan of one mesh)."""
    local_rank: int
    layout: AttentionLayout
    sequences: range
    total_sequences: int
    """Sequences of the whole step, every replica's."""
    fractions: tuple[float, ...]
    """The replica's ranks' state shares, in layout order."""
    data_parallel: bool


def plan_mesh(plan: Plan, rank: int) -> Mesh:
    """This rank's mesh in a plan of one mesh (no process group is created); a plan of
    several replicas needs `join_mesh` (InputError)."""
    if plan.data_parallel:
        raise InputError(
            f"plan {plan.name} runs {len(plan.replicas)} data-parallel replicas: each rank joins "
            "its replica's process group first (runtime.replicas.join_mesh)"
        )
    replica = plan.replicas[0]
    return Mesh(
        index=0,
        ranks=replica.ranks,
        group=None,
        local_rank=rank,
        layout=replica.layout,
        sequences=range(replica.sequences),
        total_sequences=replica.sequences,
        fractions=tuple(a.state_fraction for a in plan.assignments),
        data_parallel=False,
    )


def join_mesh(plan: Plan, rank: int) -> Mesh:
    """This rank's mesh: for a plan of several replicas, one process group per replica is
    created (collective over the world: every rank calls it)."""
    if not plan.data_parallel:
        return plan_mesh(plan, rank)
    groups = replica_groups(plan.replicas)
    index = own_replica(plan.replicas, rank)
    replica = plan.replicas[index]
    return Mesh(
        index=index,
        ranks=replica.ranks,
        group=groups[index],
        local_rank=replica.ranks.index(rank),
        layout=replica.layout,
        sequences=sequence_indices(plan.replicas)[index],
        total_sequences=sum(r.sequences for r in plan.replicas),
        fractions=tuple(plan.assignments[r].state_fraction for r in replica.ranks),
        data_parallel=True,
    )


@dataclass(frozen=True)
class _Piece:
    """A piece of one unit's flat gradient held by exactly one rank of every replica."""

    unit: int
    start: int  # in the unit's flat buffer
    stop: int
    owners: tuple[int, ...]  # global ranks, one per replica, sorted


class CrossReplicaReduction:
    """Sums sharded FP32 gradients across replicas whose shards differ (uneven sizes and
    state shares): each unit's flat range is cut at every replica's shard boundaries, so that
    each piece lies in one shard of every replica; the pieces with the same owners (one rank
    per replica) are all-reduced among those owners, every set of owners in one order on
    every rank (so no two ranks wait on each other). Creating it is collective over the world
    (one process group per set of owners)."""

    def __init__(self, plan: Plan, unit_sizes: Sequence[int], rank: int) -> None:
        self.rank = rank
        self.offsets = {}  # unit -> this rank's shard start in the unit
        pieces: list[_Piece] = []
        for unit, size in enumerate(unit_sizes):
            starts = [_shard_starts(plan, replica, size) for replica in plan.replicas]
            for shard_starts in starts:
                if rank in shard_starts:
                    self.offsets[unit] = shard_starts[rank][0]
            pieces += _pieces(unit, size, plan.replicas, starts)
        owner_sets = sorted({piece.owners for piece in pieces})
        self.groups = {owners: dist.new_group(list(owners)) for owners in owner_sets}
        self.mine = [
            (owners, [p for p in pieces if p.owners == owners])
            for owners in owner_sets
            if rank in owners
        ]

    def reduce(self, masters: Sequence[torch.Tensor]) -> None:
        """Sum each unit's master-shard gradient (`masters[unit].grad`) over the replicas, in
        place: one all-reduce per piece, no buffer beside the gradients (the memory model
        counts none)."""
        for owners, pieces in self.mine:
            group = self.groups[owners]
            for piece in pieces:
                offset = self.offsets[piece.unit]
                gradient = masters[piece.unit].grad
                dist.all_reduce(gradient[piece.start - offset : piece.stop - offset], group=group)


def _shard_starts(plan: Plan, replica: Replica, size: int) -> dict[int, tuple[int, int]]:
    """Each rank of `replica`: its [start, stop) in a unit of `size` elements."""
    from hexiseq.runtime.sharding import shard_counts

    fractions = [plan.assignments[rank].state_fraction for rank in replica.ranks]
    bounds, start = {}, 0
    for rank, count in zip(replica.ranks, shard_counts(size, fractions)):
        bounds[rank] = (start, start + count)
        start += count
    return bounds


def _pieces(
    unit: int, size: int, replicas: Sequence[Replica], starts: list[dict[int, tuple[int, int]]]
) -> list[_Piece]:
    cuts = sorted({0, size} | {edge for bounds in starts for b in bounds.values() for edge in b})
    pieces = []
    for start, stop in zip(cuts, cuts[1:]):
        if stop <= start:
            continue
        owners = tuple(
            sorted(
                next(rank for rank, (a, b) in bounds.items() if a <= start < b)
                for bounds in starts
            )
        )
        pieces.append(_Piece(unit, start, stop, owners))
    return pieces
