"""`plan_search`: the programmatic entry point (contract, docs/design.md §7)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hexiseq.cluster import Cluster
from hexiseq.costmodel import CostModel, DatasheetCostModel
from hexiseq.errors import InfeasibleError, InputError
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.baselines import (
    BASELINE_NAMES,
    DataParallelBaseline,
    all_baselines,
    data_parallel,
    strongest,
)
from hexiseq.search.beside import score_beside
from hexiseq.search.helper import helping
from hexiseq.search.options import SearchOptions, search_options
from hexiseq.search.optuna_layer import Trial, run_study, trial_of
from hexiseq.search.replicas import replica_plan
from hexiseq.units import parse_seq_len


@dataclass(frozen=True)
class SearchResult:
    """The best plan, the baselines under the same simulator, every trial, the Pareto front
    (multi-objective searches) and the Optuna study's name."""

    best: Plan
    baselines: dict[str, Plan | InfeasiblePlan]
    trials: list[Trial] = field(default_factory=list)
    pareto: list[Plan] = field(default_factory=list)
    study_name: str = ""
    data_parallel: DataParallelBaseline | None = None
    """Every GPU type that holds a sequence alone as its own data-parallel replica (None
    with fewer than two such types), each on up to 8 sequences per step: a baseline at its
    own batch (`plan_search(..., micro_batches=N)` plans replicas sharing a batch of N)."""

    @property
    def strongest_baseline(self) -> Plan | None:
        """The fastest feasible baseline (None when no baseline can run)."""
        return strongest(self.baselines)

    def speedup_over_strongest(self) -> float | None:
        """Predicted throughput ratio best / strongest feasible baseline (None: none runs)."""
        other = self.strongest_baseline
        return (
            None
            if other is None
            else self.best.predicted.tokens_per_s / other.predicted.tokens_per_s
        )

    def speedup_over_data_parallel(self) -> float | None:
        """Predicted throughput ratio best / data-parallel replicas (None: no such baseline)."""
        if self.data_parallel is None:
            return None
        return self.best.predicted.tokens_per_s / self.data_parallel.tokens_per_s

    def speedup_over(self, baseline: str) -> float | None:
        """Predicted throughput ratio best / baseline (None when the baseline is infeasible)."""
        other = self.baselines[baseline]
        if isinstance(other, InfeasiblePlan):
            return None
        return self.best.predicted.tokens_per_s / other.predicted.tokens_per_s


def plan_search(
    cluster: Cluster | str,
    model: ModelSpec | str,
    seq_len: int | str,
    *,
    options: SearchOptions | None = None,
    time_budget_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    n_trials: int | None = None,
    workers: int = 1,
    multi_objective: bool = False,
    cost_model: CostModel | None = None,
    activation_checkpointing: bool | None = None,
    study_name: str | None = None,
    micro_batches: int = 1,
    precision: str = "auto",
    show_progress: bool = False,
    data_parallel: bool = True,
) -> SearchResult:
    """Find the fastest plan that fits in memory, and score the baselines the same way.

    `cluster` and `model` take objects or preset names (a cluster also a YAML path);
    `seq_len` takes 131072, "128k" or "1M". How to search is a `SearchOptions` (see there),
    given as `options=` or as its fields' keywords, not both. Without `time_budget_s` or
    `n_trials` only the screened short list and the polish run (greedy global + local MILP
    each); with them, the Optuna layer goes on sampling the global choices for that long /
    that many trials. Raises `InfeasibleError` when no plan fits, saying how much memory is
    missing and where.
    """
    keywords = {
        "time_budget_s": time_budget_s,
        "seed": seed,
        "storage": storage,
        "n_trials": n_trials,
        "workers": workers,
        "multi_objective": multi_objective,
        "cost_model": cost_model,
        "activation_checkpointing": activation_checkpointing,
        "study_name": study_name,
        "micro_batches": micro_batches,
        "precision": precision,
        "show_progress": show_progress,
        "data_parallel": data_parallel,
    }
    if options is None:
        options = search_options(**keywords)
    elif any(value != _DEFAULTS[name] for name, value in keywords.items()):
        raise InputError("give plan_search either options= or option keywords, not both")
    return search(cluster, model, seq_len, options)


