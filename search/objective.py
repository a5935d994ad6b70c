"""What every trial shares: the objective (global choices -> plan -> throughput), the
conversions between choices and Optuna parameters, and the checks that a stored study was
searched over this search's space and step."""

from __future__ import annotations

import time
from collections.abc import Callable

import optuna

from hexiseq.errors import InputError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.search import helper
from hexiseq.search._evaluate import Problem
from hexiseq.search.greedy import (
    RING_ORDERS,
    GlobalChoices,
    candidate_hp_degrees,
    chunk_quantum,
    node_groups_text,
    parse_node_groups,
)
from hexiseq.search.helper import (
    BATCH_MIN_WAIT_S,
    BATCH_WAIT_FACTOR,
    HELPER_MIN_SHARE_S,
    evaluate_batch,
    has_helper,
)
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.options import SearchOptions
from hexiseq.search.shortlist import CLOSE_FROM

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
        parse_node_groups(params.get(NODE_GROUPS_PARAM, "")),
    )


NODE_GROUPS_PARAM = "node_groups"
"""The parameter of a polished trial whose nodes are cut apart (`GlobalChoices.node_groups`);
the study's own trials never have it (Optuna does not sample it)."""


def params_of(choices: GlobalChoices, quantum: int) -> dict:
    params = {f"hp_degree[{gpu}]": d for gpu, d in choices.hp_degrees.items()}
    params.update(
        ring_order=choices.ring_order,
        chunk_quantum=choices.chunk_quantum or quantum,
        activation_checkpointing=choices.activation_checkpointing,
    )
    if choices.node_groups:
        params[NODE_GROUPS_PARAM] = node_groups_text(choices.node_groups)
    return params


