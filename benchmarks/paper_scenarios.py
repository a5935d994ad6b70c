"""The HexiSeq paper's settings: hexiseq against the best feasible homogeneous-style baseline.

Scenarios (every plan from `plan_search(..., n_trials=40, seed=0)`, the baselines uniform-usp,
ring-only and ulysses-only scored by the same simulator):
- the paper's testbed: 8x H100 + 8x A100, LLaMA-30B, 512K tokens (preset h100x8-a100x8);
- 32 GPUs of 4 types, Llama-3-70B at 1M tokens (mix4-32-large), and mix4-32 at the longest
  length where some plan fits;
- 3B-70B models on 128 GPUs of 2 and 4 types (mix2-128, mix4-128) at 128K, 512K and 1M tokens;
- FLOP-matched pairs: a mixed cluster (hexiseq plan) against a homogeneous one of about equal
  total dense BF16 FLOP/s (its best baseline plan), throughput normalized by FLOPs.

Every number is a prediction of the datasheet cost model (datasheet estimate), not a
measurement. Run: `.venv/bin/python benchmarks/paper_scenarios.py [--no-write]` (prints the
tables and updates the "Paper scenarios" section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

from _results import cpu_seconds, replace_section

from hexiseq import (
    Cluster,
    InfeasibleError,
    ModelSpec,
    Plan,
    TrainSpec,
    gpu_spec,
    parse_seq_len,
    plan_search,
)
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.flops import causal_pairs, head_flops_per_token, linear_flops_per_token
from hexiseq.search import all_baselines
from hexiseq.search._evaluate import Problem

TRIALS, SEED = 40, 0
PAPER_AVERAGE_SPEEDUP = 1.36  # HexiSeq paper: average speedup over the baselines
FLOP_MATCH_TOLERANCE = 0.03  # pairs' total FLOP/s agree within 3 %; goal for the normalized ratio
MODELS_128 = ("llama3.2-3b", "llama3-8b", "llama2-13b", "llama-30b", "llama3-70b")
SEQ_LENS_128 = ("128K", "512K", "1M")
LONGEST_TRIED = ("1M", "896K", "768K", "640K", "512K", "384K", "256K", "128K")
PAIR_LENGTHS = ("1M", "512K", "256K", "128K")
# (mixed preset, homogeneous preset of about equal dense BF16 FLOP/s, model)
FLOP_PAIRS = (
    ("h100x4-a100x12", "h100x8", "llama3-8b"),
    ("a100x16-l40sx8", "h100x8", "llama3-8b"),
    ("h100x8-a100x24", "h100x16", "llama-30b"),
    ("mix4-32-large", "b200x16", "llama3-70b"),
)


@dataclass(frozen=True)
class Baseline:
    name: str
    tokens_per_s: float


@dataclass(frozen=True)
class Row:
    """One scenario: hexiseq's best plan and the best feasible baselines (None: all OOM)."""

    group: str
    cluster: str
    gpus: int
    model: str
    seq_len: str
    tokens_per_s: float | None  # None: no plan fits at all
    plan_name: str
    checkpointing: bool | None
    max_memory: float | None
    baseline: Baseline | None
    own_tokens_per_s: float | None = None  # hexiseq's best own (hierarchical) plan
    replicas_tokens_per_s: float | None = None  # every type its own data-parallel replica

    @property
    def own_shortfall(self) -> float:
        """How much slower hexiseq's own best plan is than the returned best plan."""
        return 1 - (self.own_tokens_per_s or 0.0) / (self.tokens_per_s or 1.0)

    @property
    def replicas_speedup(self) -> float | None:
        if self.tokens_per_s is None or self.replicas_tokens_per_s is None:
            return None
        return self.tokens_per_s / self.replicas_tokens_per_s

    @property
    def speedup(self) -> float | None:
        if self.tokens_per_s is None or self.baseline is None:
            return None
        return self.tokens_per_s / self.baseline.tokens_per_s


def best_baseline(baselines: dict) -> Baseline | None:
    """Name (with its grid; 'no ckpt' without activation checkpointing) and tokens/s of the
    fastest feasible baseline."""
    feasible = [plan for plan in baselines.values() if isinstance(plan, Plan)]
    if not feasible:
        return None
    best = max(feasible, key=lambda plan: plan.predicted.tokens_per_s)
    suffix = "" if best.train.activation_checkpointing else ", no ckpt"
    return Baseline(best.name + suffix, best.predicted.tokens_per_s)