_DEFAULTS = {name: field.default for name, field in SearchOptions.model_fields.items()}


def search(
    cluster: Cluster | str, model: ModelSpec | str, seq_len: int | str, options: SearchOptions
) -> SearchResult:
    """`plan_search` with its options as one validated object."""
    with _collection_paused(not options.searching):
        return _search(cluster, model, seq_len, options)


@contextmanager
def _collection_paused(paused: bool) -> Iterator[None]:
    """Python's cyclic garbage collector off while the default search runs (a bounded
    fraction of a second): the search makes many short-lived containers, whose count sets
    off collections of every generation, and a full one walks the caller's whole heap
    (collections took 64 ms of a 0.56 s search on 64 GPUs of 8 types, most of it in the one
    full collection). Reference counting still frees what the search drops; the collector
    runs again, as before, once it returns. Searches that sample (`n_trials`,
    `time_budget_s`) may run for long: they keep it on."""
    if not paused or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _search(
    cluster: Cluster | str, model: ModelSpec | str, seq_len: int | str, options: SearchOptions
) -> SearchResult:
    cluster_spec = _cluster(cluster)
    tokens = parse_seq_len(seq_len)
    shares_batch = options.data_parallel and options.micro_batches >= 2
    too_short = tokens < 2 * cluster_spec.world_size  # for one mesh: replicas of nodes may do
    seq_len_tokens = _seq_len(cluster_spec, tokens, replicas=shares_batch)
    problem = Problem(
        cluster=cluster_spec,
        model=_model(model),
        train=train_spec(cluster_spec, seq_len_tokens, options),
        cost=options.cost_model or DatasheetCostModel(),
        checkpointing_options=options.checkpointing_options,
    )
    if cluster_spec.world_size > MAX_PLANNED_DEVICES or (too_short and shares_batch):
        return _replicas_only(problem, options)
    try:
        return _planned(problem, options)
    finally:
        problem.cache.clear()  # its local models refer back to it: freed now, not by gc


def _planned(problem: Problem, options: SearchOptions) -> SearchResult:
    with helping(problem, options.beside):
        pending = score_beside(problem, _baselines)
        outcome = run_study(problem, options)
        baselines, parallel = pending.result()
    trials = outcome.records + [trial_of({}, b) for b in baselines.values()]
    candidates = [outcome.best] if outcome.best is not None else []
    candidates += outcome.infeasible + list(baselines.values())
    replicated = replica_plan(problem) if options.data_parallel else None
    if replicated is not None:
        candidates.append(replicated)
    feasible = [c for c in candidates if isinstance(c, Plan)]
    if not feasible:
        raise InfeasibleError(
            _infeasible_message(problem, candidates), _closest_missing(candidates)
        )
    best = max(feasible, key=lambda plan: plan.predicted.tokens_per_s)
    return SearchResult(best, baselines, trials, outcome.pareto, outcome.study_name, parallel)


def _baselines(problem: Problem) -> tuple[dict, DataParallelBaseline | None]:
    """Every baseline and the data-parallel replicas (`search.beside` scores them beside
    the study)."""
    return all_baselines(problem), data_parallel(problem)


MAX_PLANNED_DEVICES = 4096
"""The largest cluster one CP-HP mesh is planned for: the simulator's ring tables grow with
the square of the devices (measured on 2 cores: 2048 devices plan in 11 s with 0.5 GiB, 4096
in 35 s with 1.7 GiB), and beyond that a single sequence over every device is not a plan
anyone runs."""


def _cluster(cluster) -> Cluster:
    if not isinstance(cluster, (Cluster, str, Path)):
        raise InputError(
            f"cluster must be a hexiseq.Cluster, a preset name or a YAML path (got {cluster!r})"
        )
    return cluster if isinstance(cluster, Cluster) else Cluster.load(str(cluster))


