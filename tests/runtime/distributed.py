"""`run_distributed`: run a function on several gloo ranks in spawned processes (test tier 2).

The function runs as `fn(rank, world_size, *args)` in every process, inside an initialized
gloo process group (tcp://127.0.0.1 on a free port) that is destroyed in `finally`. An
exception or failed assertion on any rank fails the calling test with that rank's traceback;
a rank stuck in a collective fails after `timeout_s` instead of hanging the suite. Each rank
applies the calling test's warning filters (a warning that is an error in the test, as
`conftest` makes every warning in tests/runtime, is one in its ranks too).
"""

from __future__ import annotations

import datetime
import re
import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails.

    `fn` must be importable by name (a module-level function) since processes are spawned.
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(
        _run_rank,
        args=(world_size, init_method, timeout_s, warning_filters(), fn, args),
        nprocs=world_size,
        join=True,
    )


def warning_filters() -> list[tuple[str, str, type[Warning], str, int]]:
    """This process's warning filters, first match first, as `warnings.filterwarnings`
    arguments (action, message pattern, category, module pattern, line)."""
    return [
        (action, _pattern(message), category, _pattern(module), line)
        for action, message, category, module, line in warnings.filters
    ]


def _pattern(pattern: re.Pattern | str | None) -> str:
    """A filter's message or module pattern as text ("" matches all); Python's own default
    filters hold plain strings."""
    if pattern is None or isinstance(pattern, str):
        return pattern or ""
    return pattern.pattern


def apply_warning_filters(filters: list[tuple[str, str, type[Warning], str, int]]) -> None:
    """Replace this process's warning filters with `filters` (from `warning_filters`)."""
    warnings.resetwarnings()
    for action, message, category, module, line in reversed(filters):
        warnings.filterwarnings(action, message, category, module, line)


def _run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float,
    filters: list[tuple[str, str, type[Warning], str, int]],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    import torch

    apply_warning_filters(filters)

    torch.set_num_threads(1)  # ranks share the test machine's cores
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
