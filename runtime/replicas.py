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
from hexiseq.runtime.loss import IGNORE_LABEL, all_reduce_gradients, next_token_labels
from hexiseq.runtime.model import token_positions


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica: its global ranks (layout rank i is `ranks[i]`), the CP-HP
    layout it runs over them, and how many sequences it takes per step."""

    ranks: tuple[int, ...]
    layout: AttentionLayout
    sequences: int


def check_replicas(replicas: Sequence[Replica], world_size: int) -> None:
    """Every rank of the world in exactly one replica, each replica's layout made for its
    size, one sequence length for all, at least one sequence each; else InputError."""
    ranks = [rank for replica in replicas for rank in replica.ranks]
    if sorted(ranks) != list(range(world_size)):
        raise InputError(
            f"replicas must hold every rank 0..{world_size - 1} exactly once (they hold "
            f"{sorted(ranks)})"
        )
    lengths = {replica.layout.seq_len for replica in replicas}
    if len(lengths) != 1:
        raise InputError(f"replicas must train one sequence length (got {sorted(lengths)})")
    for index, replica in enumerate(replicas):
        if replica.layout.world_size != len(replica.ranks):
            raise InputError(
                f"replica {index} has {len(replica.ranks)} ranks but its layout is for "
                f"{replica.layout.world_size}"
            )
        if replica.sequences < 1:
            raise InputError(f"replica {index} takes {replica.sequences} sequences; at least 1")


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
