"""The ranks of a supervised run (`hexiseq run --replan`) launched on this machine by torch
elastic's launcher, in the calling process, and how they ended: the supervisor
(`hexiseq/cli/supervise.py`) needs to tell a lost device (a rank killed outright) from a
failing run, which torchrun's exit code does not say.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from hexiseq.errors import HexiseqError

RENDEZVOUS_TIMEOUT_S = 900
"""How long a node of a launch over several nodes waits for the others to meet."""
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""How the launcher stops the ranks it gives up on: not a lost device."""


@dataclass(frozen=True)
class NodeLaunch:
    """This machine's part of a launch over several nodes: node `node_rank` of `nodes`,
    meeting the others at `master` (ADDR:PORT, node 0's) by torchrun's static rendezvous."""

    node_rank: int
    nodes: int
    master: str
    launch: int = 0
    """Which launch of the run (a relaunch after a lost device meets under a new name)."""


@dataclass(frozen=True)
class LaunchOutcome:
    code: int
    lost: tuple[int, ...] = ()
    """Ranks killed by a signal not the launcher's (lost devices)."""


def launch(
    arguments: list[str], world: int, launch_id: str, node: NodeLaunch | None = None
) -> LaunchOutcome:
    """Run `world` ranks of `python -m hexiseq.runtime.train arguments` on this machine until
    they end (they see this process's environment), and say how: 0, lost ranks (global
    ranks), or another exit code. With `node`, they are this node's ranks of a launch over
    several nodes, ranked after the nodes before it (as torchrun --node-rank does)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if node is None:
        rendezvous = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0"}
        run_id = f"hexiseq-{launch_id[:8]}-{uuid.uuid4().hex[:8]}"
    else:
        rendezvous = {
            "rdzv_backend": "static",
            "rdzv_endpoint": node.master,
            "rdzv_configs": {"rank": node.node_rank, "timeout": RENDEZVOUS_TIMEOUT_S},
        }
        run_id = f"hexiseq-{launch_id[:8]}-{node.launch}"  # the same on every node
    nodes = 1 if node is None else node.nodes
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=world,
        run_id=run_id,
        max_restarts=0,
        monitor_interval=0.1,
        **rendezvous,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "hexiseq.runtime.train", *arguments)
    except ChildFailedError as error:
        return outcome_of({rank: failure.exitcode for rank, failure in error.failures.items()})
    except Exception as error:  # the rendezvous itself: a port taken, a master unreachable
        if node is None:
            raise
        raise HexiseqError(
            f"node {node.node_rank} could not meet the other nodes at {node.master} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "check that node 0 runs, that --master is its address and a free port, and that "
            "every node was started the same way"
        ) from None
    return LaunchOutcome(0)


def outcome_of(exit_codes: dict[int, int]) -> LaunchOutcome:
    """How a launch ended from its failed ranks' exit codes (negative: killed by signal -c):
    ranks killed by a signal other than the launcher's are lost devices."""
    stopped = {-int(s) for s in LAUNCHER_SIGNALS}
    lost = tuple(sorted(r for r, c in exit_codes.items() if c < 0 and c not in stopped))
    if lost:
        return LaunchOutcome(1, lost)
    positive = [c for c in exit_codes.values() if c > 0]
    return LaunchOutcome(max(positive) if positive else 1)


def stop_ranks() -> int:
    """SIGTERM to the ranks this process launched (its child processes running the runtime):
    a signal of the launcher's own, so no rank counts as lost, and the launch ends. Linux
    (/proc); how many were signalled."""
    stopped = 0
    for pid in _children(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"hexiseq.runtime.train" in command:
                os.kill(pid, signal.SIGTERM)
                stopped += 1
        except OSError:  # it ended meanwhile
            continue
    return stopped


def _children(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent_pid = int(fields[1])  # the field after the state
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not a process's
            continue
        if parent_pid == parent:
            children.append(int(stat.parent.name))
    return children


def checkpoint_support_error() -> str | None:
    """Why this torch cannot checkpoint a supervised run (`checkpoint`), or None."""
    import torch
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "HuggingFaceStorageWriter"):
        return None
    return (
        f"--replan checkpoints with torch.distributed.checkpoint's safetensors storage, which "
        f"torch {torch.__version__} lacks: install a newer torch (2.13 is tested)"
    )
