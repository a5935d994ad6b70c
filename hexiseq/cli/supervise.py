"""`hexiseq run --replan`: train a plan under a supervisor that plans again when the cluster
changes under it, and goes on from the same step.

The supervisor launches the plan's ranks on this machine (torch elastic's launcher, in this
process, so it learns how each rank ended) with checkpoints every `--checkpoint-every` steps
and its run folder for reports (`hexiseq.supervision`). Two things make it re-plan:

- **drift**: the runtime times every rank's compute against the plan's prediction
  (`runtime._drift`; CPU ranks by thread CPU time, GPU ranks by CUDA events); when a rank
  stays `--drift-threshold` times slower than at its start, rank 0 reports it and waits. The
  supervisor plans again on the cluster as measured (`search.replan`, well under a second)
  and answers: re-plan when the new plan is predicted `--min-gain` times faster, else keep
  (the ranks take their present speed as the new start). On "re-plan" the ranks save a
  checkpoint after that step and take the new plan over in place (same ranks, work moved):
  each builds the new plan's model, loads the checkpoint resharded to its new shares
  (`runtime.checkpoint`) and trains on from the next step, with no restart.
- **a lost device**: a rank killed outright (by a signal other than the launcher's own
  SIGTERM: SIGKILL, a segfault) ends the launch; the supervisor plans again without it and
  launches the new plan on the ranks left, from the newest checkpoint (the steps since it run
  again on the same tokens).

No step is skipped. Each re-plan goes to the store (`Store.save_replan`) with why, both plans,
the predicted gain, and the measured one once the new plan has run. Injected faults
(`--inject-slowdown`, `--inject-failure`) follow their device across re-plans, whatever rank it
gets.

Over several nodes (`--node-rank K`): `hexiseq.cli.supervise_nodes`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hexiseq import supervision
from hexiseq.errors import HexiseqError, InfeasibleError, InputError
from hexiseq.injections import FailureInjection, SlowdownInjection, check_ranks
from hexiseq.plan import Plan

if TYPE_CHECKING:
    from hexiseq.costmodel.base import CostModel
    from hexiseq.search.replan import Replanned

MAX_LAUNCHES = 9
"""Launches one run may make (a lost device each) before the supervisor stops."""
POLL_S = 0.02


@dataclass
class Fleet:
    """The run's devices: which original rank (of the first plan) each present rank is, and
    the faults injected into them, kept by original rank."""

    original: list[int]
    slowdowns: list[SlowdownInjection]
    failures: list[FailureInjection]

    def renumber(self, rank_map: dict[int, int]) -> None:
        """The ranks of a new plan: present rank r became `rank_map[r]` (lost ones: none)."""
        moved = [0] * len(rank_map)
        for old, new in rank_map.items():
            moved[new] = self.original[old]
        self.original = moved

    def present(self, original: int) -> int | None:
        """The present rank of original rank `original` (None: lost)."""
        return self.original.index(original) if original in self.original else None

    def injections(self) -> list[str]:
        """The train flags of the faults of the devices still present, in present ranks."""
        flags = []
        for s in self.slowdowns:
            rank = self.present(s.rank)
            if rank is not None:
                flags.append(f"--inject-slowdown={rank}:{s.factor!r}@{s.step}")
        for f in self.failures:
            rank = self.present(f.rank)
            if rank is not None:
                flags.append(f"--inject-failure={rank}@{f.step}")
        return flags

    def visible_devices(self, environ: dict[str, str]) -> str | None:
        """`CUDA_VISIBLE_DEVICES` for the devices still present (local rank r is the GPU of
        original rank `original[r]`); None while none was lost."""
        if self.original == list(range(len(self.original))):
            return None
        listed = environ.get("CUDA_VISIBLE_DEVICES")
        visible = listed.split(",") if listed else [str(i) for i in range(max(self.original) + 1)]
        return ",".join(visible[o] for o in self.original)


@dataclass(frozen=True)
class Change:
    """Why the supervisor re-planned."""

    reason: str  # "drift" or "lost"
    detail: str
    factors: dict[int, float]  # drift: old rank -> measured factor
    lost: tuple[int, ...]
    measured_before_s: float | None


@dataclass(frozen=True)
class Taken:
    """A re-plan on drift, handed to the ranks while they trained."""

    change: Change
    old: Plan
    replanned: Replanned
    step: int
    """The first step the new plan runs."""


@dataclass
class Watcher:
    """Answers the ranks' drift reports while they train (a thread of the supervisor): plans
    again on the cluster as measured and, when that is worth it, writes the new plan beside
    the decision, which the ranks take over in place (same world, work moved). `plan` is the
    plan as measured so far: a drift that is kept still counts in the next re-plan."""

    folder: Path
    """The launch's folder the ranks report to."""
    plans: Path
    """Where new plans are written."""
    plan: Plan
    cost: CostModel
    min_gain: float
    names: Iterator[str]
    """Names for the plans it makes."""
    remember: Callable[[Plan], None] = lambda plan: None
    """Saves a plan it hands over (to the store: its runs then compare with it)."""
    taken: list[Taken] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        self._stop.clear()
        thread = threading.Thread(target=self._run, name="hexiseq-drift-watcher", daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for path in sorted(self.folder.glob("drift-*.json")):
                if path.name not in self.answered:
                    self.answered.add(path.name)
                    self._answer_safely(path)
            time.sleep(POLL_S)

    def _answer_safely(self, path: Path) -> None:
        """Answer a report; whatever goes wrong, the ranks get "keep" rather than a wait."""
        try:
            self._answer(path)
        except Exception as error:  # the thread must live on: the ranks wait for an answer
            print(f"hexiseq run: could not re-plan after {path.name} ({type(error).__name__}: "
                  f"{error}); keeping the plan", file=sys.stderr)  # fmt: skip
            step = int(path.stem.removeprefix("drift-"))
            supervision.claim_json(
                supervision.decision_path(self.folder, step), {"action": "keep"}
            )

    def _answer(self, path: Path) -> None:
        from hexiseq.search.replan import replan

        drift = supervision.read_json(path)
        step = int(drift["step"])
        factors = {int(rank): float(factor) for rank, factor in drift["factors"].items()}
        replanned = replan(self.plan, self.cost, slowdowns=factors, name=next(self.names))
        decision = {"action": "keep"}
        if replanned.worth_it(self.min_gain):
            plan_path = self.plans / f"plan-{len(list(self.plans.glob('plan-*.json')))}.json"
            replanned.plan.to_json(plan_path)
            self.remember(replanned.plan)  # before the ranks record their run of it
            decision = {"action": "replan", "plan": str(plan_path.resolve())}
        if not supervision.claim_json(supervision.decision_path(self.folder, step), decision):
            return  # rank 0 gave up waiting and kept the plan
        print(
            f"hexiseq run: drift at step {step} ({_describe(factors)}); re-planned in "
            f"{replanned.planning_s:.2f} s, predicted {replanned.predicted_gain:.2f}x: "
            f"{decision['action']}",
            flush=True,
        )
        if decision["action"] == "keep":  # the ranks run on as measured: so does the plan
            measured = self.plan.cluster.with_measured_slowdowns(factors)
            self.plan = dataclasses.replace(self.plan, cluster=measured)
            return
        detail = f"step {step}: {_describe(factors)} than at its start"
        before = measured_step_s(self.folder, self.plan.name, step)
        change = Change("drift", detail, factors, (), before)
        self.taken.append(Taken(change, self.plan, replanned, step + 1))
        self.plan = replanned.plan


def _describe(factors: dict[int, float]) -> str:
    return ", ".join(
        f"rank {r} {f:.2f}x {'slower' if f >= 1 else 'faster'}" for r, f in sorted(factors.items())
    )


def measured_step_s(folder: Path, plan_name: str, last_step: int, count: int = 2) -> float | None:
    """Median step time of the `count` steps of `plan_name` up to `last_step` (None: none)."""
    times = [
        entry["step_time_s"]
        for entry in supervision.read_steps(folder)
        if entry.get("plan") == plan_name and last_step - count < entry["step"] <= last_step
    ]
    return statistics.median(times) if times else None


def measured_after_s(folder: Path, plan_name: str) -> float | None:
    """Median step time of `plan_name`'s steps after its first (which warms up)."""
    times = [
        e["step_time_s"] for e in supervision.read_steps(folder) if e.get("plan") == plan_name
    ]
    return statistics.median(times[1:]) if len(times) > 1 else None


def ran(folder: Path, plan_name: str) -> bool:
    """Whether a step of `plan_name` is in the run's step logs."""
    return any(entry.get("plan") == plan_name for entry in supervision.read_steps(folder))


def supervise(args: argparse.Namespace, plan: Plan, environment: dict[str, str]) -> int:
    """The supervised run (see the module docstring), its ranks seeing `environment` (the
    store URL, the launch id); returns the exit code."""
    from hexiseq.cli.run import fail_unended_runs
    from hexiseq.runtime.launcher import launch  # torch: the ranks need it anyway
    from hexiseq.store import LAUNCH_ID_ENV

    if args.node_rank is not None:
        from hexiseq.cli.supervise_nodes import supervise_nodes

        return supervise_nodes(args, plan, environment)
    launch_id = environment[LAUNCH_ID_ENV]
    folder = run_folder(args, plan, launch_id)
    cost = replan_cost_model(args, plan)
    fleet = Fleet(list(range(plan.cluster.world_size)), args.inject_slowdown, args.inject_failure)
    names = map(f"{plan.name}-replan{{}}".format, itertools.count(1))  # the first plan's name
    print(f"hexiseq run: supervising '{plan.name}'; run folder {folder}", flush=True)
    plan_path = folder / "plan-0.json"
    plan.to_json(plan_path)
    remember_plan(args, plan, "run")
    remember = functools.partial(remember_plan, args, label="replan")
    recorded: list[tuple[int | None, str]] = []  # re-plans whose measured step is still due
    last_loss_step = None
    for launch_index in range(MAX_LAUNCHES):
        exchange = supervision.launch_folder(folder, launch_index)
        exchange.mkdir()
        watcher = Watcher(exchange, folder, plan, cost, args.min_gain, names, remember)
        thread = watcher.start()
        arguments = launch_arguments(args, plan_path, folder, exchange, fleet, launch_index > 0)
        try:
            with ranks_environment(environment, fleet.visible_devices(environment)):
                outcome = launch(arguments, plan.cluster.world_size, launch_id)
        finally:
            watcher.stop(thread)
        record_taken(args, launch_id, watcher, folder, recorded)
        plan = watcher.plan  # as measured, with what it took over
        if not outcome.lost:
            return outcome.code
        step = resume_step(folder)
        if step == last_loss_step:
            print(f"hexiseq run: ranks lost again before step {step} ran: stopping "
                  "(a fault of the software, not of a device?)", file=sys.stderr)  # fmt: skip
            return outcome.code
        last_loss_step = step
        fail_unended_runs(args, launch_id, f"rank(s) {_ranks(outcome.lost)} lost (killed)")
        detail = ", ".join(device_label(plan, r) for r in outcome.lost) + " lost"
        replanned = replan_lost(plan, cost, outcome.lost, next(names))
        print(
            f"hexiseq run: re-planned ({detail}) -> '{replanned.plan.name}' on "
            f"{replanned.plan.cluster.world_size} ranks "
            f"(searched in {replanned.planning_s:.2f} s)",
            flush=True,
        )
        plan_path = folder / f"plan-{len(list(folder.glob('plan-*.json')))}.json"
        replanned.plan.to_json(plan_path)
        remember(replanned.plan)
        change = Change("lost", detail, {}, outcome.lost, None)
        replan_id = record_replan(args, launch_id, plan, replanned, change, step)
        recorded.append((replan_id, replanned.plan.name))
        fleet.renumber(replanned.rank_map)
        plan = replanned.plan
    print(f"hexiseq run: stopped after {MAX_LAUNCHES} launches", file=sys.stderr)
    return 1


@contextmanager
def ranks_environment(environment: dict[str, str], visible: str | None) -> Iterator[None]:
    """This process's environment set to what the ranks must see while a launch runs (the
    launcher passes its own to them): `environment`, one intra-op thread per rank unless told
    otherwise (as torchrun does: ranks sharing a machine's cores would oversubscribe them),
    and `visible`, the GPUs still present when some were lost (their CUDA indices; None:
    all). Restored after."""
    before = dict(os.environ)
    wanted = {"OMP_NUM_THREADS": "1", **environment}
    if visible is not None:
        wanted["CUDA_VISIBLE_DEVICES"] = visible
    os.environ.update(wanted)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def run_folder(args: argparse.Namespace, plan: Plan, launch_id: str) -> Path:
    """The run's folder (made, and empty: a folder of an earlier run would mix its
    checkpoints and steps into this one's), after the checks that need no launch."""
    check_supervised(args, plan)
    folder = Path(args.run_dir or f"hexiseq-run-{launch_id[:8]}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        held = any(folder.iterdir())
    except OSError as error:
        raise InputError(
            f"--run-dir {folder}: cannot make the run folder ({error.strerror})"
        ) from None
    if held:
        raise InputError(
            f"--run-dir {folder} holds files already (an earlier run's?): give a new or empty "
            "folder"
        )
    return folder


def check_supervised(args: argparse.Namespace, plan: Plan) -> None:
    """What a supervised run needs that no launch has to show: sharded states, faults in
    ranks the plan has, a torch that checkpoints; InputError otherwise."""
    if args.state_sharding == "replicated":
        raise InputError(
            "--replan checkpoints and reshards sharded model states: it cannot go with "
            "--state-sharding replicated"
        )
    problem = check_ranks([*args.inject_slowdown, *args.inject_failure], plan.cluster.world_size)
    if problem is not None:
        raise InputError(problem)
    from hexiseq.runtime.launcher import checkpoint_support_error  # torch: the run needs it

    if (problem := checkpoint_support_error()) is not None:
        raise InputError(problem)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def device_label(plan: Plan, rank: int) -> str:
    device = plan.cluster.devices[rank]
    return f"rank {rank} ({device.node} #{device.local_rank}, {device.gpu})"


def launch_arguments(
    args: argparse.Namespace,
    plan_path: Path,
    folder: Path,
    exchange: Path,
    fleet: Fleet,
    resume: bool,
) -> list[str]:
    """The runtime's flags for one launch of the supervised run: `hexiseq run`'s own, with
    this launch's plan, faults in present ranks, checkpoints and drift reports."""
    from hexiseq.cli.run import train_flags

    plain = argparse.Namespace(**{**vars(args), "inject_slowdown": [], "inject_failure": []})
    return [
        *train_flags(plain, plan_path),
        *fleet.injections(),
        f"--checkpoint-dir={folder / 'checkpoints'}",
        f"--checkpoint-every={args.checkpoint_every}",
        *(["--resume"] if resume else []),
        f"--replan-dir={exchange}",
        f"--drift-threshold={args.drift_threshold!r}",
    ]


def replan_cost_model(args: argparse.Namespace, plan: Plan) -> CostModel:
    """The cost model re-plans use: the store's newest fit for the plan's GPU types where it
    has one, the datasheet elsewhere (`--cost-model`). The store is the one the ranks write
    to (created as they would create it)."""
    from hexiseq.costmodel.datasheet import DatasheetCostModel
    from hexiseq.search.predict import resolve_cost_model
    from hexiseq.store import Store, store_url_from

    if args.cost_model == "datasheet" or (args.no_store and args.cost_model == "auto"):
        return DatasheetCostModel()
    if args.no_store:
        raise InputError("--cost-model fitted reads the store's fits: not with --no-store")
    with Store.open(store_url_from(args.store)) as store:
        return resolve_cost_model(args.cost_model, store, plan.cluster.gpu_types)


def replan_lost(plan: Plan, cost: CostModel, lost: tuple[int, ...], name: str) -> Replanned:
    """The plan on the devices left; InfeasibleError (exit 3) when nothing fits there."""
    from hexiseq.search.replan import replan

    try:
        return replan(plan, cost, lost=lost, name=name)
    except InfeasibleError as error:
        message = f"after losing rank(s) {_ranks(lost)}: {error}"
        raise InfeasibleError(message, error.missing_bytes) from None


def resume_step(folder: Path) -> int:
    """The step the next launch starts at: its newest checkpoint's (0: none yet)."""
    from hexiseq.runtime.checkpoint import latest_checkpoint

    found = latest_checkpoint(folder / "checkpoints")
    return 0 if found is None else found[0]


def remember_plan(args: argparse.Namespace, plan: Plan, label: str) -> None:
    """`plan` in the store's plans under `label` unless saved already, so that the runs of
    it compare measured with predicted."""
    if args.no_store:
        return
    from hexiseq.store import Store

    try:
        with Store.open(args.store) as store:
            if store.find_plan_id(plan.to_json_text()) is None:
                store.save_plan_object(plan, label=label)
    except HexiseqError as error:
        print(f"hexiseq run: could not save plan '{plan.name}': {error}", file=sys.stderr)


def record_replan(
    args: argparse.Namespace,
    launch_id: str,
    plan: Plan,
    replanned: Replanned,
    change: Change,
    step: int,
) -> int | None:
    """The re-plan's row in the store (None: no store, or it failed, which is said)."""
    if args.no_store:
        return None
    from hexiseq.store import Replan, Store

    try:
        record = Replan(
            launch_id=launch_id,
            step=step,
            reason=change.reason,
            detail=change.detail,
            old_plan_json=plan.to_json_text(),
            new_plan_json=replanned.plan.to_json_text(),
            measured_slowdowns=change.factors,
            lost_ranks=change.lost,
            predicted_old_step_s=replanned.predicted_old_step_s,
            predicted_new_step_s=replanned.predicted_new_step_s,
            planning_s=replanned.planning_s,
            measured_before_step_s=change.measured_before_s,
        )
        with Store.open(args.store) as store:
            return store.save_replan(record)
    except HexiseqError as error:
        print(f"hexiseq run: could not record the re-plan: {error}", file=sys.stderr)
        return None


def record_taken(
    args: argparse.Namespace,
    launch_id: str,
    watcher: Watcher,
    folder: Path,
    recorded: list[tuple[int | None, str]],
) -> None:
    """The drift re-plans the ranks took over in place (those whose plan ran) to the store,
    and each earlier re-plan's measured step once its plan has run."""
    for taken in watcher.taken:
        if ran(folder, taken.replanned.plan.name):
            replan_id = record_replan(args, launch_id, taken.old, taken.replanned,
                                      taken.change, taken.step)  # fmt: skip
            recorded.append((replan_id, taken.replanned.plan.name))
    record_measured_after(args, recorded, folder)


def record_measured_after(
    args: argparse.Namespace, replans: list[tuple[int | None, str]], folder: Path
) -> None:
    """Each re-plan's measured step time once its plan has run; done ones leave the list."""
    if args.no_store:
        return
    from hexiseq.store import Store

    for entry in list(replans):
        replan_id, name = entry
        after = measured_after_s(folder, name)
        if replan_id is None or after is None:
            continue
        try:
            with Store.open(args.store) as store:
                store.set_replan_measured_after(replan_id, after)
        except HexiseqError as error:
            print(f"hexiseq run: could not record a re-plan's measured step: {error}",
                  file=sys.stderr)  # fmt: skip
        replans.remove(entry)