def baselines_of(cluster: str, model: str, seq_len: str) -> dict:
    """The baselines `plan_search` scores (activation checkpointing on or off)."""
    train = TrainSpec(seq_len=parse_seq_len(seq_len))
    spec = ModelSpec.preset(model)
    return all_baselines(Problem(Cluster.load(cluster), spec, train, DatasheetCostModel()))


def run_scenario(group: str, cluster: str, model: str, seq_len: str) -> Row:
    gpus = Cluster.load(cluster).world_size
    try:
        result = plan_search(cluster, model, seq_len, n_trials=TRIALS, seed=SEED)
    except InfeasibleError:
        baseline = best_baseline(baselines_of(cluster, model, seq_len))
        return Row(group, cluster, gpus, model, seq_len, None, "", None, None, baseline)
    best = result.best
    return Row(
        group,
        cluster,
        gpus,
        model,
        seq_len,
        best.predicted.tokens_per_s,
        best.name,
        best.train.activation_checkpointing,
        best.predicted.max_memory_fraction,
        best_baseline(result.baselines),
        max((t.tokens_per_s for t in result.trials if _own(t)), default=None),
        result.data_parallel.tokens_per_s if result.data_parallel else None,
    )


def _own(trial) -> bool:
    return trial.name == "hexiseq" and trial.tokens_per_s is not None


def longest_fitting(cluster: str, model: str) -> str | None:
    """The longest of `LONGEST_TRIED` at which the default search finds a plan."""
    for seq_len in LONGEST_TRIED:
        try:
            plan_search(cluster, model, seq_len)
        except InfeasibleError:
            continue
        return seq_len
    return None


def scenario_rows() -> list[Row]:
    rows = [run_scenario("paper testbed", "h100x8-a100x8", "llama-30b", "512K")]
    rows.append(run_scenario("32 GPUs, 4 types", "mix4-32-large", "llama3-70b", "1M"))
    longest = longest_fitting("mix4-32", "llama3-70b")
    rows.append(run_scenario("32 GPUs, 4 types", "mix4-32", "llama3-70b", longest or "128K"))
    for cluster in ("mix2-128", "mix4-128"):
        for model in MODELS_128:
            for seq_len in SEQ_LENS_128:
                rows.append(run_scenario("128 GPUs", cluster, model, seq_len))
    return rows


# --- FLOP-matched pairs ----------------------------------------------------------------------


@dataclass(frozen=True)
class PairRow:
    mixed: str
    homogeneous_name: str
    model: str
    seq_len: str
    mixed_tflops: float
    homogeneous_tflops: float
    mixed_capacity: float  # ideal tokens/s: every GPU busy on compute alone (cost model)
    homogeneous_capacity: float
    mixed_tokens_per_s: float | None  # hexiseq's plan on the mixed cluster
    homogeneous: Baseline | None  # best baseline on the homogeneous cluster
    homogeneous_hexiseq_tokens_per_s: float | None

    def normalized(self, mixed_measure: float, homogeneous_measure: float) -> float | None:
        if self.mixed_tokens_per_s is None or self.homogeneous is None:
            return None
        throughput = self.mixed_tokens_per_s / self.homogeneous.tokens_per_s
        return throughput / (mixed_measure / homogeneous_measure)

    @property
    def by_flops(self) -> float | None:
        return self.normalized(self.mixed_tflops, self.homogeneous_tflops)

    @property
    def by_capacity(self) -> float | None:
        return self.normalized(self.mixed_capacity, self.homogeneous_capacity)


def total_tflops(cluster: str) -> float:
    """Dense BF16 datasheet TFLOP/s of all GPUs of the cluster."""
    return sum(gpu_spec(d.gpu).dense_bf16_tflops for d in Cluster.load(cluster).devices)


