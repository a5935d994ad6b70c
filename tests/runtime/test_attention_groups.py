"""`CPHPAttention` over a given process group, not only the default one: several groups of one
world (data-parallel replicas) each run their own layout at once, checked against the
single-process reference (fp32, fresh random inputs, relative error <= 1e-5)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from attention_cases import check_case, random_cases
from distributed import run_distributed

from hexiseq import InputError

pytestmark = pytest.mark.multiproc


def _replicas(rank: int, world_size: int, replicas: list[list[int]], sort: bool, seed: int):
    """Every rank makes every replica's group (a collective of the world), then the members
    of each run that replica's own random layouts over it."""
    groups = [dist.new_group(ranks, sort_ranks=sort) for ranks in replicas]
    for index, (ranks, group) in enumerate(zip(replicas, groups)):
        if rank not in ranks:
            continue
        group_rank = dist.get_rank(group)
        assert dist.get_process_group_ranks(group)[group_rank] == rank
        for case in random_cases(seed + 1000 * index, world_size=len(ranks), count=3):
            check_case(case, group_rank, group)


@pytest.mark.parametrize(
    ("replicas", "sort"),
    [
        ([[0, 2], [1, 3]], True),  # interleaved members: group ranks are not global ranks
        ([[0, 1, 3], [2]], True),  # uneven replicas, one of a single rank
        ([[3, 0, 1], [2]], False),  # a group whose rank order is not the global order
    ],
)
def test_replicas_each_run_their_own_layout_at_once(replicas, sort):
    run_distributed(_replicas, 4, replicas, sort, 20261123)


def _outsider(rank: int, world_size: int) -> None:
    from hexiseq.runtime import CPHPAttention

    group = dist.new_group([0, 1])
    dist.barrier()  # every rank has joined the group before any leaves (and tears down)
    if rank == 1:
        return
    (case,) = random_cases(5, world_size=2, count=1)
    if rank == 2:
        with pytest.raises(InputError, match="global rank 2 is not in the given process group"):
            CPHPAttention(case.layout, group)
        return
    with pytest.raises(InputError, match="the layout is for 3 ranks but the process group has 2"):
        CPHPAttention(random_cases(5, world_size=3, count=1)[0].layout, group)


def test_a_rank_outside_the_group_or_a_layout_of_another_size_is_refused():
    run_distributed(_outsider, 3)
