"""Held-out accuracy of the fitted cost model on the profiles in a store (docs/design.md §6).

Fits every ok profile measurement of the store exactly as `hexiseq fit` does (nothing is
saved), then reports per device type x op family: points, the extrapolation split (fit on
the smallest two thirds by FLOPs or bytes, predict the largest third), its mean and max
relative error, the leave-one-device-type-out error, and the spread of the measurements
themselves (median over points of (p90 - p10) / median), which bounds what any model of the
median can reach. Goals: extrapolation MAPE <= 5 % for compute ops, <= 10 % for links.

Run, into a fresh store, with the benchmark grid (its ladders reach past the CPU's caches, so
the training two thirds already hold out-of-cache sizes):

    .venv/bin/hexiseq profile --device cpu --grid benchmarks/grids/costmodel_cpu.yaml \
        --threads 1 --store sqlite:///bench.db
    .venv/bin/hexiseq profile links --nproc 2 --grid benchmarks/grids/costmodel_cpu.yaml \
        --store sqlite:///bench.db
    .venv/bin/python benchmarks/costmodel_accuracy.py --store sqlite:///bench.db \
        --profiled-by "<each profile command above>"

It prints the table and updates the "Cost-model accuracy" section of benchmarks/RESULTS.md
(`--no-write`: print only); `--profiled-by` (repeatable) records the profile commands there.
`--section NAME --title TEXT`: write another section instead, e.g. the shared real-GPU profile:

    cp ../shared/data/h100-profile.db /tmp/fit_h100.db
    .venv/bin/python benchmarks/costmodel_accuracy.py --store sqlite:////tmp/fit_h100.db \
        --section costmodel_accuracy_h100 --title "H100 (shared profile)"
`--repeat-store URL` (repeatable): stores of independent repeats of the same profile commands;
their extrapolation errors are listed beside the main store's, with the worst of all runs.
`--runs-store URL` (default: --store): where the `hexiseq run` runs are whose measured peaks
calibrate the memory model; the calibration's held-out error is a row of the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys

from _results import replace_section

from hexiseq.cli.fit import read_profile_sources, read_runtime_sources
from hexiseq.costmodel import (
    FittedDocument,
    ProfileSource,
    RuntimeSource,
    fit_cost_model,
    format_heldout_table,
)
from hexiseq.costmodel._gpu_features import GPU_OP_FEATURES
from hexiseq.costmodel._heldout_table import COMPUTE_GOAL_MAPE, LINK_GOAL_MAPE
from hexiseq.costmodel._memory_fit import memory_points
from hexiseq.errors import HexiseqError
from hexiseq.store import DEFAULT_STORE_URL, Store

SECTION = "costmodel_accuracy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=DEFAULT_STORE_URL, metavar="URL")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument(
        "--profiled-by",
        action="append",
        default=[],
        metavar="COMMAND",
        help="a command that profiled the store, recorded in RESULTS.md (repeatable)",
    )
    parser.add_argument(
        "--repeat-store",
        action="append",
        default=[],
        metavar="URL",
        help="a store of an independent repeat of the same profile (repeatable)",
    )
    parser.add_argument(
        "--runs-store",
        default=None,
        metavar="URL",
        help="the store of the `hexiseq run` runs that calibrate memory (default: --store)",
    )
    parser.add_argument(
        "--section",
        default=SECTION,
        metavar="NAME",
        help=f"the RESULTS.md section to write (default {SECTION})",
    )
    parser.add_argument(
        "--title",
        default=None,
        metavar="TEXT",
        help="what the section's heading names after 'Cost-model accuracy: ' (default: "
        "held-out error of the fitted model)",
    )
    args = parser.parse_args(argv)
    try:
        sources = _read_sources(args.store)
        repeats = [fit_cost_model(_read_sources(url)) for url in args.repeat_store]
        runs = _read_runs(args.runs_store or args.store)
    except HexiseqError as error:
        print(f"costmodel_accuracy: {error}", file=sys.stderr)
        return 2
    document = fit_cost_model(sources, runtime_runs=runs)
    spreads = timing_spreads(sources)
    print(format_heldout_table(document))
    rows = markdown_rows(document, spreads)
    repeat_lines = repeat_table([document, *repeats]) if repeats else []
    print("\n".join(["", *repeat_lines]))
    uncalibrated = uncalibrated_memory_errors(runs)
    print("\n" + reading(document, spreads, uncalibrated))
    if not args.no_write:
        text = section(document, sources, rows, spreads, argv, args.store, args.profiled_by,
                       repeat_lines, uncalibrated, title=args.title)  # fmt: skip
        replace_section(args.section, text)
    return 0


def _read_sources(url: str) -> list[ProfileSource]:
    with Store.open(url) as store:
        return read_profile_sources(store)


def uncalibrated_memory_errors(runs: list[RuntimeSource]) -> dict[str, float]:
    """Per device type: mean |modelled peak - measured| / measured of the memory model as
    written (its own reserve), over every measured rank."""
    errors: dict[str, list[float]] = {}
    for point in memory_points(runs):
        error = abs(point.modelled_bytes - point.measured_bytes) / point.measured_bytes
        errors.setdefault(point.device_type, []).append(error)
    return {device: statistics.fmean(values) for device, values in errors.items()}


def _read_runs(url: str) -> list[RuntimeSource]:
    with Store.open(url) as store:
        return read_runtime_sources(store)


def repeat_table(documents: list[FittedDocument]) -> list[str]:
    """Markdown: each 1x compute and link family's extrapolation MAPE in every run (the main
    store first), and the worst of them against the goal."""
    runs: dict[tuple, list[float | None]] = {}
    goals: dict[tuple, float] = {}
    for index, document in enumerate(documents):
        fits = [f for f in document.ops if f.emulation_slowdown == 1.0]
        for fit in [*fits, *document.links]:
            name = (getattr(fit, "link_class", None) or f"{fit.device_type} ({fit.dtype})", fit.op)
            goals[name] = LINK_GOAL_MAPE if hasattr(fit, "link_class") else COMPUTE_GOAL_MAPE
            runs.setdefault(name, [None] * len(documents))[index] = fit.heldout.extrapolation_mape
    headers = ["device / link", "op", *(f"run {i + 1}" for i in range(len(documents))), "worst"]
    lines = ["Repeats (run 1: the store above; each run an independent profile with the same "
             "commands), extrapolation MAPE:", "", "| " + " | ".join(headers) + " |",
             "|---|---|" + "---:|" * (len(documents) + 1)]  # fmt: skip
    for (device, op), mapes in runs.items():
        known = [m for m in mapes if m is not None]
        worst = max(known) if len(known) == len(mapes) else None
        met = "met" if worst is not None and worst <= goals[device, op] else "**missed**"
        cells = [device, op, *(_pct(m) for m in mapes), f"{_pct(worst)} ({met})"]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def timing_spreads(sources: list[ProfileSource]) -> dict[tuple, float]:
    """Median (p90 - p10) / median per family, keyed like the fits."""
    spreads: dict[tuple, list[float]] = {}
    for source in sources:
        for m in source.measurements:
            if m.status == "ok" and m.median_s:
                key = _key(m.device_type, m.op, m.dtype, m.emulation_slowdown, m.link_class)
                spreads.setdefault(key, []).append((m.p90_s - m.p10_s) / m.median_s)
    return {key: statistics.median(values) for key, values in spreads.items()}


def _key(device_type, op, dtype, slowdown, link_class) -> tuple:
    if link_class is not None:
        return (link_class, op)
    return (device_type, op, dtype, float(slowdown))


def markdown_rows(document: FittedDocument, spreads: dict[tuple, float]) -> list[str]:
    rows = []
    for fit in document.ops:
        spread = spreads.get(
            _key(fit.device_type, fit.op, fit.dtype, fit.emulation_slowdown, None)
        )
        name = f"{fit.device_type} ({fit.dtype}, {fit.emulation_slowdown:g}x)"
        rows.append(_row(name, fit.op, fit.points, fit.heldout, spread, COMPUTE_GOAL_MAPE))
    for fit in document.links:
        spread = spreads.get((fit.link_class, fit.op))
        knee = f", knee at {fit.regimes[-1].from_bytes:,.0f} B" if len(fit.regimes) > 1 else ""
        rows.append(_row(fit.link_class, fit.op + knee, fit.points, fit.heldout, spread,
                         LINK_GOAL_MAPE))  # fmt: skip
    for fit in document.memory:
        what = (f"memory peak ({fit.memory_measure}): {fit.reserve_bytes / 2**20:,.0f} MiB + "
                f"{fit.scale:.2f} x model")  # fmt: skip
        rows.append(_row(fit.device_type, what, fit.points, fit.heldout, None, None))
    return rows


def _row(name, op, points, heldout, spread, goal) -> str:
    mape = heldout.extrapolation_mape
    met = "met" if mape is not None and goal is not None and mape <= goal else "**missed**"
    if heldout.lodo:
        worst = max(heldout.lodo, key=lambda e: e.mape)
        lodo = f"{_pct(worst.mape)} (from {worst.reference})"
    else:
        lodo = heldout.lodo_note
    verdict = f"≤ {100 * goal:g} %: {met}" if goal is not None else "none set"
    cells = [name, op, str(points), f"{heldout.train_points}/{heldout.test_points}", _pct(mape),
             _pct(heldout.extrapolation_max_error), _signed_pct(heldout.extrapolation_bias), lodo,
             _pct(spread), verdict]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


def _signed_pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:+.1f} %"


def reading(
    document: FittedDocument, spreads: dict[tuple, float], uncalibrated: dict[str, float]
) -> str:
    """Counts of goals met, the memory calibration, and how noisy the measurements were."""
    compute = [f for f in document.ops if f.emulation_slowdown == 1.0]
    met = [f for f in compute if f.heldout.extrapolation_mape <= COMPUTE_GOAL_MAPE]
    links_met = [f for f in document.links if f.heldout.extrapolation_mape <= LINK_GOAL_MAPE]
    noisy = [key for key, spread in spreads.items() if spread > 2 * COMPUTE_GOAL_MAPE]
    fits = [*compute, *document.links]
    slower = [f for f in fits if f.heldout.extrapolation_bias < -COMPUTE_GOAL_MAPE]
    text = (
        f"{len(met)} of {len(compute)} compute fits (1x) meet the 5 % extrapolation goal; "
        f"{len(links_met)} of {len(document.links)} link fits meet the 10 % goal."
    )
    for fit in document.memory:
        text += (
            f" The memory model calibrated by {fit.points} measured {fit.device_type} peaks "
            f"({len(fit.source_runs)} runs of `hexiseq run`) predicts the largest third of "
            f"them within {_pct(fit.heldout.extrapolation_mape)} on average (the uncalibrated "
            f"model's peaks are off by {_pct(uncalibrated.get(fit.device_type))} on all of "
            "them)."
        )
    if slower:
        names = ", ".join(f"{getattr(f, 'link_class', f.device_type)} {f.op}" for f in slower)
        text += (
            f" In {len(slower)} of {len(fits)} fits ({names}) the largest third is "
            "systematically slower than the fit on the smaller sizes predicts (bias below "
            "-5 %): the cost per FLOP or per byte grows beyond the training sizes (on a CPU, "
            "working sets that leave the caches: the fit's cache terms see that only where "
            "the training sizes already reach beyond a cache)."
        )
    if compute and not any(f.heldout.lodo for f in compute):
        text += (
            " Leave-one-device-type-out: n/a, one device type profiled (on GPU data a CPU "
            "would be no peer either: its achieved share of its peak says nothing of a GPU's)."
        )
    if noisy:
        text += (
            f" In {len(noisy)} of {len(spreads)} families the measurements' own p10-p90 "
            "spread exceeds 10 % of the median: the timing noise of those points, not the "
            "model, then dominates the held-out error."
        )
    return text


def _emulation_lines(document: FittedDocument) -> list[str]:
    """The emulated fits' time ratio to the 1x fit (the emulation's own check)."""
    lines = [
        f"- emulation check, {f.device_type} {f.op} {f.emulation_slowdown:g}x: predicted time "
        f"ratio to the 1x fit {f.emulation_check.time_ratio:.2f} (expected "
        f"{f.emulation_check.expected_ratio:g})"
        for f in document.ops
        if f.emulation_check is not None
    ]
    return [*lines, ""] if lines else []


def _hardware_lines(document: FittedDocument, sources: list[ProfileSource]) -> list[str]:
    """The cache capacities each 1x fit used (hardware's, or effective ones the fit found)
    and the attention kernel whose tiles the masked FLOPs and K/V reads follow."""
    hardware = {
        (m.extra.get("l2_bytes"), m.extra.get("llc_bytes"))
        for s in sources
        for m in s.measurements
        if "llc_bytes" in m.extra
    }
    lines = []
    for fit in document.ops:
        if fit.emulation_slowdown != 1.0 or (fit.cache_bytes is None and not fit.attention_kernel):
            continue
        what = f"kernel {fit.attention_kernel}" if fit.attention_kernel else ""
        if fit.sm_count is not None:
            tiles = "cuDNN's grid" if fit.attention_kernel == "cudnn" else "FlashAttention-2 tiles"
            what += f", {tiles} scheduled over {fit.sm_count} SMs"
        gpu = fit.features == GPU_OP_FEATURES.get(fit.op)
        if gpu and fit.op == "elementwise":
            what = f"bytes beyond a fitted knee of {fit.cache_bytes[0] / 1024**2:.3g} MiB"
        elif gpu and fit.op == "gemm":
            what = f"bytes beyond the roofline ridge {fit.ridge_flops_per_byte:.0f} FLOP/byte"
        elif fit.cache_bytes is not None and fit.op in ("gemm", "elementwise"):
            l2, llc = (f"{value / 1024**2:.3g} MiB" for value in fit.cache_bytes)
            what = f"cache terms at L2 {l2}, last level {llc}"
        lines.append(f"- {fit.device_type} {fit.op}: {what}")
    if not lines:
        return []
    sizes = "; ".join(
        f"L2 {a / 1024**2:g} MiB, last level {b / 1024**2:g} MiB" for a, b in hardware
    )
    return [f"Hardware terms (caches read by the profiler: {sizes or 'none recorded'}):", "",
            *lines, ""]  # fmt: skip


def _describe_run(source: ProfileSource) -> str:
    """ "3 (2026-11-22 05:52, grid quick, 1 thread(s), links, emulated 2x)"."""
    extras = [m.extra for m in source.measurements]
    parts = [(source.created_at or "?")[:16].replace("T", " ")]
    grids = sorted({str(e.get("grid")) for e in extras if "grid" in e})
    threads = sorted({str(e.get("threads")) for e in extras if "threads" in e})
    parts += [f"grid {', '.join(grids)}"] if grids else []
    parts += [f"{', '.join(threads)} thread(s)"] if threads else []
    if any(m.link_class for m in source.measurements):
        parts.append("links")
    slowdowns = sorted({m.emulation_slowdown for m in source.measurements} - {1.0})
    parts += [f"emulated {', '.join(f'{k:g}x' for k in slowdowns)}"] if slowdowns else []
    return f"{source.run_id} ({', '.join(parts)})"


def _profile_command_lines(commands) -> list[str]:
    if not commands:
        return []
    return ["", "Profiled with:", "", *(f"- `{command}`" for command in commands)]


def section(
    document,
    sources,
    rows,
    spreads,
    argv,
    store_url,
    profiled_by=(),
    repeat_lines=(),
    uncalibrated=None,
    *,
    title=None,
) -> str:
    command = shlex.join([".venv/bin/python", "benchmarks/costmodel_accuracy.py", *(argv or [])])
    machine = (
        f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"
    )
    devices = sorted({m.device_name for s in sources for m in s.measurements})
    runs = "; ".join(_describe_run(source) for source in sources)
    headers = ["device (dtype, emulation)", "op", "points", "train/test", "extrap. MAPE",
               "max err", "bias", "LODO MAPE", "p10-p90 spread", "goal"]  # fmt: skip
    return "\n".join(
        [
            f"## Cost-model accuracy: {title or 'held-out error of the fitted model'}",
            "",
            "Extrapolation: fit on the smallest two thirds of each family's points by size "
            "(FLOPs, or bytes for elementwise ops and links), predict the largest third. "
            "LODO: a device type's points predicted from another profiled type's fit scaled "
            "by datasheet ratios of peak x efficiency. Bias: mean signed error of the "
            "extrapolation (negative: the largest sizes are slower than predicted). Spread: "
            "median over the family's points of (p90 - p10) / median of the timing samples.",
            "",
            "| " + " | ".join(headers) + " |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
            *rows,
            "",
            *repeat_lines,
            *_emulation_lines(document),
            *_hardware_lines(document, sources),
            f"Profile runs {runs}, on {', '.join(devices)}; store `{store_url}`. "
            f"Produced by `{command}` on {machine}.",
            *_profile_command_lines(profiled_by),
            "",
            "**Reading.** " + reading(document, spreads, uncalibrated or {}),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