class Objective:
    """Scores trials; remembers every plan it built (trials repeating a choice are free).
    With `beside`, batches of plans (`plans`) are built partly in a helper process
    (`search.helper`) where one may run."""

    def __init__(self, problem: Problem, multi_objective: bool, beside: bool = False) -> None:
        self.problem = problem
        self.multi_objective = multi_objective
        self.beside = beside
        self.cache: dict[tuple, Plan | InfeasiblePlan] = {}
        self.quanta = quantum_choices(problem)
        self.built, self.built_s = 0, 0.0  # plans built (here or ahead), and their seconds
        # choices key -> (choices, the helper's ticket): plans built ahead (`build_ahead`)
        self.ahead: dict[tuple, tuple[GlobalChoices, int]] = {}
        self.early: dict[tuple, Plan | InfeasiblePlan] = {}  # built here ahead (`_take_ahead`)
        self.taken_ahead = 0  # plans the helper built ahead that were taken

    def __call__(self, trial: optuna.Trial):
        choices = self.sample(trial)
        plan = self.plan(choices)
        if isinstance(plan, InfeasiblePlan):
            trial.set_user_attr(INFEASIBLE_ATTR, plan.reason)
            return (INFEASIBLE_SCORE, -1.0) if self.multi_objective else INFEASIBLE_SCORE
        throughput = plan.predicted.tokens_per_s
        if self.multi_objective:
            return throughput, 1.0 - plan.predicted.max_memory_fraction
        return throughput

    def scored_trial(self, params: dict, **user_attrs) -> optuna.trial.FrozenTrial:
        """The finished trial of `params`, scored here (to add to a study in one write)."""
        fixed = optuna.trial.FixedTrial(params)
        value = self(fixed)
        return optuna.trial.create_trial(
            params=fixed.params,
            distributions=fixed.distributions,
            values=list(value) if self.multi_objective else [value],
            user_attrs={**fixed.user_attrs, **user_attrs},
        )

    def plan(self, choices: GlobalChoices) -> Plan | InfeasiblePlan:
        key = choices.key()
        if key not in self.cache and key in self.ahead:
            self._take_ahead(key)
        if key not in self.cache and key in self.early:
            self.cache[key] = self.early.pop(key)
        if key not in self.cache:
            self.cache[key] = self._aside(choices)
        return self.cache[key]

    def build_ahead(self, batch: list[GlobalChoices]) -> None:
        """Have the helper build the plans of `batch`, in order, before they are asked for
        (with `beside`, where the search has a helper): only plans that are the same
        whenever they are built (`shortlist.ahead_of_descents`). `plan` takes each when asked
        for it, where the helper has built it or is building it, and else builds it here and
        withdraws it from the helper."""
        if not (self.beside and has_helper(self.problem)):
            return  # a helper still busy (with the baselines) would not start them in time
        rates = True  # the busy rates go with the first: they do not change meanwhile
        for choices in batch:
            if choices.key() in self.cache or choices.key() in self.ahead:
                continue
            ticket = helper.start(self.problem, helper.planned, choices, rates=rates)
            if ticket is None:
                return
            self.ahead[choices.key()], rates = (choices, ticket), False

    def drop_ahead(self, choices: GlobalChoices | None = None) -> None:
        """Withdraw from the helper the plan of `choices` built ahead (None: every one not
        asked for)."""
        keys = list(self.ahead) + list(self.early) if choices is None else [choices.key()]
        for key in keys:
            self.early.pop(key, None)
            if key in self.ahead:
                helper.withdraw(self.problem, self.ahead.pop(key)[1])

    def _take_ahead(
        self, key: tuple, following: Callable[[], list[GlobalChoices]] | None = None
    ) -> None:
        """The plan built ahead for `key` where the helper has built it or is building it;
        the plans it has not started yet are withdrawn (this process builds them, and the
        helper builds the next beside each: `guess`, `plans`). While the helper finishes
        `key`'s, the plans of `following()` (the candidates after it, in order) are built
        here from the front and there from the back once it is done (`evaluate_batch`, kept
        in `early`, remembered when asked for: a candidate dropped as hopeless meanwhile is
        dropped with it). That the helper is still at `key`'s plan, started ahead, says the
        plans are worth sharing before this search has built one. Without `following`, and
        from `shortlist.CLOSE_FROM` devices, where the closer bar leaves most candidates
        hopeless once a plan is in (sharing them all, 256 and 512 GPUs of 8 types scored
        their short lists 29 and 26 % slower, in an A/B run beside the test suite), this
        process builds the next one alone (the first withdrawn, else the first after it)."""
        _, ticket = self.ahead.pop(key)
        working = helper.under_way(self.problem)
        later = [k for k, (_, t) in self.ahead.items() if working is not None and t > working]
        withdrawn = []
        for other in later:
            choices, other_ticket = self.ahead.pop(other)
            helper.withdraw(self.problem, other_ticket)
            withdrawn.append(choices)
        if working is not None and ticket > working:
            helper.withdraw(self.problem, ticket)
            return
        meanwhile = self._unbuilt(following()) if following is not None else []
        if not meanwhile or self.problem.cluster.world_size >= CLOSE_FROM:
            meanwhile = self._unbuilt(withdrawn[:1] or meanwhile[:1])  # the next one only
        if ticket == working and meanwhile:
            found, plans = evaluate_batch(
                self.problem, meanwhile, self._aside, worth=lambda count: True, behind=ticket
            )
            for candidate, plan in zip(found, plans):
                self.early.setdefault(candidate.key(), plan)
        wait_s = max(BATCH_MIN_WAIT_S, BATCH_WAIT_FACTOR * self.built_s / max(1, self.built))
        answer = helper.result(self.problem, ticket, wait_s)
        if answer is not None:
            plan, seconds = answer[0]
            self.cache[key] = plan
            self.built_s += seconds
            self.built += 1
            self.taken_ahead += 1

    def plans(
        self,
        batch: list[GlobalChoices],
        more: Callable[[], list[GlobalChoices]] | None = None,
    ) -> tuple[list[GlobalChoices], list[Plan | InfeasiblePlan]]:
        """`batch + more()` and the `plan` of each. Those not built yet are built together,
        shared with the helper process (with `beside`, where worth sending), `batch`'s sent
        before `more()` is called (`helper.evaluate_batch`)."""
        fresh = list({c.key(): c for c in batch if c.key() not in self.cache}.values())
        if self.beside:
            found, plans = evaluate_batch(
                self.problem, fresh, self.plan, more, self._worth_sending
            )
            for choices, plan in zip(found, plans):
                self.cache.setdefault(choices.key(), plan)
            extra = found[len(fresh) :]
        else:
            extra = more() if more is not None else []
        batch = [*batch, *extra]
        return batch, [self.plan(choices) for choices in batch]

    def guess(self, choices: GlobalChoices, following: Callable[[], list[GlobalChoices]]) -> None:
        """Build `plan(choices)`; where the search has a helper (`search.helper`), build the
        plans of `following()` (the candidates after it, in order) beside it, shared with
        the helper (`evaluate_batch`), and keep them aside (`early`): `plan` takes each
        when asked for it, and `drop_ahead` drops one the caller passes over meanwhile. A
        plan the helper builds ahead (`build_ahead`) is taken as in `plan`, with the first
        of `following()` built here while the helper finishes it."""
        if choices.key() in self.ahead:
            self._take_ahead(choices.key(), following if self.beside else None)
        if choices.key() in self.cache or choices.key() in self.early:
            self.plan(choices)
            return
        rest = self._unbuilt(following()) if has_helper(self.problem) else []
        if not (rest and self._worth_sending(1)):
            self.plan(choices)
            return
        everything = [choices, *rest]

        def evaluate(candidate: GlobalChoices) -> Plan | InfeasiblePlan:
            return self.plan(candidate) if candidate is choices else self._aside(candidate)

        found, plans = evaluate_batch(
            self.problem, everything, evaluate, worth=self._worth_sending
        )
        for candidate, plan in zip(found[1:], plans[1:]):
            self.early.setdefault(candidate.key(), plan)
        self.plan(choices)

    def _unbuilt(self, candidates: list[GlobalChoices]) -> list[GlobalChoices]:
        """`candidates` whose plans are neither built nor being built ahead, once each."""
        built = set(self.cache) | set(self.early) | set(self.ahead)
        return list({c.key(): c for c in candidates if c.key() not in built}.values())

    def _aside(self, choices: GlobalChoices) -> Plan | InfeasiblePlan:
        """`choices`'s plan, built here and counted (`built_s`), not remembered (`plan`
        remembers what it builds with it)."""
        started_s = time.perf_counter()
        plan = plan_for_choices(self.problem, choices)
        self.built_s += time.perf_counter() - started_s
        self.built += 1
        return plan

    def _worth_sending(self, count: int) -> bool:
        """Whether `count` plans are worth building in the helper: with `beside`, where this
        search's plans so far took HELPER_MIN_SHARE_S for that many (none built yet: no)."""
        if not self.beside or count < 1:
            return False
        return bool(self.built) and count * self.built_s / self.built >= HELPER_MIN_SHARE_S

    def sample(self, trial: optuna.Trial) -> GlobalChoices:
        """The trial's choices, sampled (Optuna's suggestions)."""
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


