"""Where the default `plan_search`'s time goes (issue 13): per cluster, the seconds inside each
of its stages, counted by wrapping the functions that do them.

Stages (inclusive: a full evaluation includes its simulations and programs):
- baselines: `all_baselines` (uniform grids, ring-only, Ulysses-only, per-type subsets);
- screen: the short list's estimates and bounds (`screen._estimate_s`, `screen._bound_s`),
  their probes' simulations included;
- full evaluations: `hierarchy.plan_for_choices` (the local stage and the plan's simulation),
  in the short list and in the polish;
- polish: the polish's own time, its full evaluations included;
- and across all of them: `simulate_step` calls and the HiGHS programs (`search._highs.solve`).

The clusters are `planner_scaling.py`'s (nodes of 8, types round-robin, Llama-3-8B at 1M
tokens). Each is searched once to warm up, then once under the wrappers (the wrappers add
about a microsecond a call) with every stage in this process (`HEXISEQ_SEARCH_HELPER=off`):
by default the search sends its baselines and half of its batches to its helper process
(`search.helper`), where the wrappers would not see them. The last column is one more search
of the cell as it runs by default (unwrapped, with its helper).

Run: `.venv/bin/python benchmarks/planner_breakdown.py [--cells 16x4 ...] [--no-write]`
(a cell `randomN`: plan_quality.py's random cluster #N of seed 2024, its model and length)
(prints the table and updates the "Planner time breakdown" section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone

from _results import replace_section
from planner_scaling import MODEL, build_cluster

import hexiseq.search._evaluate as evaluate_module
import hexiseq.search.api as api_module
import hexiseq.search.helper as helper
import hexiseq.search.local_milp as local_milp_module
import hexiseq.search.objective as objective_module
import hexiseq.search.optuna_layer as optuna_layer_module
import hexiseq.search.screen as screen_module
from hexiseq import plan_search

RUN = ".venv/bin/python benchmarks/planner_breakdown.py"
CELLS = ("16x4", "16x8", "64x8", "128x8", "1024x8")
SEQ_LEN = "1M"
STAGES = (
    ("baselines", api_module, "all_baselines"),
    ("screen estimates", screen_module, "_estimate_s"),
    ("screen bounds", screen_module, "_bound_s"),
    ("full evaluations", objective_module, "plan_for_choices"),
    ("polish", optuna_layer_module, "polish"),
    ("simulate_step", evaluate_module, "simulate_step"),
    ("HiGHS programs", local_milp_module, "solve"),
)


class Tally:
    """Seconds and calls per stage; a stage re-entered from inside itself counts once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.calls[label] += 1
            if self.depth[label]:
                return function(*args, **kwargs)
            self.depth[label] += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self.depth[label] -= 1

        return timed


def breakdown(cell: str) -> tuple[float, Tally, float]:
    """One warm search of `cell` ("GPUSxTYPES") under the wrappers, every stage in this
    process, and one as it runs by default: (total seconds, tally, default seconds)."""
    cluster, model, seq_len = _searched(cell)
    plan_search(cluster, model, seq_len)  # warm-up
    tally = Tally()
    originals = [(module, name, getattr(module, name)) for _, module, name in STAGES]
    for (label, module, name), (_, _, function) in zip(STAGES, originals):
        setattr(module, name, tally.wrap(label, function))
    setting = os.environ.get(helper.HELPER_VARIABLE)
    os.environ[helper.HELPER_VARIABLE] = "off"  # every stage in this process
    try:
        started = time.perf_counter()
        plan_search(cluster, model, seq_len)
        total_s = time.perf_counter() - started
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
        if setting is None:
            del os.environ[helper.HELPER_VARIABLE]
        else:
            os.environ[helper.HELPER_VARIABLE] = setting
    started = time.perf_counter()
    plan_search(cluster, model, seq_len)
    return total_s, tally, time.perf_counter() - started


def _searched(cell: str):
    """(cluster, model, length) of a cell: planner_scaling's GPUSxTYPES at SEQ_LEN, or
    plan_quality.py's random case `randomN`."""
    if cell.startswith("random"):
        from plan_quality import draw_cases

        case = draw_cases(20, 2024)[0][int(cell.removeprefix("random"))]
        return case.cluster, case.model, case.seq_len
    gpus, types = (int(part) for part in cell.split("x"))
    return build_cluster(gpus, types), MODEL, SEQ_LEN


def table(rows: list[tuple[str, float, Tally, float]]) -> str:
    labels = " | ".join(label for label, _, _ in STAGES)
    header = f"| cluster | total s | {labels} | default search s |"
    lines = [header, "|---|---:|" + "---:|" * (len(STAGES) + 1)]
    for cell, total_s, tally, default_s in rows:
        cells = [
            f"{tally.seconds[label]:.3f} ({100 * tally.seconds[label] / total_s:.0f} %, "
            f"{tally.calls[label]})"
            for label, _, _ in STAGES
        ]
        lines.append(f"| {cell} | {total_s:.3f} | " + " | ".join(cells) + f" | {default_s:.3f} |")
    return "\n".join(lines)


def section(body: str) -> str:
    command = " ".join(shlex.quote(arg) for arg in sys.argv[1:])
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "## Planner time breakdown",
            "",
            f"One warm default `plan_search` per cluster ({MODEL} at {SEQ_LEN} tokens, the "
            "planner-scaling clusters), seconds inside each stage (share of the search, calls). "
            "Stages nest: full evaluations hold their simulations and HiGHS programs, the "
            "polish holds its full evaluations, the screen its probes' simulations. Every "
            "stage runs in this process; the last column is the same search as it runs by "
            "default (the baselines and half of the batches in its helper process). "
            f"{platform.machine()}, Python {platform.python_version()}, 2 CPU cores; {when}.",
            "",
            body,
            "",
            f"Produced by `{f'{RUN} {command}'.strip()}`.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(CELLS), metavar="GPUSxTYPES")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for cell in args.cells:
        total_s, tally, default_s = breakdown(cell)
        rows.append((cell, total_s, tally, default_s))
        print(f"{cell}: {total_s:.3f} s (default search {default_s:.3f} s)", flush=True)
    body = table(rows)
    print(body)
    if not args.no_write:
        replace_section("planner_breakdown", section(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
