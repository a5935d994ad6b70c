"""What every trial shares: the objective (global choices -> plan -> throughput), the
conversions between choices and Optuna parameters, and opening a (stored) study."""

from __future__ import annotations

import optuna
from sqlalchemy.exc import ArgumentError

from hexiseq.errors import InputError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import RING_ORDERS, GlobalChoices, candidate_hp_degrees, chunk_quantum
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.store import display_url, mask_url_passwords

INFEASIBLE_SCORE = 0.0
INFEASIBLE_ATTR = "infeasible"


def quantum_choices(problem: Problem) -> list[int]:
    """The automatic chunk quantum and its neighbours that still divide the sequence."""
    base = chunk_quantum(problem.train.seq_len, problem.cluster.world_size)
    options = [q for q in (base // 2, base, base * 2) if q >= 1]
    return [q for q in dict.fromkeys(options) if problem.train.seq_len % (2 * q) == 0]


def choices_from_params(problem: Problem, params: dict) -> GlobalChoices:
    degrees = {gpu: int(params[f"hp_degree[{gpu}]"]) for gpu in problem.cluster.gpu_types}
    return GlobalChoices(
        degrees,
        str(params["ring_order"]),
        int(params["chunk_quantum"]),
        bool(params["activation_checkpointing"]),
    )


def params_of(choices: GlobalChoices, quantum: int) -> dict:
    params = {f"hp_degree[{gpu}]": d for gpu, d in choices.hp_degrees.items()}
    params.update(
        ring_order=choices.ring_order,
        chunk_quantum=choices.chunk_quantum or quantum,
        activation_checkpointing=choices.activation_checkpointing,
    )
    return params


class Objective:
    """Scores trials; remembers every plan it built (trials repeating a choice are free)."""

    def __init__(self, problem: Problem, multi_objective: bool) -> None:
        self.problem = problem
        self.multi_objective = multi_objective
        self.cache: dict[tuple, Plan | InfeasiblePlan] = {}
        self.quanta = quantum_choices(problem)

    def __call__(self, trial: optuna.Trial):
        choices = self._sample(trial)
        plan = self.plan(choices)
        if isinstance(plan, InfeasiblePlan):
            trial.set_user_attr(INFEASIBLE_ATTR, plan.reason)
            return (INFEASIBLE_SCORE, -1.0) if self.multi_objective else INFEASIBLE_SCORE
        throughput = plan.predicted.tokens_per_s
        if self.multi_objective:
            return throughput, 1.0 - plan.predicted.max_memory_fraction
        return throughput

    def plan(self, choices: GlobalChoices) -> Plan | InfeasiblePlan:
        key = choices.key()
        if key not in self.cache:
            self.cache[key] = plan_for_choices(self.problem, choices)
        return self.cache[key]

    def _sample(self, trial: optuna.Trial) -> GlobalChoices:
        cluster, model = self.problem.cluster, self.problem.model
        degrees = {
            gpu: trial.suggest_categorical(
                f"hp_degree[{gpu}]", candidate_hp_degrees(cluster, model, gpu)
            )
            for gpu in cluster.gpu_types
        }
        return GlobalChoices(
            degrees,
            trial.suggest_categorical("ring_order", list(RING_ORDERS)),
            trial.suggest_categorical("chunk_quantum", self.quanta),
            trial.suggest_categorical(
                "activation_checkpointing", list(self.problem.checkpointing_options)
            ),
        )


def create_study(storage: str | None, name: str, seed: int, multi_objective: bool):
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)
    directions = ["maximize", "maximize"] if multi_objective else ["maximize"]
    try:
        return optuna.create_study(
            storage=storage,
            study_name=name,
            sampler=sampler,
            directions=directions,
            load_if_exists=True,
        )
    except (ArgumentError, ImportError) as error:
        # SQLAlchemy's message repeats the URL, password and all: one masked line instead.
        reason = mask_url_passwords((str(error).splitlines() or [type(error).__name__])[0])
        raise InputError(
            f"storage URL {display_url(str(storage))!r} is not usable: {reason}"
        ) from None


def default_study_name(problem: Problem, multi_objective: bool) -> str:
    kind = "pareto" if multi_objective else "throughput"
    return f"{problem.cluster.name}/{problem.model.name}/{problem.train.seq_len}/{kind}"
