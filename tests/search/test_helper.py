"""The search's helper process (`search.helper`) and the baselines it scores (`search.beside`)."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import FrozenInstanceError, replace

import pytest
from scaling_clusters import planner_scaling_cluster

from hexiseq import Cluster, ModelSpec, TrainSpec
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.errors import InputError
from hexiseq.plan import Plan, RankPrediction
from hexiseq.search import beside, helper, plan_search
from hexiseq.search._evaluate import Problem
from hexiseq.search.baselines import all_baselines, data_parallel
from hexiseq.search.greedy import GlobalChoices
from hexiseq.search.hierarchy import plan_for_choices
from hexiseq.search.objective import Objective
from hexiseq.search.screen import rate_tables, rates_table

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the helper is forked on Linux only"
)

TEST_PID = os.getpid()  # the helper is forked from this process: it sees another pid
ONLY_THREAD = helper._only_thread


def problem_on(preset: str) -> Problem:
    cluster = Cluster.preset(preset)
    return Problem(
        cluster, ModelSpec.preset("llama3-8b"), TrainSpec(seq_len=2**20), DatasheetCostModel()
    )


@pytest.fixture(autouse=True)
def two_cpus_one_thread(monkeypatch):
    """The machine's CPU count is not the test's business, nor the threads earlier tests
    left behind (a progress bar's monitor lives as long as the process): forking is allowed
    to need two CPUs and one thread. Each test starts and ends with no helper."""
    monkeypatch.setenv(helper.HELPER_VARIABLE, "on")
    monkeypatch.setattr(helper, "_cpus", lambda: 2)
    monkeypatch.setattr(helper, "_only_thread", lambda: True)
    helper._stop()
    yield
    helper._stop()


def pid_and_devices(problem: Problem) -> tuple[int, int]:
    return os.getpid(), problem.cluster.world_size


def fails_in_helper(problem: Problem) -> tuple[int, int]:
    if os.getpid() != TEST_PID:
        raise RuntimeError("helper only")
    return pid_and_devices(problem)


def always_fails(problem: Problem):
    raise ValueError("bad problem")


def dies_in_helper(problem: Problem) -> tuple[int, int]:
    if os.getpid() != TEST_PID:
        os._exit(3)
    return pid_and_devices(problem)


def hangs_in_helper(problem: Problem) -> tuple[int, int]:
    if os.getpid() != TEST_PID:
        time.sleep(60)
    return pid_and_devices(problem)


def baselines_pid(problem: Problem, score=pid_and_devices, allowed: bool = True) -> int:
    with helper.helping(problem, allowed):
        return beside.score_beside(problem, score).result()[0]


def test_the_baselines_are_scored_in_the_helper_and_it_is_kept_for_the_next_search():
    first = baselines_pid(problem_on("mix2-128"))
    second = baselines_pid(problem_on("h100x8-a100x8"))
    assert first != TEST_PID and first == second  # one helper, forked once
    assert helper._HELPER.process.pid == first


def test_a_search_not_allowed_a_helper_scores_here():
    assert baselines_pid(problem_on("mix2-128"), allowed=False) == TEST_PID
    assert helper._HELPER is None  # none forked


def test_the_environment_can_keep_the_work_here_and_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv(helper.HELPER_VARIABLE, "OFF")
    assert baselines_pid(problem_on("mix2-128")) == TEST_PID
    monkeypatch.setenv(helper.HELPER_VARIABLE, "sometimes")
    with pytest.raises(InputError, match=r"HEXISEQ_SEARCH_HELPER='sometimes' is not one of on"):
        plan_search("h100x8-a100x8", "llama3-8b", "1M")


def test_with_another_thread_running_no_helper_is_forked(monkeypatch):
    monkeypatch.setattr(helper, "_only_thread", ONLY_THREAD)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert baselines_pid(problem_on("mix2-128")) == TEST_PID
        assert helper._HELPER is None
    finally:
        release.set()
        other.join()


def test_a_second_search_while_one_holds_the_helper_works_alone():
    problem, other = problem_on("mix2-128"), problem_on("h100x8-a100x8")
    with helper.helping(problem, True):
        assert beside.score_beside(problem, pid_and_devices).result()[0] != TEST_PID
        assert baselines_pid(other) == TEST_PID  # the helper is held: scored here


def test_what_fails_in_the_helper_is_scored_here_and_raises_here():
    assert baselines_pid(problem_on("mix2-128"), fails_in_helper) == TEST_PID
    with pytest.raises(ValueError, match="bad problem"):
        baselines_pid(problem_on("mix2-128"), always_fails)


def test_a_helper_that_dies_leaves_the_scoring_here_and_the_next_search_forks_another():
    assert baselines_pid(problem_on("mix2-128"), dies_in_helper) == TEST_PID
    assert helper._HELPER is None  # stopped and reaped
    assert baselines_pid(problem_on("mix2-128")) != TEST_PID


def test_a_helper_too_slow_is_stopped_and_the_scoring_done_here(monkeypatch):
    monkeypatch.setattr(beside, "BESIDE_MIN_WAIT_S", 0.3)
    monkeypatch.setattr(beside, "BESIDE_WAIT_FACTOR", 0.0)
    problem = problem_on("mix2-128")
    with helper.helping(problem, True):
        pending = beside.score_beside(problem, hangs_in_helper)
        process = helper._HELPER.process
        started = time.perf_counter()
        assert pending.result()[0] == TEST_PID
    assert time.perf_counter() - started < 10
    assert not process.is_alive() and helper._HELPER is None


def test_a_search_that_did_not_end_leaves_the_next_one_a_fresh_helper():
    problem = problem_on("mix2-128")
    with pytest.raises(KeyboardInterrupt), helper.helping(problem, True):
        beside.score_beside(problem, hangs_in_helper)
        stuck = helper._HELPER.process
        raise KeyboardInterrupt  # before the search took the baselines
    started = time.perf_counter()
    fresh = baselines_pid(problem_on("mix2-128"))
    assert time.perf_counter() - started < 10  # not behind the stuck work
    assert fresh not in (stuck.pid, TEST_PID) and not stuck.is_alive()


def test_a_process_forked_with_its_parents_helper_forks_its_own():
    first = baselines_pid(problem_on("mix2-128"))
    parents = helper._HELPER
    parents.owner_pid = -1  # as a process forked after the helper sees it
    try:
        second = baselines_pid(problem_on("mix2-128"))
        assert second not in (first, TEST_PID)
        assert parents.process.is_alive()  # not the child's to stop
    finally:
        parents.connection.close()
        parents.process.kill()
        parents.process.join()


BATCH = [
    GlobalChoices({"H100-SXM": 1, "A100-80G": 1}, "bandwidth", 4096, True),
    GlobalChoices({"H100-SXM": 2, "A100-80G": 1}, "bandwidth", 4096, True),
    GlobalChoices({"H100-SXM": 1, "A100-80G": 2}, "interleaved", 4096, True),
    GlobalChoices({"H100-SXM": 1, "A100-80G": 1}, "fastest-first", 8192, False),
    GlobalChoices({"H100-SXM": 4, "A100-80G": 4}, "bandwidth", 4096, True),
]


def batch_rows(plans) -> list:
    return [
        (p.predicted.tokens_per_s, p.knobs, [a.tokens for a in p.assignments])
        if isinstance(p, Plan)
        else p.reason
        for p in plans
    ]


def helper_done(deadline_s: float = 30.0) -> None:
    """Wait until the helper has answered all it was sent, withdrawn or not (at most
    `deadline_s`)."""
    deadline = time.perf_counter() + deadline_s
    while time.perf_counter() < deadline:
        if helper._HELPER.idle() and not helper._HELPER.withdrawn:
            return
        time.sleep(0.01)


def test_a_batch_gets_the_plans_this_process_would_build():
    """This process starts on the first plan at once; the helper, sent the others, builds
    those it gets to first (here: all of them, while the first waits for it), and they are
    the plans this process builds."""
    alone = problem_on("h100x8-a100x8")
    here = [plan_for_choices(alone, choices) for choices in BATCH]
    problem, built_here = problem_on("h100x8-a100x8"), []

    def evaluate(choices):
        if not built_here:
            helper_done()
        built_here.append(choices)
        return plan_for_choices(problem, choices)

    with helper.helping(problem, True):
        found, plans = helper.evaluate_batch(problem, BATCH, evaluate)
    assert found == BATCH
    assert built_here == BATCH[:1]
    assert batch_rows(plans) == batch_rows(here)
    assert [isinstance(p, Plan) for p in plans] == [True, True, True, False, True]
    assert all(p.cluster is problem.cluster for p in plans if isinstance(p, Plan))


RELEASE = {}  # the file whose existence lets `held_built` go on (set before the fork)


def held_built(problem: Problem, choices: GlobalChoices):
    """In the helper: `_built`, once RELEASE's file exists (at most 30 s on)."""
    deadline = time.perf_counter() + 30
    while not RELEASE["path"].exists() and time.perf_counter() < deadline:
        time.sleep(0.01)
    return REAL_BUILT(problem, choices)


def test_plans_the_helper_has_not_started_are_built_here(monkeypatch, tmp_path):
    """The two share a batch: the helper starts from the back (here on a plan it holds
    until this process has built the rest), this process from the front, and builds every
    plan the helper has not started, withdrawing it there; the one under way is waited for."""
    monkeypatch.setitem(RELEASE, "path", tmp_path / "release")
    monkeypatch.setattr(helper, "_built", held_built)  # the helper is forked with it
    alone = problem_on("h100x8-a100x8")
    here = [plan_for_choices(alone, choices) for choices in BATCH]
    problem, built_here = problem_on("h100x8-a100x8"), []

    def evaluate(choices):
        built_here.append(choices)
        if len(built_here) == 4:
            RELEASE["path"].touch()
        return plan_for_choices(problem, choices)

    with helper.helping(problem, True):
        found, plans = helper.evaluate_batch(problem, BATCH, evaluate)
        assert built_here == BATCH[:4]  # the last was under way in the helper
        assert batch_rows(plans) == batch_rows(here)
        assert not helper._HELPER.waiting and not helper._HELPER.answers
        helper_done()
        assert not helper._HELPER.withdrawn  # the skipped ones answered (empty), forgotten


def test_the_batch_is_sent_before_the_rest_is_found_here(monkeypatch):
    """`evaluate_batch` with `more`: the whole batch goes to the helper, last first, before
    `more()` runs here (this process is busy with it), and what `more()` found after it;
    the plans are those one process builds, each built once."""
    alone = problem_on("h100x8-a100x8")
    here = [plan_for_choices(alone, choices) for choices in BATCH]
    problem, built_here, events = problem_on("h100x8-a100x8"), [], []
    call = helper._Helper.call

    def recording(self, problem, work, args, with_rates=True):
        events.append(("sent", args[0]))
        return call(self, problem, work, args, with_rates)

    def evaluate(choices):
        built_here.append(choices)
        return plan_for_choices(problem, choices)

    def more():
        events.append(("found", BATCH[3:]))
        return BATCH[3:]

    monkeypatch.setattr(helper._Helper, "call", recording)
    with helper.helping(problem, True):
        found, plans = helper.evaluate_batch(problem, BATCH[:3], evaluate, more)
        assert found == BATCH
        sent = [("sent", BATCH[i]) for i in (2, 1, 0)]
        assert events == [*sent, ("found", BATCH[3:]), ("sent", BATCH[4]), ("sent", BATCH[3])]
        assert len(set(map(GlobalChoices.key, built_here))) == len(built_here)
        assert batch_rows(plans) == batch_rows(here)
        # nothing before `more()`: this process starts on the first it found at once
        helper_done()
        events.clear(), built_here.clear()
        found, plans = helper.evaluate_batch(problem, [], evaluate, more)
    assert found == BATCH[3:]
    assert events == [("found", BATCH[3:]), ("sent", BATCH[4])]
    assert built_here[:1] == BATCH[3:4]
    assert batch_rows(plans) == batch_rows(here[3:])


def test_a_batch_waits_for_no_helper_busy_with_the_baselines():
    problem, built_here = problem_on("h100x8-a100x8"), []

    def evaluate(choices):
        built_here.append(choices)
        return plan_for_choices(problem, choices)

    with helper.helping(problem, True):
        pending = beside.score_beside(problem, hangs_in_helper)  # keeps the helper busy
        helper.evaluate_batch(problem, BATCH, evaluate)
        assert built_here == BATCH
    assert pending.beside


def rates_seen(problem: Problem) -> dict:
    """In the helper: the busy-rate tables it prices from, as plain values."""
    return {
        train.activation_checkpointing: dict(table)
        for train, table in rate_tables(problem).items()
    }


def busy_briefly(problem: Problem) -> None:
    time.sleep(0.5)


def test_the_rates_sent_with_withdrawn_work_still_reach_the_helper():
    problem = problem_on("h100x8-a100x8")
    table = rates_table(problem, problem.train)
    with helper.helping(problem, True):
        table[(0, 1)] = "rates of (0, 1)"
        helper.start(problem, busy_briefly)
        table[(2, 3)] = "rates of (2, 3)"
        helper.withdraw(problem, helper.start(problem, rates_seen))  # skipped there
        table[(4, 5)] = "rates of (4, 5)"
        seen = helper.result(problem, helper.start(problem, rates_seen), 30.0)[0]
    assert seen == {True: {(0, 1): "rates of (0, 1)", (2, 3): "rates of (2, 3)",
                           (4, 5): "rates of (4, 5)"}}  # fmt: skip


def test_the_helper_prices_from_the_rates_found_here_each_sent_once(monkeypatch):
    problem = problem_on("h100x8-a100x8")
    table = rates_table(problem, problem.train)
    sent = []
    new_rates = helper._Helper._new_rates
    monkeypatch.setattr(
        helper._Helper, "_new_rates", lambda self, p: sent.append(new_rates(self, p)) or sent[-1]
    )

    def seen_there() -> dict:
        return helper.result(problem, helper.start(problem, rates_seen), 30.0)[0]

    with helper.helping(problem, True):
        table[(0, 1)] = "rates of (0, 1)"
        assert seen_there() == {True: {(0, 1): "rates of (0, 1)"}}
        table[(2, 3)] = "rates of (2, 3)"
        assert seen_there() == {True: {(0, 1): "rates of (0, 1)", (2, 3): "rates of (2, 3)"}}
        assert seen_there() == {True: {(0, 1): "rates of (0, 1)", (2, 3): "rates of (2, 3)"}}
    assert [list(rates.get(problem.train, {})) for rates in sent] == [
        [(0, 1)],
        [(2, 3)],  # only what was found since the last call
        [],
    ]
    # the next search's helper holds none of them: that search sends its own from the first
    other = replace(problem, cache={})
    rates_table(other, other.train)[(0, 1)] = "again"
    with helper.helping(other, True):
        assert helper.result(other, helper.start(other, rates_seen), 30.0)[0] == {
            True: {(0, 1): "again"}
        }


def describe(result) -> dict:
    """What a search reports, as plain values."""
    rows = {"best": (result.best.name, result.best.predicted.tokens_per_s)}
    rows["trials"] = [(t.tokens_per_s, t.reason, t.params) for t in result.trials]
    for name, plan in result.baselines.items():
        value = plan.predicted.tokens_per_s if isinstance(plan, Plan) else plan.reason
        rows[name] = (plan.name, value)
    parallel = result.data_parallel
    rows["data parallel"] = None if parallel is None else parallel.describe()
    return rows


@pytest.mark.parametrize("preset", ["mix4-32", "mix4-128"])
def test_plan_search_reports_the_same_with_and_without_its_helper(monkeypatch, preset):
    answered = []
    take = helper._Helper.take

    def counting(self, problem, ticket, wait_s):
        answer = take(self, problem, ticket, wait_s)
        answered.append(answer is not None)
        return answer

    monkeypatch.setattr(helper._Helper, "take", counting)
    found = describe(plan_search(preset, "llama3-8b", "1M"))
    # the baselines at least (a batch goes only where the helper is done with them)
    assert answered and all(answered)
    monkeypatch.setattr(helper, "safe_to_fork", lambda: False)
    helper._stop()
    answered.clear()
    here = describe(plan_search(preset, "llama3-8b", "1M"))
    assert not answered
    assert found == here
    assert set(found) >= {"uniform-usp", "ring-only", "ulysses-only", "homogeneous-subset"}


def test_a_short_list_candidate_built_ahead_but_hopeless_by_then_is_left_out(monkeypatch):
    """The helper builds the short-list candidates after the one this process scores (the
    last first); where the first one's step makes one hopeless, it is dropped as if never
    built (not a trial, and not remembered: the polish would take it for scored)."""
    import optuna

    from hexiseq.search import optuna_layer

    first, doomed, last = (replace(c, chunk_quantum=256) for c in BATCH[:3])
    sent = []
    call = helper._Helper.call

    def recording(self, problem, work, args, with_rates=True):
        sent.append(args[0] if args else None)
        return call(self, problem, work, args, with_rates)

    def hopeless(problem, choices, best_step_s):
        return choices.key() == doomed.key() and best_step_s < float("inf")

    monkeypatch.setattr(helper._Helper, "call", recording)
    # however fast this search's plans are, the next candidate is built ahead
    monkeypatch.setattr(Objective, "_worth_sending", lambda self, count: count > 0)
    monkeypatch.setattr(optuna_layer, "shortlist", lambda p, quanta, ahead: [first, doomed, last])
    monkeypatch.setattr(optuna_layer, "hopeless", hopeless)
    problem = problem_on("h100x8-a100x8")
    objective = Objective(problem, multi_objective=False, beside=True)
    study = optuna.create_study(direction="maximize")
    with helper.helping(problem, True):
        added = optuna_layer._score_shortlist(study, objective, None)
    assert sent == [last, doomed]  # built beside the first, in the helper, the last first
    assert added == 2 and set(objective.cache) == {first.key(), last.key()}
    assert not objective.early and not objective.ahead
    scored = [optuna_layer.choices_from_params(problem, t.params) for t in study.trials]
    assert [c.key() for c in scored] == [first.key(), last.key()]


def test_the_checkpointed_descent_in_the_helper_lists_what_this_process_would(monkeypatch):
    """64 GPUs of 8 types at 896K tokens: both descents of the short list move (with and
    without activation checkpointing: some picks keep the recompute, some fit without it);
    the helper runs the checkpointed one, and the short list, its estimates and its busy
    rates come out as found here."""
    from hexiseq.search import shortlist as shortlist_module
    from hexiseq.search.objective import quantum_choices
    from hexiseq.search.screen import estimate_s

    types = ["H100-SXM", "A100-80G", "H200", "L40S", "A800-80G", "H800", "B200", "V100-32G"]
    cluster = planner_scaling_cluster(64, types)
    model, train = ModelSpec.preset("llama3-8b"), TrainSpec(seq_len=896 * 1024)
    problems = [Problem(cluster, model, train, DatasheetCostModel()) for _ in range(2)]
    started = []
    start = helper.start

    def recording(problem, work, *args):
        ticket = start(problem, work, *args)
        started.append((work.__name__, ticket is not None))
        return ticket

    monkeypatch.setattr(shortlist_module.helper, "start", recording)
    quanta = quantum_choices(problems[0])
    with helper.helping(problems[0], True):
        beside_list = shortlist_module.shortlist(problems[0], quanta)
    monkeypatch.setenv(helper.HELPER_VARIABLE, "off")
    here_list = shortlist_module.shortlist(problems[1], quanta)
    assert started == [("_descended_beside", True), ("_descended_beside", False)]
    assert [c.key() for c in beside_list] == [c.key() for c in here_list]
    assert [estimate_s(problems[0], c) for c in beside_list] == [
        estimate_s(problems[1], c) for c in here_list
    ]
    rates = [
        {k: {g: (r.per_token_s.tolist(), r.fixed_s.tolist()) for g, r in v.items()}
         for k, v in rate_tables(p).items()}
        for p in problems
    ]  # fmt: skip
    assert rates[0] == rates[1] and len(rates[0]) == 2  # both steps' tables


def test_an_answer_refers_to_the_problems_own_parts_and_carries_the_rest_equal():
    """The baselines as the helper sends them back: the problem's cluster, model and cost
    model by name (unpickled as this process's own objects), everything else equal to what
    was sent (a homogeneous subset's cluster, its frozen per-rank records), and frozen still."""
    problem = problem_on("mix4-32")
    baselines = all_baselines(problem)
    parallel = data_parallel(problem)
    sent = helper._dumps((baselines, parallel), problem)
    here = replace(problem, cache={})  # the problem as the other process holds it
    got, got_parallel = helper._loads(sent, here)
    assert got == baselines and got_parallel == parallel
    usp, subset = got["uniform-usp"], got["homogeneous-subset"]
    assert usp.cluster is problem.cluster and usp.model is problem.model
    assert subset.cluster == baselines["homogeneous-subset"].cluster
    assert subset.cluster is not problem.cluster and len(subset.assignments) < 32
    with pytest.raises(FrozenInstanceError):
        usp.assignments[0].tokens = 0
    assert isinstance(usp.predicted.ranks[0], RankPrediction)
    other = Problem(problem.cluster, ModelSpec.preset("llama2-13b"), problem.train, problem.cost)
    # a model that is not the problem's travels in full
    (model,) = helper._loads(helper._dumps((problem.model,), other), other)
    assert model == problem.model and model is not other.model


def test_an_answer_that_cannot_be_read_here_is_scored_here(monkeypatch):
    def unreadable(data, problem):
        raise EOFError("truncated")

    monkeypatch.setattr(helper, "_loads", unreadable)
    assert baselines_pid(problem_on("mix2-128")) == TEST_PID
    assert helper._HELPER is None  # stopped: the next search forks another


def sleeps_in_helper(problem: Problem, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


REAL_PLANNED = helper.planned
REAL_BUILT = helper._built


def slow_planned(problem: Problem, choices: GlobalChoices):
    time.sleep(0.4)
    return REAL_PLANNED(problem, choices)


def built_here_counter(monkeypatch) -> list:
    """The choices whose plans `Objective.plan` builds in this process."""
    from hexiseq.search import objective as objective_module

    built = []
    real = objective_module.plan_for_choices

    def counting(problem, choices):
        built.append(choices.key())
        return real(problem, choices)

    monkeypatch.setattr(objective_module, "plan_for_choices", counting)
    return built


def built_ahead_setup(monkeypatch, count: int) -> tuple[list, list, list, Objective]:
    """`count` candidates, their plans built in a process of their own, the list of those
    `Objective.plan` builds here, and an objective (with `beside`) on a problem of its own."""
    batch = [replace(c, chunk_quantum=256) for c in BATCH[:count]]
    alone = problem_on("h100x8-a100x8")
    here = [plan_for_choices(alone, choices) for choices in batch]
    built = built_here_counter(monkeypatch)
    objective = Objective(problem_on("h100x8-a100x8"), multi_objective=False, beside=True)
    return batch, here, built, objective


def test_plans_built_ahead_by_the_helper_are_taken_as_built_here(monkeypatch):
    """The short list's picks go to the helper while the descent runs here
    (`Objective.build_ahead`); asked for once the helper has built them, they are its plans,
    the same as this process builds, and this process builds none of them."""
    batch, here, built, objective = built_ahead_setup(monkeypatch, 3)
    problem = objective.problem
    with helper.helping(problem, True):
        objective.build_ahead(batch)
        assert len(objective.ahead) == 3
        deadline = time.perf_counter() + 30
        while helper.under_way(problem) is not None and time.perf_counter() < deadline:
            time.sleep(0.01)
        plans = [objective.plan(choices) for choices in batch]
    assert built == [] and objective.taken_ahead == 3 and objective.built == 3
    assert batch_rows(plans) == batch_rows(here)
    assert all(p.cluster is problem.cluster for p in plans if isinstance(p, Plan))


def test_plans_the_helper_has_not_started_are_withdrawn_and_built_here(monkeypatch):
    """Behind other work of the helper's, the plans built ahead are withdrawn when the first
    is asked for: this process builds it (and the others when asked), the helper skips them
    (they never answer), and it is kept for the search's other work."""
    from hexiseq.search import objective as objective_module

    monkeypatch.setattr(helper, "planned", slow_planned)  # 0.4 s a plan in the helper
    batch, here, built, objective = built_ahead_setup(monkeypatch, 3)
    problem = objective.problem
    monkeypatch.setattr(objective_module, "has_helper", lambda problem: True)
    with helper.helping(problem, True):
        busy = helper.start(problem, sleeps_in_helper, 0.5)
        objective.build_ahead(batch)
        plans = [objective.plan(choices) for choices in batch]
        assert built == [c.key() for c in batch] and not objective.ahead
        assert helper.result(problem, busy, 30)[0] != TEST_PID
        started = time.perf_counter()
        after = helper.start(problem, sleeps_in_helper, 0.0)  # answered after the skipped
        assert helper.result(problem, after, 30)[0] == helper._HELPER.process.pid
        assert time.perf_counter() - started < 1.0  # not 3 x 0.4 s of withdrawn plans
        assert not helper._HELPER.waiting and not helper._HELPER.answers
        assert not helper._HELPER.withdrawn  # every one answered (empty) and forgotten
    assert batch_rows(plans) == batch_rows(here)


def test_while_the_helper_builds_the_plan_asked_for_the_next_is_built_here(monkeypatch):
    """The plan asked for is under way in the helper: this process builds the next one's
    meanwhile (remembered only when asked for), waits for the helper's, and builds the
    rest; a candidate dropped meanwhile is dropped with its plan."""
    monkeypatch.setattr(helper, "planned", slow_planned)  # the helper is forked with it
    batch, here, built, objective = built_ahead_setup(monkeypatch, 4)
    problem = objective.problem
    with helper.helping(problem, True):
        objective.build_ahead(batch)
        time.sleep(0.1)  # the helper is on the first
        first = objective.plan(batch[0])
        assert built == [batch[1].key()] and objective.taken_ahead == 1
        assert set(objective.early) == {batch[1].key()} and batch[1].key() not in objective.cache
        second = objective.plan(batch[1])  # the one built meanwhile
        assert built == [batch[1].key()] and not objective.early
        objective.build_ahead([])  # nothing more
        third = objective.plan(batch[2])
        assert built == [batch[1].key(), batch[2].key()]
    assert batch_rows([first, second, third]) == batch_rows(here[:3])
    dropped = Objective(problem_on("h100x8-a100x8"), multi_objective=False, beside=True)
    dropped.early[batch[3].key()] = here[3]
    dropped.drop_ahead(batch[3])
    assert not dropped.early


def test_while_the_helper_builds_the_last_plan_built_ahead_the_candidates_after_it_are_shared(
    monkeypatch,
):
    """`guess` on the one plan built ahead while the helper is at it: the candidates after it
    are built meanwhile, here from the front and in the helper from the back once it is done
    (`evaluate_batch` queued behind it), each kept aside, not remembered, until asked for;
    every plan is the one this process would build."""
    from hexiseq.search import objective as objective_module

    monkeypatch.setattr(helper, "planned", slow_planned)  # the helper is forked with it
    batch, here, built, objective = built_ahead_setup(monkeypatch, 4)
    counting = objective_module.plan_for_choices

    def slow_here(problem, choices):  # this process's builds only (the helper has its own)
        time.sleep(1.0)  # time for the helper to finish the one ahead and build two more
        return counting(problem, choices)

    monkeypatch.setattr(objective_module, "plan_for_choices", slow_here)
    problem = objective.problem
    with helper.helping(problem, True):
        objective.build_ahead(batch[:1])
        time.sleep(0.1)  # the helper is on it
        objective.guess(batch[0], lambda: batch[1:])
        assert objective.taken_ahead == 1 and set(objective.cache) == {batch[0].key()}
        assert set(objective.early) == {choices.key() for choices in batch[1:]}
        assert built == [batch[1].key()]  # the other two were the helper's
        plans = [objective.plan(choices) for choices in batch]
        assert not objective.early and built == [batch[1].key()]
    assert batch_rows(plans) == batch_rows(here)


@pytest.mark.parametrize("gpus, count", [(32, 4), (16, 4)])
def test_a_search_with_plans_built_ahead_reports_what_one_without_its_helper_does(
    monkeypatch, gpus, count
):
    """planner_scaling's cells where the descents stay here and the helper builds the picks
    meanwhile: the same best plan, trials, baselines and replicas as a search without its
    helper."""
    from hexiseq.search import objective as objective_module
    from hexiseq.search import shortlist as shortlist_module

    types = ["H100-SXM", "A100-80G", "H200", "L40S"][:count]
    cluster = planner_scaling_cluster(gpus, types)
    taken = []
    drop = Objective.drop_ahead
    descended = shortlist_module._descended

    def recording(self, choices=None):
        if choices is None:  # the short list is done
            taken.append(self.taken_ahead)
        return drop(self, choices)

    def slow_descent(problem, starts):  # time for the helper to build every pick ahead
        time.sleep(0.5)
        return descended(problem, starts)

    monkeypatch.setattr(Objective, "drop_ahead", recording)
    monkeypatch.setattr(shortlist_module, "_descended", slow_descent)
    # sent even behind the baselines, however long they take this machine
    monkeypatch.setattr(objective_module, "has_helper", lambda problem: True)
    found = describe(plan_search(cluster, "llama3-8b", "1M"))
    assert taken[0] >= 3  # the picks' plans are the helper's
    monkeypatch.setattr(helper, "safe_to_fork", lambda: False)
    helper._stop()
    assert describe(plan_search(cluster, "llama3-8b", "1M")) == found
    assert taken[1] == 0
