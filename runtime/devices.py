"""The launcher's device check (`hexiseq run`, before torchrun starts): the CUDA devices of
this machine against the ranks of the plan it will run. Here, not in the CLI, because it needs
torch, which the core never imports (docs/design.md §1)."""

from __future__ import annotations

import torch

from hexiseq.errors import InputError
from hexiseq.runtime._startup import FoundDevice, device_type_error


def check_run_devices(plan, device: str, node_rank: int | None = None) -> None:
    """Before any process group forms: `--device cuda` needs, on this machine, one CUDA device
    per rank of the plan (of node `node_rank` only, on a multi-node launch: its ranks at
    cuda:`Device.local_rank`), each of the GPU type the plan put there; `auto` checks the same
    when CUDA is there (else the ranks run on the CPU). The type check is the one each rank
    runs again under torchrun (`hexiseq.runtime._startup`)."""
    available = torch.cuda.is_available()
    if not available:
        if device == "cuda":
            raise InputError(
                f"--device cuda: torch {torch.__version__} finds no CUDA device here; use "
                "--device cpu (or auto)"
            )
        return
    ranks, where = _ranks_here(plan, node_rank)
    devices_here = torch.cuda.device_count()
    if devices_here < len(ranks):
        raise InputError(
            f"the plan has {len(ranks)} ranks{where}, one per device, but this machine has "
            f"{devices_here} CUDA device(s); plan for the devices you run on"
        )
    for rank, local in ranks:
        memory_GiB = torch.cuda.get_device_properties(local).total_memory / 2**30
        found = FoundDevice(torch.cuda.get_device_name(local), memory_GiB, devices_here)
        error = device_type_error(plan, rank, local, found)
        if error is not None:
            raise InputError(error)


def _ranks_here(plan, node_rank: int | None) -> tuple[list[tuple[int, int]], str]:
    """(global rank, CUDA index) of each rank this machine runs, and where that is: every rank
    at cuda:rank on one machine, or node K's at cuda:`Device.local_rank`."""
    if node_rank is None:
        return [(rank, rank) for rank in range(plan.cluster.world_size)], ""
    node = plan.cluster.nodes[node_rank]  # a node the plan has (`hexiseq run` checked)
    devices = [d for d in plan.cluster.devices if d.node == node.name]
    return [(d.rank, d.local_rank) for d in devices], f" on node {node_rank} ({node.name})"