def compute_capacity(cluster: str, model: str, seq_len: str) -> float:
    """Tokens/s if every GPU ran its share of a step's compute (linear, LM head, attention
    forward, recompute and backward, checkpointing on) at the cost model's rate with no
    communication, memory-bound ops or imbalance: the achievable-FLOP/s yardstick."""
    spec, tokens = ModelSpec.preset(model), parse_seq_len(seq_len)
    cost = DatasheetCostModel()
    linear = spec.layers * linear_flops_per_token(spec) * tokens
    head = head_flops_per_token(spec) * tokens
    pairs = spec.layers * causal_pairs(tokens)
    steps_per_s = 0.0
    for device in Cluster.load(cluster).devices:
        seconds = cost.gemm_time_s(device.gpu, 4 * linear + 3 * head)
        seconds += 2 * cost.attention_time_s(
            device.gpu, pairs, spec.heads, spec.head_dim, backward=False
        )
        seconds += cost.attention_time_s(
            device.gpu, pairs, spec.heads, spec.head_dim, backward=True
        )
        steps_per_s += 1.0 / seconds
    return steps_per_s * tokens


def longest_with_baseline(cluster: str, model: str) -> str:
    """The longest of `PAIR_LENGTHS` at which some baseline fits on `cluster`."""
    for seq_len in PAIR_LENGTHS:
        if best_baseline(baselines_of(cluster, model, seq_len)):
            return seq_len
    return PAIR_LENGTHS[-1]


def run_pair(mixed: str, homogeneous: str, model: str) -> PairRow:
    seq_len = longest_with_baseline(homogeneous, model)
    mixed_row = run_scenario("pair", mixed, model, seq_len)
    homogeneous_row = run_scenario("pair", homogeneous, model, seq_len)
    return PairRow(
        mixed,
        homogeneous,
        model,
        seq_len,
        total_tflops(mixed),
        total_tflops(homogeneous),
        compute_capacity(mixed, model, seq_len),
        compute_capacity(homogeneous, model, seq_len),
        mixed_row.tokens_per_s,
        homogeneous_row.baseline,
        homogeneous_row.tokens_per_s,
    )


# --- report ----------------------------------------------------------------------------------


def _number(value: float | None, fmt: str = ",.0f") -> str:
    return "—" if value is None else format(value, fmt)


def _baseline(baseline: Baseline | None, fits: bool) -> tuple[str, str]:
    if baseline is None:
        return ("all OOM" if fits else "—"), "—"
    return baseline.name, _number(baseline.tokens_per_s)