def check_search_space(study, problem: Problem) -> None:
    """Refuse a stored study whose trials chose from another search space (another cluster's
    GPU types, other checkpointing options or quanta): their plans cannot be rebuilt."""
    allowed = {
        f"hp_degree[{gpu}]": set(candidate_hp_degrees(problem.cluster, problem.model, gpu))
        for gpu in problem.cluster.gpu_types
    }
    allowed.update(
        ring_order=None,  # strategies and explicit node orders: checked when laid out
        chunk_quantum=set(quantum_choices(problem)),
        activation_checkpointing=set(problem.checkpointing_options),
    )
    for trial in study.get_trials(deepcopy=False):
        if not trial.params:
            continue
        names = set(trial.params)
        wrong = [
            name
            for name, value in trial.params.items()
            if name in allowed and allowed[name] is not None and value not in allowed[name]
        ]
        # A trial another process is running now may have sampled only some choices yet.
        running = trial.state == optuna.trial.TrialState.RUNNING
        mismatch = not names <= set(allowed) if running else names != set(allowed)
        if mismatch or wrong:
            detail = ", ".join(sorted(names ^ set(allowed))) or ", ".join(
                f"{name}={trial.params[name]!r}" for name in wrong
            )
            raise InputError(
                f"study {study.study_name!r} was searched over another space (trial "
                f"{trial.number}: {detail}); use another storage or study name (`hexiseq "
                "plan --study-name`, `plan_search(study_name=...)`)"
            )


