"""`hexiseq.runtime.train --torch-profile PATH`: one step under torch.profiler, as a table.

The table lists the step's operators by self device time (self CPU time on a CPU rank), the
figures the cost model's terms are checked against (matmuls, attention kernels, AdamW,
elementwise, copies). Rank 0 writes PATH; rank r > 0 writes PATH.rank<r>. The profiled step is
measured and recorded like any other, with the profiler's overhead in its time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROW_LIMIT = 60


def profile_path(path: str, rank: int) -> Path:
    return Path(path if rank == 0 else f"{path}.rank{rank}")


@contextmanager
def profiled_step(path: str | None, rank: int, device: torch.device) -> Iterator[None]:
    """Run the block under torch.profiler when `path` is given and write its table there."""
    if path is None:
        yield
        return
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        yield
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=ROW_LIMIT)
    profile_path(path, rank).write_text(table + "\n")
