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
from hexiseq.search.proportional import node_groupings, plan_for_grouping
from hexiseq.units import parse_seq_len


@dataclass(frozen=True)
class Trial:
    """One candidate the search scored: its name and throughput, or why it is infeasible."""

    name: str
    tokens_per_s: float | None
    reason: str | None = None


@dataclass(frozen=True)
class SearchResult:
    """The best plan, the baselines under the same simulator, and every candidate tried."""

    best: Plan
    baselines: dict[str, Plan | InfeasiblePlan]
    trials: list[Trial] = field(default_factory=list)

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
    cost_model: CostModel | None = None,
    activation_checkpointing: bool = True,
) -> SearchResult:
    """Find the fastest plan that fits in memory, and score the baselines the same way.

    `cluster` and `model` take objects or preset names (a cluster also a YAML path); `seq_len`
    takes 131072, "128k" or "1M". This version is deterministic and fast, so `time_budget_s`
    and `seed` do not change its result; `storage` (an Optuna study URL) belongs to the
    Optuna layer and is refused until it exists. Raises `InfeasibleError` when no plan fits,
    saying how much memory is missing and where.
    """
    if storage is not None:
        raise InputError("storage= is for the Optuna search layer, which this version lacks")
    if time_budget_s is not None and time_budget_s <= 0:
        raise InputError(f"time_budget_s must be positive (got {time_budget_s})")
    problem = Problem(
        cluster=cluster if isinstance(cluster, Cluster) else Cluster.load(cluster),
        model=model if isinstance(model, ModelSpec) else ModelSpec.preset(model),
        train=TrainSpec(
            seq_len=parse_seq_len(seq_len), activation_checkpointing=activation_checkpointing
        ),
        cost=cost_model or DatasheetCostModel(),
    )
    baselines = all_baselines(problem)
    candidates = _candidates(problem, baselines)
    trials = [_trial(c) for c in candidates]
    feasible = [c for c in candidates if isinstance(c, Plan)]
    if not feasible:
        raise InfeasibleError(
            _infeasible_message(problem, candidates), _closest_missing(candidates)
        )
    best = max(feasible, key=lambda plan: plan.predicted.tokens_per_s)
    return SearchResult(best=best, baselines=baselines, trials=trials)


def _candidates(problem: Problem, baselines: dict) -> list[Plan | InfeasiblePlan]:
    """Asymmetric plans for every in-node grouping, plus the baselines themselves, so the
    search never returns something worse than a homogeneous system would run."""
    asymmetric = [
        plan_for_grouping(problem, groups, f"hexiseq (hp={degree})")
        for degree, groups in node_groupings(problem).items()
    ]
    return asymmetric + list(baselines.values())


def _trial(candidate: Plan | InfeasiblePlan) -> Trial:
    if isinstance(candidate, Plan):
        return Trial(candidate.name, candidate.predicted.tokens_per_s)
    return Trial(candidate.name, None, candidate.reason)


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
