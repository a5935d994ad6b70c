"""`plan_search`: the programmatic entry point (contract, DESIGN.md §7)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hexiseq.cluster import Cluster
from hexiseq.costmodel import CostModel, DatasheetCostModel
from hexiseq.errors import InfeasibleError, InputError
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.baselines import all_baselines
from hexiseq.search.optuna_layer import run_study
from hexiseq.store import parse_database_url
from hexiseq.units import parse_seq_len


@dataclass(frozen=True)
class Trial:
    """One candidate the search scored: its choices and throughput, or why it cannot run."""

    name: str
    tokens_per_s: float | None
    reason: str | None = None
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SearchResult:
    """The best plan, the baselines under the same simulator, every trial, the Pareto front
    (multi-objective searches) and the Optuna study's name."""

    best: Plan
    baselines: dict[str, Plan | InfeasiblePlan]
    trials: list[Trial] = field(default_factory=list)
    pareto: list[Plan] = field(default_factory=list)
    study_name: str = ""

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
    time_budget_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    n_trials: int | None = None,
    workers: int = 1,
    multi_objective: bool = False,
    cost_model: CostModel | None = None,
    activation_checkpointing: bool | None = None,
    study_name: str | None = None,
    show_progress: bool = False,
) -> SearchResult:
    """Find the fastest plan that fits in memory, and score the baselines the same way.

    `cluster` and `model` take objects or preset names (a cluster also a YAML path);
    `seq_len` takes 131072, "128k" or "1M". Without `time_budget_s` or `n_trials` only the
    greedy stage's short list is built (greedy global + MILP local each); with them, the
    Optuna layer goes on sampling the global choices for that long / that many trials.
    `seed` makes the sampling deterministic for a given `n_trials`; `storage` (SQLAlchemy
    URL) keeps the study and lets `workers` processes share it. Raises `InfeasibleError`
    when no plan fits, saying how much memory is missing and where.
    `activation_checkpointing` None lets the search drop the recompute wherever memory
    allows (baselines too); True or False forces it.
    """
    _check_options(time_budget_s, n_trials, workers, storage)
    cluster_spec = cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)
    problem = Problem(
        cluster=cluster_spec,
        model=model if isinstance(model, ModelSpec) else ModelSpec.preset(model),
        train=_train_spec(cluster_spec, parse_seq_len(seq_len)),
        cost=cost_model or DatasheetCostModel(),
        checkpointing_options=_checkpointing_options(activation_checkpointing),
    )
    baselines = all_baselines(problem)
    outcome = run_study(
        problem,
        n_trials=n_trials,
        time_budget_s=time_budget_s,
        seed=seed,
        storage=storage,
        study_name=study_name,
        workers=workers,
        multi_objective=multi_objective,
        show_progress=show_progress,
    )
    trials = [_trial(params, plan) for params, plan in outcome.plans]
    trials += [_trial({}, b) for b in baselines.values()]
    candidates = [plan for _, plan in outcome.plans] + list(baselines.values())
    feasible = [c for c in candidates if isinstance(c, Plan)]
    if not feasible:
        raise InfeasibleError(
            _infeasible_message(problem, candidates), _closest_missing(candidates)
        )
    best = max(feasible, key=lambda plan: plan.predicted.tokens_per_s)
    return SearchResult(best, baselines, trials, outcome.pareto, outcome.study_name)


def _train_spec(cluster: Cluster, seq_len: int) -> TrainSpec:
    """BF16 compute on GPUs; FP32 on an all-CPU (test or emulated) cluster, as the runtime
    computes there, so the simulator counts the bytes the runtime moves."""
    all_cpu = all(device.gpu == "cpu" for device in cluster.devices)
    return TrainSpec(seq_len=seq_len, compute_dtype_bytes=4 if all_cpu else 2)


def _checkpointing_options(activation_checkpointing: bool | None) -> tuple[bool, ...]:
    if activation_checkpointing is None:
        return (False, True)
    return (bool(activation_checkpointing),)


_STORAGE_URLS = (
    "give a SQLAlchemy URL such as sqlite:///optuna.db or postgresql://USER:PASSWORD@HOST/DB"
)


def _check_options(time_budget_s, n_trials, workers, storage) -> None:
    if time_budget_s is not None and time_budget_s <= 0:
        raise InputError(f"time budget must be positive seconds (got {time_budget_s})")
    if n_trials is not None and n_trials < 1:
        raise InputError(f"n_trials must be at least 1 (got {n_trials})")
    if workers < 1:
        raise InputError(f"workers must be at least 1 (got {workers})")
    if workers > 1 and storage is None:
        raise InputError("several workers share a study through storage=; give a storage URL")
    if storage is not None:  # a URL Optuna cannot parse: one line, its password masked
        parse_database_url(storage, "storage URL", _STORAGE_URLS)


def _trial(params: dict, candidate: Plan | InfeasiblePlan) -> Trial:
    if isinstance(candidate, Plan):
        return Trial(candidate.name, candidate.predicted.tokens_per_s, None, dict(params))
    return Trial(candidate.name, None, candidate.reason, dict(params))


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