TRAIN_ATTR = "hexiseq_train"
"""The study's user attribute holding the step its trials were scored for."""


def check_train_spec(study, problem: Problem) -> None:
    """Record the step (tokens, micro-batches, precision) a study's trials are scored for, and
    refuse to go on with a study scored for another: its stored scores would be read back as
    if they were this step's."""
    wanted = {
        "seq_len": problem.train.seq_len,
        "micro_batches": problem.train.micro_batches,
        "compute_dtype_bytes": problem.train.compute_dtype_bytes,
    }
    stored = study.user_attrs.get(TRAIN_ATTR)
    if stored is None:
        if any(trial.params for trial in study.get_trials(deepcopy=False)) and (
            wanted["micro_batches"] != 1 or _step_before_records(problem) != wanted
        ):
            raise InputError(
                f"study {study.study_name!r} was scored before hexiseq recorded the step's "
                "micro-batches and precision; use another storage or study name (`hexiseq plan "
                "--study-name`, `plan_search(study_name=...)`)"
            )
        _record_train_spec(study, wanted)
        return
    if stored != wanted:
        differing = ", ".join(f"{k} {stored.get(k)} (now {v})" for k, v in wanted.items()
                              if stored.get(k) != v)  # fmt: skip
        raise InputError(
            f"study {study.study_name!r} was scored for another step ({differing}); use another "
            "storage or study name (`hexiseq plan --study-name`, `plan_search(study_name=...)`)"
        )


def _record_train_spec(study, wanted: dict) -> None:
    """Record the study's step; where another process sharing the new study recorded it at
    the same moment (a unique-key clash), what it recorded must be the same step."""
    try:
        study.set_user_attr(TRAIN_ATTR, wanted)
    except optuna.exceptions.StorageInternalError:
        stored = optuna.load_study(
            study_name=study.study_name, storage=study._storage
        ).user_attrs.get(TRAIN_ATTR)
        if stored != wanted:
            raise InputError(
                f"study {study.study_name!r} is being scored for another step ({stored}) by "
                "another process; use another storage or study name"
            ) from None


def _step_before_records(problem: Problem) -> dict:
    """The step a study from before `TRAIN_ATTR` was scored for: one sequence, the cluster's
    default precision."""
    all_cpu = all(device.gpu == "cpu" for device in problem.cluster.devices)
    return {
        "seq_len": problem.train.seq_len,
        "micro_batches": 1,
        "compute_dtype_bytes": 4 if all_cpu else 2,
    }


def default_study_name(problem: Problem, options: SearchOptions) -> str:
    """The name of a search's study when `study_name` is not given: cluster/model/tokens/
    kind, with the checkpointing setting where it is forced (a forced search is another
    search space), the micro-batches where more than one and the precision where chosen."""
    kind = "pareto" if options.multi_objective else "throughput"
    name = f"{problem.cluster.name}/{problem.model.name}/{problem.train.seq_len}/{kind}"
    forced = problem.checkpointing_options
    if len(forced) == 1:
        name += "/checkpointing-" + ("on" if forced[0] else "off")
    if options.micro_batches != 1:
        name += f"/{options.micro_batches}-micro-batches"
    if options.precision != "auto":
        name += f"/{options.precision}"
    return name
