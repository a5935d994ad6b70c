"""`hexiseq.runtime.train --torch-profile PATH`: one step under torch.profiler, as a table, or as
a Chrome trace when PATH ends in `.json` or `.json.gz` (every operator and kernel on its
timeline: `benchmarks/step_trace.py` reads the device's busy and idle time from it).

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
TRACE_SUFFIXES = (".json", ".json.gz")


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
    target = profile_path(path, rank)
    if target.name.endswith(TRACE_SUFFIXES):
        profiler.export_chrome_trace(str(target))  # gzipped by torch for a .gz name
        return
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=ROW_LIMIT)
    target.write_text(table + "\n")