def _speedup(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def scenario_table(rows: list[Row]) -> str:
    lines = [
        "| scenario | cluster | GPUs | model | tokens | hexiseq tok/s | ckpt | best baseline "
        "| tok/s | speedup | DP replicas tok/s | vs DP replicas | hexiseq max mem |",
        "|---|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        best = f" ({r.plan_name})" if r.plan_name not in ("hexiseq", "") else ""
        name, tokens = _baseline(r.baseline, r.tokens_per_s is not None)
        checkpointing = "—" if r.checkpointing is None else ("on" if r.checkpointing else "off")
        memory = "—" if r.max_memory is None else f"{100 * r.max_memory:.1f} %"
        lines.append(
            f"| {r.group} | {r.cluster} | {r.gpus} | {r.model} | {r.seq_len} | "
            f"{_number(r.tokens_per_s)}{best} | {checkpointing} | {name} | {tokens} | "
            f"{_speedup(r.speedup)} | {_number(r.replicas_tokens_per_s)} | "
            f"{_speedup(r.replicas_speedup)} | {memory} |"
        )
    return "\n".join(lines)


def pair_table(pairs: list[PairRow]) -> str:
    lines = [
        "| mixed | TFLOP/s | hexiseq tok/s | homogeneous | TFLOP/s | best baseline | tok/s "
        "| (hexiseq there) | model @ tokens | FLOP ratio | tok/s ratio / FLOP ratio "
        "| capacity ratio | tok/s ratio / capacity ratio |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for p in pairs:
        name, tokens = _baseline(p.homogeneous, True)
        lines.append(
            f"| {p.mixed} | {p.mixed_tflops:,.0f} | {_number(p.mixed_tokens_per_s)} | "
            f"{p.homogeneous_name} | {p.homogeneous_tflops:,.0f} | {name} | {tokens} | "
            f"{_number(p.homogeneous_hexiseq_tokens_per_s)} | {p.model} @ {p.seq_len} | "
            f"{p.mixed_tflops / p.homogeneous_tflops:.3f} | {_number(p.by_flops, '.3f')} | "
            f"{p.mixed_capacity / p.homogeneous_capacity:.3f} | "
            f"{_number(p.by_capacity, '.3f')} |"
        )
    return "\n".join(lines)


def speedup_line(rows: list[Row]) -> str:
    compared = [r for r in rows if r.speedup is not None]
    speedups = [r.speedup for r in compared]
    best = max(compared, key=lambda r: r.speedup)
    mean = statistics.mean(speedups)
    return (
        f"speedup over the best feasible baseline in {len(compared)} multi-type scenarios: "
        f"average {mean:.2f}x (geometric {statistics.geometric_mean(speedups):.2f}x), min "
        f"{min(speedups):.2f}x, max {max(speedups):.2f}x ({best.cluster}, {best.model} @ "
        f"{best.seq_len}); goal >= {PAPER_AVERAGE_SPEEDUP}x average: "
        f"{'met' if mean >= PAPER_AVERAGE_SPEEDUP else 'NOT met'}"
    )


def replicas_line(rows: list[Row]) -> str:
    """hexiseq against every GPU type as its own data-parallel replica, where each type holds
    a sequence alone (a baseline hexiseq cannot run yet)."""
    compared = [r for r in rows if r.replicas_speedup is not None]
    if not compared:
        return "data-parallel replicas: no scenario where two types each hold a sequence"
    ratios = [r.replicas_speedup for r in compared]
    beaten = sum(1 for v in ratios if v < 1.0)
    return (
        f"against data-parallel replicas per GPU type ({len(compared)} scenarios where every "
        f"fitting type holds a sequence alone): average {statistics.mean(ratios):.2f}x, min "
        f"{min(ratios):.2f}x, max {max(ratios):.2f}x; the replicas are faster in {beaten}"
    )


def summary(rows: list[Row], pairs: list[PairRow]) -> list[str]:
    all_oom = [r for r in rows if r.tokens_per_s is not None and r.baseline is None]
    none_fits = [r for r in rows if r.tokens_per_s is None]
    lines = [
        speedup_line(rows),
        replicas_line(rows),
        f"every baseline OOM while hexiseq fits ({len(all_oom)}, not in the averages): "
        + (", ".join(f"{r.cluster} {r.model} @ {r.seq_len}" for r in all_oom) or "none"),
        "no plan fits at all: "
        + (", ".join(f"{r.cluster} {r.model} @ {r.seq_len}" for r in none_fits) or "none"),
    ]
    for label, attr in (("peak FLOP/s", "by_flops"), ("compute capacity", "by_capacity")):
        values = [getattr(p, attr) for p in pairs if getattr(p, attr) is not None]
        within = sum(abs(v - 1) <= FLOP_MATCH_TOLERANCE for v in values)
        lines.append(
            f"FLOP-matched pairs, throughput ratio normalized by {label}: within 3 % of 1 in "
            f"{within}/{len(values)} (range {min(values):.3f}-{max(values):.3f})"
        )
    return lines


def update_results(section_body: str) -> None:
    """Replace this benchmark's section of RESULTS.md."""
    replace_section("paper_scenarios", section_body)


def _why_the_baseline_won(row) -> str:
    """What the search's own (hierarchical) plans did where the baseline's split won."""
    where = f"{row.cluster} {row.model}"
    if row.own_tokens_per_s:
        return f"{where}: its own best plan {100 * row.own_shortfall:.1f} % slower"
    return f"{where}: none of its own plans fits in 95 % of memory"


def reading(rows: list[Row], pairs: list[PairRow]) -> str:
    speedups = [r.speedup for r in rows if r.speedup is not None]
    long_context = [r.speedup for r in rows if r.seq_len != "128K" and r.speedup]
    short_context = [r.speedup for r in rows if r.seq_len == "128K" and r.speedup]
    baseline_won = [r for r in rows if r.plan_name not in ("hexiseq", "")]
    by_flops = [p.by_flops for p in pairs if p.by_flops is not None]
    by_capacity = [p.by_capacity for p in pairs if p.by_capacity is not None]

    def met(values: list[float]) -> str:
        ok = all(abs(v - 1) <= FLOP_MATCH_TOLERANCE for v in values)
        return f"{'met' if ok else 'NOT met'} ({min(values):.3f}-{max(values):.3f})"

    mean = statistics.mean(speedups)
    won_text = (
        f"; in {len(baseline_won)} of them ("
        + "; ".join(_why_the_baseline_won(r) for r in baseline_won)
        + ") plan_search returns the baseline's even split: it is the fastest plan that fits"
        if baseline_won
        else ""
    )
    return (
        f"Against the best feasible baseline (checkpointing on or off for both), hexiseq "
        f"averages {mean:.2f}x (paper: {PAPER_AVERAGE_SPEEDUP}x; goal "
        f"{'met' if mean >= PAPER_AVERAGE_SPEEDUP else 'NOT met'}). The uniform baselines give "
        "every rank the same tokens and heads, so a step waits for the slowest type: at "
        f"512K-1M tokens, where compute dominates, hexiseq gains {min(long_context):.2f}-"
        f"{max(long_context):.2f}x; at 128K on 128 GPUs the ring's exposed communication and "
        "the sharding collectives limit the step and the gain is "
        f"{min(short_context):.2f}-{max(short_context):.2f}x{won_text}. All of this is "
        "higher than the paper reports (1.19x measured on the H100 + A100 testbed, 1.36x "
        "average and 1.72x peak in its simulations): these are datasheet estimates with ideal "
        "overlap, in which an H100 is 2.6-2.9x an A100 (attention and GEMM rates), more than "
        "measured kernels show, and the baselines get no tuning beyond the uniform grid. "
        f"FLOP-matched pairs: normalized by peak FLOP/s the goal is {met(by_flops)}; "
        "normalized by the cost model's compute capacity (datasheet efficiencies differ per "
        "type: GEMM 0.80 of peak on A100 vs 0.72 on H100, attention backward 0.60 vs 0.50) "
        f"it is {met(by_capacity)}."
    )


def section(rows, pairs, lines, elapsed, argv) -> str:
    command = shlex.join([".venv/bin/python", "benchmarks/paper_scenarios.py", *(argv or [])])
    machine = (
        f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"
    )
    return "\n".join(
        [
            "## Paper scenarios: hexiseq vs the best feasible baseline",
            "",
            "All throughputs are predictions of the datasheet cost model (**datasheet "
            f"estimate**), not measurements. hexiseq: `plan_search(..., n_trials={TRIALS}, "
            f"seed={SEED})`; best baseline: the fastest feasible of uniform-usp (best uniform "
            "HP x CP grid, named with its grid), ring-only and ulysses-only, same simulator, "
            "each with activation checkpointing on or off, whichever is faster and fits "
            "('no ckpt': off). "
            "'all OOM': no baseline fits in 95 % of memory. mix4-32 runs at the longest of "
            f"{', '.join(LONGEST_TRIED)} where a plan fits.",
            "",
            scenario_table(rows),
            "",
            "### FLOP-matched pairs",
            "",
            "Mixed cluster (hexiseq plan) against a homogeneous one of about equal total dense "
            "BF16 datasheet FLOP/s (its best baseline plan; hexiseq's "
            "plan there in brackets), at the longest of "
            f"{', '.join(PAIR_LENGTHS)} where a baseline fits on the homogeneous cluster. "
            "Ratios = (mixed tok/s / homogeneous tok/s) / (mixed / homogeneous peak FLOP/s), "
            "and the same divided by the compute-capacity ratio instead (capacity: tokens/s "
            "if every GPU ran only its compute at the cost model's rates, no communication). "
            "All clusters 50 GB/s between nodes except mix4-32-large's A100 node (25 GB/s).",
            "",
            pair_table(pairs),
            "",
            *[f"- {line}" for line in lines],
            "",
            f"Produced by `{command}` on {machine}; the whole run took {elapsed:.0f} s "
            f"wall, {cpu_seconds():.0f} s of CPU in all its processes (the wall time grows "
            "when other jobs share the cores).",
            "",
            "**Reading.** " + reading(rows, pairs),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = scenario_rows()
    print(scenario_table(rows), "", flush=True)
    pairs = [run_pair(*pair) for pair in FLOP_PAIRS]
    print(pair_table(pairs), "", flush=True)
    lines = summary(rows, pairs)
    print(*lines, sep="\n")
    elapsed = time.perf_counter() - started
    print(f"\nwall time {elapsed:.0f} s, CPU time {cpu_seconds():.0f} s")
    if not args.no_write:
        update_results(section(rows, pairs, lines, elapsed, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