def _replicas_only(problem: Problem, options: SearchOptions) -> SearchResult:
    """A cluster too large for one mesh: data-parallel replicas only (their meshes are planned
    per node shape, not per rank), or one line saying what to give."""
    cluster = problem.cluster
    if cluster.world_size > MAX_PLANNED_DEVICES:
        beyond = (
            f"cluster {cluster.name} has {cluster.world_size:,} devices; hexiseq plans one "
            f"CP-HP mesh of at most {MAX_PLANNED_DEVICES:,}"
        )
    else:
        beyond = (
            f"a sequence of {problem.train.seq_len:,} tokens is too short for one mesh over "
            f"{cluster.name}'s {cluster.world_size:,} devices (2 tokens each)"
        )
    if not options.data_parallel or problem.train.micro_batches < 2:
        raise InputError(
            f"{beyond}: give the step's batch (--micro-batches N, Python micro_batches=N, at "
            "least 2) to plan data-parallel replicas sharing it, or plan a part of the cluster"
        )
    replicated = replica_plan(problem)
    if not isinstance(replicated, Plan):
        reason = replicated.reason if replicated is not None else "no replicas"
        raise InfeasibleError(f"{beyond}, and no data-parallel replicas fit: {reason}", {})
    not_planned = f"not planned: one mesh over {cluster.world_size:,} devices"
    baselines = {name: InfeasiblePlan(name, not_planned) for name in BASELINE_NAMES}
    return SearchResult(replicated, baselines, [trial_of({}, replicated)])


def _model(model) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, str):
        raise InputError(f"model must be a hexiseq.ModelSpec or a preset name (got {model!r})")
    return ModelSpec.preset(model)


def _seq_len(cluster: Cluster, tokens: int, replicas: bool = False) -> int:
    """The sequence must split into an even number of zigzag chunks of whole tokens, at least
    one pair of tokens per device of its mesh: the whole cluster, or, where data-parallel
    replicas share a batch (`replicas`), at least one node (replicas are whole nodes)."""
    world = cluster.world_size
    node = max(n.count for n in cluster.nodes)
    if tokens % 2 == 0 and tokens >= 2 * (node if replicas else world):
        return tokens
    if replicas:
        raise InputError(
            f"--seq-len {tokens:,} cannot be split over a node of {cluster.name} ({node} "
            f"devices): give an even number of tokens, at least 2 per device ({2 * node:,})"
        )
    hint = ""
    if tokens % 2 == 0 and tokens >= 2 * node:  # a node could take it: replicas would do
        hint = (
            "; or give a batch (--micro-batches N >= 2) to plan data-parallel replicas of "
            "whole nodes, each taking whole sequences"
        )
    raise InputError(
        f"--seq-len {tokens:,} cannot be split over {cluster.name}'s {world} devices: give an "
        f"even number of tokens, at least 2 per device ({2 * world:,}){hint}"
    )


def train_spec(cluster: Cluster, seq_len: int, options: SearchOptions) -> TrainSpec:
    """The step the plan is for: `options.micro_batches` sequences of `seq_len` tokens, in
    the chosen precision; "auto" is BF16 on GPUs and FP32 on an all-CPU (test or emulated)
    cluster, as the runtime computes there, so the simulator counts the bytes it moves."""
    precision = options.precision
    if precision == "auto":
        all_cpu = all(device.gpu == "cpu" for device in cluster.devices)
        precision = "fp32" if all_cpu else "bf16"
    return TrainSpec(
        seq_len=seq_len,
        micro_batches=options.micro_batches,
        compute_dtype_bytes=4 if precision == "fp32" else 2,
    )


def _closest_missing(candidates: list) -> dict[int, int]:
    short = [c for c in candidates if isinstance(c, InfeasiblePlan) and c.missing_bytes]
    return min(short, key=lambda c: c.total_missing_bytes).missing_bytes if short else {}


def _infeasible_message(problem: Problem, candidates: list) -> str:
    missing = _closest_missing(candidates)
    if not missing:
        return f"no plan for {problem.model.name} on {problem.cluster.name}: " + "; ".join(
            f"{c.name}: {c.reason}" for c in candidates[:3]
        )
    devices = problem.cluster.devices
    worst = max(missing, key=missing.get)
    total = sum(missing.values()) / 2**30
    return (
        f"no plan for {problem.model.name} at {problem.train.seq_len} tokens fits on "
        f"{problem.cluster.name}: even the closest candidate is {total:.2f} GiB short in all "
        f"under the 95 % limit, on {len(missing)} rank(s); the worst, rank {worst} "
        f"({devices[worst].gpu} on {devices[worst].node}), lacks {missing[worst] / 2**30:.2f} GiB"
    )
