"""Where a training step's device time goes, read from a torch.profiler Chrome trace.

A trace comes from `hexiseq.runtime.train --torch-profile STEP.json.gz` or from
`benchmarks/runtime_gpu.py --trace-dir DIR` (both sides: hexiseq and the transformers
reference). For each trace this prints:

- the step's device window (first kernel start to last kernel end), the time some kernel,
  copy or memset ran (busy: the union of their intervals) and the rest (idle);
- busy time by kernel family (GEMM, attention, optimizer, copies and memsets, collectives, the
  other elementwise and reduction kernels) with kernel counts;
- idle time by the host operator that launched the kernel after each gap (the innermost
  `cpu_op` around its launch call), which names what the device was waiting for: the host
  issuing small kernels, a synchronization, an allocation;
- host synchronizations (cudaStreamSynchronize, cudaDeviceSynchronize, blocking copies) and
  their host time.

    .venv/bin/python benchmarks/step_trace.py TRACE.json.gz [MORE...] [--top 12] [--json OUT]

Nothing here needs a GPU: it reads files.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
FAMILIES = (  # first match wins; names as CUDA libraries and ATen spell their kernels
    ("attention", re.compile(r"sdpa|fmha|flash|attention|cudnn_generated", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|cublas|s16816|s1688", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("collective", re.compile(r"nccl", re.I)),
    ("copy/memset", re.compile(r"^Memcpy|^Memset|copy_kernel|CatArray", re.I)),
    ("reduction", re.compile(r"reduce_kernel|softmax|norm", re.I)),
)
SYNC_CALLS = re.compile(r"Synchronize|^cudaMemcpy$|cudaMemcpy2D$|cudaStreamWaitEvent", re.I)


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if pattern.search(name):
            return label
    return "elementwise/other"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


class _HostOps:
    """The host operators of each thread, to find the innermost one around a timestamp."""

    def __init__(self, events: list[dict]) -> None:
        by_thread: dict[object, list[dict]] = defaultdict(list)
        for event in events:
            if event.get("cat") == "cpu_op":
                by_thread[event.get("tid")].append(event)
        self._ops = {tid: sorted(ops, key=lambda e: e["ts"]) for tid, ops in by_thread.items()}
        self._starts = {tid: [e["ts"] for e in ops] for tid, ops in self._ops.items()}

    def around(self, tid: object, ts: float) -> tuple[str, str]:
        """(innermost, outermost) operator names running on `tid` at `ts`."""
        ops, starts = self._ops.get(tid, []), self._starts.get(tid, [])
        containing = [
            e for e in ops[: bisect.bisect_right(starts, ts)] if e["ts"] + e["dur"] >= ts
        ]
        if not containing:
            return "(no operator)", "(no operator)"
        innermost = max(containing, key=lambda e: e["ts"])
        outermost = min(containing, key=lambda e: e["ts"])
        return innermost["name"], outermost["name"]


def analyse(events: list[dict], gap_floor_us: float = 0.0) -> dict:
    """The figures above for one step's events (times in ms)."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise SystemExit("step_trace: error: the trace has no device events (a CPU trace?)")
    intervals = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    window_us = intervals[-1][1] - intervals[0][0]
    busy_us = sum(b - a for a, b in intervals)
    families: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in device:
        entry = families[family(event["name"])]
        entry[0] += event["dur"] / 1e3
        entry[1] += 1
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    host = _HostOps(events)
    first_after: dict[float, dict] = {}
    for event in sorted(device, key=lambda e: e["ts"]):
        first_after.setdefault(event["ts"], event)
    starts = sorted(first_after)
    gaps_by_op: Counter = Counter()
    gaps_by_outer: Counter = Counter()
    for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
        gap = start - end
        if gap <= gap_floor_us:
            continue
        kernel = first_after[starts[bisect.bisect_left(starts, start)]]
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        inner, outer = (
            host.around(launch.get("tid"), launch["ts"]) if launch else ("(unknown)",) * 2
        )
        gaps_by_op[inner] += gap / 1e3
        gaps_by_outer[outer] += gap / 1e3
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and SYNC_CALLS.search(e["name"])]
    top_level_ops = _top_level_count(events)
    return {
        "window_ms": window_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": (window_us - busy_us) / 1e3,
        "device_events": len(device),
        "host_operators": top_level_ops,
        "families": {k: {"ms": v[0], "count": v[1]} for k, v in families.items()},
        "idle_by_operator": dict(gaps_by_op.most_common()),
        "idle_by_outer_operator": dict(gaps_by_outer.most_common()),
        "syncs": {"count": len(syncs), "host_ms": sum(e["dur"] for e in syncs) / 1e3},
    }


def _top_level_count(events: list[dict]) -> int:
    """Host operators not inside another one (what a step dispatches from Python)."""
    count, open_until = 0, defaultdict(float)
    for event in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"]):
        tid = event.get("tid")
        if event["ts"] >= open_until[tid]:
            count += 1
            open_until[tid] = event["ts"] + event["dur"]
    return count


def render(name: str, figures: dict, top: int) -> str:
    window = figures["window_ms"]
    lines = [
        f"### {name}",
        "",
        f"Device window {window:.1f} ms: busy {figures['busy_ms']:.1f} ms "
        f"({figures['busy_ms'] / window:.0%}), idle {figures['idle_ms']:.1f} ms; "
        f"{figures['device_events']} kernels, copies and memsets; "
        f"{figures['host_operators']} top-level host operators; "
        f"{figures['syncs']['count']} host synchronizations "
        f"({figures['syncs']['host_ms']:.1f} ms of host time).",
        "",
        "| kernel family | busy ms | count |",
        "|---|---:|---:|",
    ]
    ordered = sorted(figures["families"].items(), key=lambda item: -item[1]["ms"])
    lines += [f"| {k} | {v['ms']:.1f} | {v['count']} |" for k, v in ordered]
    lines += ["", "| idle before a kernel launched by | ms |", "|---|---:|"]
    idle = list(figures["idle_by_operator"].items())[:top]
    lines += [f"| `{k}` | {v:.1f} |" for k, v in idle]
    lines += ["", "| idle, by the outermost host operator | ms |", "|---|---:|"]
    idle = list(figures["idle_by_outer_operator"].items())[:top]
    lines += [f"| `{k}` | {v:.1f} |" for k, v in idle]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, nargs="+", help="Chrome traces (.json, .json.gz)")
    parser.add_argument("--top", type=int, default=12, help="idle rows shown per table")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    everything = {}
    for path in args.traces:
        if not path.is_file():
            parser.error(f"no trace file {path}")
        figures = analyse(load(path))
        everything[path.name] = figures
        print(render(path.name, figures, args.top))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
