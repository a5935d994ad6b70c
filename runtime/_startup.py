"""Pure: is a rank that torchrun started where the plan puts it? Checked by every rank before
any communication, so a rank started on the wrong machine, with the wrong process count or on
the wrong GPU type stops with one line instead of hanging in a rendezvous or a collective.

torchrun tells a rank where it is through RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE.
It numbers global ranks node by node (a node's base rank is the sum of the earlier nodes'
process counts), and the cluster numbers its devices node by node too, so with one torchrun
node per plan node (`hexiseq run --node-rank K`) rank r is the plan's device r, at local rank
`Device.local_rank` of a node of `Node.count` processes. `hexiseq run` without --node-rank puts
every rank on one machine (local rank = rank). No torch here: the caller reads the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hexiseq.catalog import catalog_type_for
from hexiseq.errors import InputError
from hexiseq.plan import Plan


@dataclass(frozen=True)
class FoundDevice:
    """What a rank found at cuda:LOCAL_RANK: the driver's name and the memory of that device
    ("" and 0 when there is none), and how many CUDA devices the machine has."""

    name: str
    memory_GiB: float
    devices_here: int


def rank_start_error(
    plan: Plan, environ: Mapping[str, str], cuda_device: FoundDevice | None = None
) -> str | None:
    """Why this rank (torchrun's variables in `environ`) must not start `plan`, or None.

    `cuda_device`: the device at cuda:LOCAL_RANK when the rank runs on CUDA, None on the CPU
    (any CPU rank stands for the plan's device). The message names the rank, what the plan
    expects and what torchrun or the machine gave it."""
    world_size = int(environ.get("WORLD_SIZE", "0"))
    rank = int(environ.get("RANK", "0"))
    if world_size != plan.cluster.world_size:
        return (
            f"rank {rank}: plan '{plan.name}' is for {plan.cluster.world_size} ranks but "
            f"torchrun started {world_size or 'none (run under torchrun)'}; use --nproc-per-node "
            f"{plan.cluster.world_size} (one machine) or `hexiseq run --print-launch` (nodes)"
        )
    local_rank = int(environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    error = placement_error(plan, rank, local_rank, local_world_size)
    if error is None and cuda_device is not None:
        error = device_type_error(plan, rank, local_rank, cuda_device)
    return error


def check_world_size(plan: Plan, environ: Mapping[str, str]) -> None:
    """`rank_start_error` without a device (WORLD_SIZE and placement only) as an InputError."""
    error = rank_start_error(plan, environ)
    if error is not None:
        raise InputError(error)


def placement_error(plan: Plan, rank: int, local_rank: int, local_world_size: int) -> str | None:
    """Why torchrun's rank `rank` (local rank `local_rank` of `local_world_size` on its
    machine) is not where the plan puts it, or None: either every rank on one machine
    (`hexiseq run`), or the plan's node of that rank with exactly its devices
    (`hexiseq run --node-rank K`, torchrun --nnodes)."""
    if not 0 <= rank < plan.cluster.world_size:
        return (
            f"rank {rank} is outside plan '{plan.name}' (ranks 0..{plan.cluster.world_size - 1})"
        )
    device = plan.cluster.devices[rank]
    node = next(n for n in plan.cluster.nodes if n.name == device.node)
    one_machine = local_world_size == plan.cluster.world_size and local_rank == rank
    its_node = local_world_size == node.count and local_rank == device.local_rank
    if one_machine or its_node:
        return None
    return (
        f"rank {rank} runs as local rank {local_rank} of {local_world_size} on its machine, but "
        f"plan '{plan.name}' puts it at local rank {device.local_rank} of node {device.node}'s "
        f"{node.count} {device.gpu} device(s) (or every rank on one machine); start node "
        "K with `hexiseq run --node-rank K` (`--print-launch` shows each node's command)"
    )


def device_type_error(
    plan: Plan, rank: int, local_rank: int, cuda_device: FoundDevice
) -> str | None:
    """Why cuda:`local_rank` (`cuda_device`) is not the GPU type the plan gave `rank`, or None.
    The type is the catalog's for the driver's name and memory (A100 40 vs 80 GB)."""
    planned = plan.assignments[rank].gpu
    if local_rank >= cuda_device.devices_here:
        return (
            f"rank {rank} is planned on a {planned} at cuda:{local_rank} but this machine has "
            f"{cuda_device.devices_here} CUDA device(s); plan for the devices you run on"
        )
    found = catalog_type_for(cuda_device.name, cuda_device.memory_GiB)
    if found == planned:
        return None
    return (
        f"rank {rank} is planned on a {planned} but its device cuda:{local_rank} is a "
        f"{cuda_device.name} with {cuda_device.memory_GiB:.0f} GiB "
        f"({found or 'not in the catalog'}); plan for the devices you run on"
    )
