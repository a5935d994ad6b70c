"""Train a plan's model with its CP-HP layout under torchrun, measuring every rank's steps.

    torchrun --nproc-per-node N -m hexiseq.runtime.train --plan plan.json --steps K [--store URL]

Loads the `Plan`, checks the world size against it, builds the plan's model (seeded, the same
on every rank) over `CPHPAttention` of the rank's mesh on CPU (gloo) or CUDA (NCCL), draws
random tokens (seeded per step), runs K AdamW steps and records one row per rank per step in
the store (`runtime_runs` / `runtime_measurements`), written by rank 0 after each step.

A plan of several data-parallel replicas (`Plan.replicas`): each replica is its own process
group running its own layout on its own sequences of the step (`replicas.join_mesh`); its
model states are sharded inside the replica in its ranks' shares, each rank's loss share is
its part of the mean over every sequence of the step, and after the backward the shards'
gradients are summed across replicas (`replicas.CrossReplicaReduction`; replicated states:
one all-reduce over the world) before AdamW.

What is measured (per rank, per step):
- step_time_s: barrier -> barrier around the whole step (forward, backward, gradient
  all-reduce, optimizer): the step as the domain sees it, the same on every rank up to the
  barrier's skew. On CPU perf_counter; on CUDA events recorded after the opening barrier and
  after the closing one (read after synchronizing).
- rank_time_s: from the opening barrier until this rank's optimizer step ended (before the
  closing barrier); it still includes waiting on peers inside collectives.
- peak_memory_bytes: CUDA `torch.cuda.max_memory_allocated` of that step (stats reset before
  it; tensors only, not the allocator's cache or the NCCL buffers): memory_measure
  "cuda_max_allocated". CPU: the process's peak resident set size since it started
  (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, KiB on Linux), which includes Python, torch
  and gloo: memory_measure "cpu_max_rss"; it never decreases from step to step.
- CUDA also: reserved_peak_bytes, `torch.cuda.max_memory_reserved` of the step (the caching
  allocator's pool at its largest), and outside_allocator_bytes, the device memory in use at
  the step's end that the allocator does not hold (total - free - `memory_reserved`: CUDA
  context, library workspaces, NCCL buffers): together what the device held, against the
  memory model's peak with its reserve.
- Model states: sharded over all ranks in the plan's `state_fraction`s, even or not, FP32
  master shards with the model computing in the compute dtype (`sharding`); the model is
  built on the meta device and each rank draws only its shards' initial values.
  `--state-sharding replicated` keeps FP32 weights whole on every rank, computes under
  autocast and all-reduces the gradients (a reference mode; the memory model does not
  count it).
- Emulated slowdown k of the rank's device (cluster `emulation_slowdown`): the rank sleeps
  (k - 1) x each compute phase (`_emulation`); rows are labelled as emulation.

Under `hexiseq run --replan` (flags set by its supervisor, `hexiseq/cli/supervise.py`): a
checkpoint every `--checkpoint-every` steps in `--checkpoint-dir` (`checkpoint`; `--resume`
starts from the newest, resharded to this plan's shares, at its step); every rank's compute
measured against the plan's prediction (`_drift`) and a drift reported to the supervisor
through `--replan-dir`, whose "replan" hands over a new plan: every rank checkpoints, builds
the new plan's model and loads the checkpoint into it, resharded, and goes on from the next
step in this process; injected faults (`--inject-slowdown`, `--inject-failure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import math
import os
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hexiseq import supervision
from hexiseq.errors import HexiseqError, InputError
from hexiseq.injections import (
    FailureInjection,
    SlowdownInjection,
    add_injection_arguments,
    check_ranks,
)
from hexiseq.plan import Plan
from hexiseq.runtime._drift import Drift, DriftMonitor
from hexiseq.runtime._elementwise import compile_elementwise
from hexiseq.runtime._emulation import ComputePadding, GpuPhases
from hexiseq.runtime._startup import (  # noqa: F401 (check_world_size, placement_error: API)
    FoundDevice,
    check_world_size,
    placement_error,
    rank_start_error,
)
from hexiseq.runtime._torch_profile import profiled_step
from hexiseq.runtime.attention import CPHPAttention
from hexiseq.runtime.kernels import take_used_kernels
from hexiseq.runtime.loss import (
    all_reduce_gradients,
    chunked_next_token_loss,
    next_token_labels,
)
from hexiseq.runtime.model import (
    LlamaModel,
    build_model,
    token_positions,
    use_autograd_elementwise,
)
from hexiseq.runtime.replicas import CrossReplicaReduction, Mesh, join_mesh, plan_mesh
from hexiseq.runtime.sharding import (
    LEGACY_STATE_SHARDING,
    STATE_SHARDING,
    canonical_state_sharding,
    shard_model_states,
)
from hexiseq.store import (
    LAUNCH_ID_ENV,
    STORE_URL_HELP,
    RuntimeMeasurement,
    Store,
    store_url_from,
)

EXIT_BAD_INPUT = 2
KEEP_CHECKPOINTS = 2
"""Checkpoints a run keeps: the newest to resume from, and the one before it."""
# The caching allocator grows mapped segments instead of splitting fixed ones: the default left
# 9 GiB reserved but unallocated when the shared H100 run of llama3.2-3b at 16K tokens died,
# and the same plan ran with this setting (costmodel.memory counts a small fragmentation).
EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class TrainOptions:
    plan_path: str
    steps: int
    store_url: str | None
    seed: int
    learning_rate: float
    device: str  # "auto", "cpu" or "cuda"
    dtype: str  # "auto", "float32" or "bfloat16"
    state_sharding: str = "sharded"  # or "replicated" (gradient all-reduce)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0: only when leaving to re-plan
    resume: bool = False  # start from the newest checkpoint in checkpoint_dir, if any
    replan_dir: str | None = None  # the supervisor's folder (`hexiseq.supervision`)
    drift_threshold: float = supervision.DEFAULT_DRIFT_THRESHOLD
    slowdowns: tuple[SlowdownInjection, ...] = ()
    failures: tuple[FailureInjection, ...] = ()
    torch_profile: str | None = None  # write the last step's torch.profiler table here
    compile_elementwise: bool = False  # torch.compile RMSNorm's and SwiGLU's math

    @property
    def watches_drift(self) -> bool:
        return self.replan_dir is not None


@dataclass
class RankContext:
    """What this rank runs on and how it is labelled."""

    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    device_label: str
    slowdown: float
    mesh: Mesh | None = None
    """This rank's replica (`replicas.join_mesh`); None: the plan is one mesh."""

    @classmethod
    def cpu(
        cls,
        rank: int,
        world_size: int,
        compute_dtype: torch.dtype = torch.float32,
        mesh: Mesh | None = None,
    ) -> RankContext:
        """A rank on the CPU at normal speed (the memory probe and tests)."""
        return cls(rank, world_size, torch.device("cpu"), compute_dtype, "cpu", 1.0, mesh)

    def mesh_of(self, plan: Plan) -> Mesh:
        return self.mesh if self.mesh is not None else plan_mesh(plan, self.rank)

    @property
    def emulation_label(self) -> str:
        if self.slowdown == 1.0:
            return "none"
        return f"emulated {self.slowdown:g}x slower (compute padded by sleeping)"


def parse_args(argv: Sequence[str] | None = None) -> TrainOptions:
    parser = argparse.ArgumentParser(
        prog="hexiseq.runtime.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--plan", required=True, metavar="PATH", help="plan JSON file")
    parser.add_argument("--steps", type=int, default=5, metavar="K", help="training steps")
    parser.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store {STORE_URL_HELP}; `hexiseq run` sets the environment, "
        "so no password shows in a command line",
    )
    parser.add_argument("--no-store", action="store_true", help="record nothing")
    parser.add_argument("--seed", type=int, default=0, help="parameter and token seed")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute dtype (FP32 master weights, gradient reduction and AdamW states either "
        "way); auto = the plan's precision (`hexiseq plan --precision`)",
    )
    parser.add_argument(
        "--state-sharding",
        choices=(*STATE_SHARDING, *LEGACY_STATE_SHARDING),
        default="sharded",
        help="sharded: parameters, gradients and AdamW states split over the ranks in the "
        "plan's state fractions (what the memory model counts; 'fsdp2' is its former name); "
        "replicated: every rank holds all, gradients all-reduced",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile RMSNorm's and SwiGLU's math (fused kernels, the same saved "
        "tensors, so the same memory); off by default: measure it (benchmarks/runtime_gpu.py "
        "--compile)",
    )
    parser.add_argument(
        "--torch-profile",
        metavar="PATH",
        help="profile the last step with torch.profiler and write its operator table "
        "(self device time first) to PATH, or its Chrome trace when PATH ends in .json or "
        ".json.gz (rank r > 0: PATH.rank<r>)",
    )
    _add_supervision_flags(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")
    if args.torch_profile and not Path(args.torch_profile).parent.is_dir():
        parser.error(f"--torch-profile: no folder {Path(args.torch_profile).parent} to write into")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be 0 or more (got {args.checkpoint_every})")
    if not args.drift_threshold > 1:
        parser.error(f"--drift-threshold must be > 1 (got {args.drift_threshold})")
    if (args.resume or args.checkpoint_every or args.replan_dir) and not args.checkpoint_dir:
        parser.error("--resume, --checkpoint-every and --replan-dir need --checkpoint-dir")
    return TrainOptions(
        plan_path=args.plan,
        steps=args.steps,
        store_url=None if args.no_store else store_url_from(args.store),
        seed=args.seed,
        learning_rate=args.lr,
        device=args.device,
        dtype=args.dtype,
        state_sharding=canonical_state_sharding(args.state_sharding),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        replan_dir=args.replan_dir,
        drift_threshold=args.drift_threshold,
        slowdowns=tuple(args.inject_slowdown),
        failures=tuple(args.inject_failure),
        torch_profile=args.torch_profile,
        compile_elementwise=args.compile,
    )


def _add_supervision_flags(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, drift reports to a supervisor, and injected faults (`hexiseq run`)."""
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="folder of this run's distributed checkpoints (`runtime.checkpoint`)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="save a checkpoint every K steps (0: only before leaving to re-plan)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest checkpoint in --checkpoint-dir (resharded to this plan)",
    )
    parser.add_argument(
        "--replan-dir",
        metavar="DIR",
        help="report drift to the supervisor through DIR and follow its decision "
        "(`hexiseq.supervision`; set by `hexiseq run --replan`)",
    )
    parser.add_argument(
        "--drift-threshold",
        type=float,
        default=supervision.DEFAULT_DRIFT_THRESHOLD,
        metavar="X",
        help="a rank drifted when its compute stays X times its start",
    )
    add_injection_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun; returns the exit code (2 for bad input, on every rank)."""
    options = parse_args(argv)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = allocator_settings(
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    )
    try:
        plan = Plan.from_json(options.plan_path)
        check_rank_start(plan, options)
    except HexiseqError as error:
        print(f"hexiseq.runtime.train: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    context = init_rank(plan, options)
    try:
        return train(plan, options, context)
    except HexiseqError as error:  # a bad plan or decision handed over mid-run
        print(f"hexiseq.runtime.train: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        dist.destroy_process_group()


def cuda_reserved_bytes(device: torch.device) -> tuple[int, int]:
    """(the allocator's reserved peak since the stats were reset, the device memory in use now
    outside the allocator's pool)."""
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    return int(torch.cuda.max_memory_reserved(device)), int(max(outside, 0))


def allocator_settings(current: str) -> str:
    """`PYTORCH_CUDA_ALLOC_CONF` with expandable segments on, unless the user chose either
    way (set before CUDA starts, so it applies however the run was launched)."""
    if "expandable_segments" in current:
        return current
    return f"{current},{EXPANDABLE_SEGMENTS}" if current else EXPANDABLE_SEGMENTS


def uses_cuda(options: TrainOptions) -> bool:
    return options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())


def local_rank_of(environ: Mapping[str, str]) -> int:
    return int(environ.get("LOCAL_RANK", "0"))


def check_rank_start(plan: Plan, options: TrainOptions) -> None:
    """Before any communication: this rank is where the plan puts it (`rank_start_error`),
    on CUDA on the planned GPU type; InputError (one line) otherwise."""
    error = rank_start_error(plan, os.environ)
    if error is None:
        error = check_ranks([*options.slowdowns, *options.failures], plan.cluster.world_size)
    if error is None and options.slowdowns and uses_cuda(options):
        error = (
            "--inject-slowdown emulates a slower device by sleeping, on CPU ranks only (a GPU's "
            "kernel timer would not see the sleep); give --device cpu"
        )
    if error is None and uses_cuda(options):
        error = rank_start_error(plan, os.environ, found_cuda_device(local_rank_of(os.environ)))
    if error is not None:
        raise InputError(error)


def found_cuda_device(local_rank: int) -> FoundDevice:
    """The driver's name and memory of cuda:`local_rank`, if this machine has it."""
    devices_here = torch.cuda.device_count()
    if local_rank >= devices_here:
        return FoundDevice("", 0.0, devices_here)
    memory_GiB = torch.cuda.get_device_properties(local_rank).total_memory / 2**30
    return FoundDevice(torch.cuda.get_device_name(local_rank), memory_GiB, devices_here)


def init_rank(plan: Plan, options: TrainOptions) -> RankContext:
    """Join the process group (gloo on CPU, NCCL on CUDA) and pick this rank's device."""
    use_cuda = uses_cuda(options)
    if use_cuda:
        local_rank = local_rank_of(os.environ)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    planned = plan.cluster.devices[rank]
    actual = torch.cuda.get_device_name(device) if use_cuda else "cpu"
    planned_dtype = "float32" if plan.train.compute_dtype_bytes == 4 else "bfloat16"
    dtype = planned_dtype if options.dtype == "auto" else options.dtype
    return RankContext(
        rank=rank,
        world_size=dist.get_world_size(),
        device=device,
        compute_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32,
        device_label=f"{actual} (plan: {planned.gpu})",
        slowdown=float(planned.emulation_slowdown),
        mesh=join_mesh(plan, rank),
    )


def train(plan: Plan, options: TrainOptions, context: RankContext) -> int:
    """K AdamW steps of the plan, measured and recorded; returns the exit code. Each plan
    run is a row of its own: "finished", or "replanned" when the supervisor handed over a new
    plan at a step (then the ranks go on with it in this process, from a checkpoint of that
    step, resharded), or "failed" with why when any step raised on this rank (rank 0 records
    it; a rank that died shows there as the collective it broke)."""
    first_step = resume_step(options)
    while True:
        store, run_id = open_run(plan, options, context, first_step)
        try:
            handover = run_steps(plan, options, context, store, run_id, first_step)
        except BaseException as error:
            end_run(store, run_id, "failed", failure_of(error))
            raise
        else:
            end_run(store, run_id, "finished" if handover is None else "replanned")
        finally:
            if store is not None:
                store.close()
        if handover is None:
            return 0
        plan, first_step = take_over(handover, context), handover.step


@dataclass(frozen=True)
class Handover:
    """The supervisor's new plan (a file), to run from `step` on (its checkpoint saved)."""

    plan_path: str
    step: int


def take_over(handover: Handover, context: RankContext) -> Plan:
    """The new plan, checked and joined (collective: replicas make their process groups).
    The world stays: a drift re-plan moves work, never ranks."""
    plan = Plan.from_json(handover.plan_path)
    if plan.cluster.world_size != context.world_size:
        raise InputError(
            f"re-plan {handover.plan_path} is for {plan.cluster.world_size} ranks; this run has "
            f"{context.world_size}"
        )
    old = context.mesh
    context.mesh = join_mesh(plan, context.rank)
    if old is not None and old.group is not None:  # the old replica's group: not used again
        dist.destroy_process_group(old.group)
    return plan


def resume_step(options: TrainOptions) -> int:
    """The step this run starts at: the newest checkpoint's under `--resume`, else 0."""
    if not options.resume:
        return 0
    from hexiseq.runtime.checkpoint import latest_checkpoint  # see `save_plan_checkpoint`

    found = latest_checkpoint(options.checkpoint_dir)
    return 0 if found is None else found[0]


def run_steps(
    plan: Plan,
    options: TrainOptions,
    context: RankContext,
    store: Store | None,
    run_id: int | None,
    first_step: int = 0,
) -> Handover | None:
    """Build the plan's model and optimizer (from the newest checkpoint when not starting at
    step 0) and run, measure and record steps `first_step`..K-1; a `Handover` when the
    supervisor re-planned before the last."""
    sharded = options.state_sharding == "sharded"
    if options.compile_elementwise:
        compile_elementwise()
    model = build_plan_model(plan, context, options.seed, sharded)
    optimizer = build_optimizer(model, options.learning_rate, fused=sharded)
    if first_step > 0:
        from hexiseq.runtime.checkpoint import checkpoint_name, load_checkpoint

        path = Path(options.checkpoint_dir) / checkpoint_name(first_step)
        loaded = load_checkpoint(path, model, optimizer)
        if loaded != first_step:
            raise InputError(f"checkpoint {path} is of step {loaded}, not {first_step}")
    gpu = GpuPhases() if options.watches_drift and context.device.type == "cuda" else None
    padding = ComputePadding(model, context.slowdown, timed=options.watches_drift, gpu=gpu)
    try:
        with frozen_setup():
            return _steps(
                plan, options, context, store, run_id, first_step, model, optimizer, padding
            )
    finally:
        padding.remove()


def _steps(
    plan: Plan,
    options: TrainOptions,
    context: RankContext,
    store: Store | None,
    run_id: int | None,
    first_step: int,
    model: LlamaModel,
    optimizer: torch.optim.Optimizer,
    padding: ComputePadding,
) -> Handover | None:
    """`run_steps`' loop over the steps, the model built."""
    sharded = options.state_sharding == "sharded"
    monitor = drift_monitor(plan, options) if options.watches_drift else None
    mesh = context.mesh_of(plan)
    positions = token_positions(mesh.layout, mesh.local_rank).to(context.device)
    launcher_pid = os.getppid()
    for step in range(first_step, options.steps):
        check_launcher(launcher_pid)
        apply_injections(options, context, padding, step)
        device_s = padding.device_s
        profile_to = options.torch_profile if step == options.steps - 1 else None
        with profiled_step(profile_to, context.rank, context.device):
            measurement = measure_step(
                plan, options, context, model, optimizer, padding, positions, step, sharded
            )
        padding.settle()  # the step synchronized: its GPU phases are timed
        gathered = [None] * context.world_size
        dist.all_gather_object(gathered, (measurement, padding.device_s - device_s))
        rows = [row for row, _ in gathered]
        drift = None if monitor is None else monitor.observe(step, [b for _, b in gathered])
        if store is not None:
            store.add_runtime_measurements(run_id, rows)
        if context.rank == 0:
            print(describe_step(rows), flush=True)
            if options.replan_dir is not None:
                entry = step_entry(plan, rows, None if monitor is None else monitor.last_drift)
                supervision.append_step(options.replan_dir, entry)
        done = step + 1
        saved = done < options.steps and _checkpoint_due(options, done)
        if saved:
            save_plan_checkpoint(plan, options, context, model, optimizer, done)
        if drift is not None and done < options.steps:
            decision = ask_supervisor(options, context, drift)
            if decision["action"] == "replan":  # `supervision.read_decision`: with its plan
                if not saved:
                    save_plan_checkpoint(plan, options, context, model, optimizer, done)
                return Handover(decision["plan"], done)
            monitor.rebase()
    return None


def _checkpoint_due(options: TrainOptions, done: int) -> bool:
    return bool(options.checkpoint_every) and done % options.checkpoint_every == 0


def drift_monitor(plan: Plan, options: TrainOptions) -> DriftMonitor:
    """A monitor of every rank's compute against the plan's prediction (`_drift`)."""
    predicted = [rank.linear_s + rank.attention_s for rank in plan.predicted.ranks]
    slowed = [device.measured_slowdown > 1.0 for device in plan.cluster.devices]
    return DriftMonitor(predicted, slowed, options.drift_threshold)


def apply_injections(
    options: TrainOptions, context: RankContext, padding: ComputePadding, step: int
) -> None:
    """This rank's injected faults as of `step`: a slowdown from its step on (one given
    for an earlier step holds from the start of a resumed run); a failure at its step."""
    for failure in options.failures:
        if failure.rank == context.rank and failure.step == step:
            print(f"rank {context.rank}: injected failure at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    factor = math.prod(
        s.factor for s in options.slowdowns if s.rank == context.rank and s.step <= step
    )
    padding.set_slowdown(context.slowdown * factor)


def save_plan_checkpoint(
    plan: Plan,
    options: TrainOptions,
    context: RankContext,
    model: LlamaModel,
    optimizer: torch.optim.Optimizer,
    next_step: int,
) -> None:
    """A checkpoint to go on from `next_step` (collective); the first replica writes it, and
    rank 0 then removes all but the newest `KEEP_CHECKPOINTS`. (Imported here: DCP's
    safetensors storage needs a newer torch than a run that never checkpoints.)"""
    from hexiseq.runtime._checkpoint_files import prune_checkpoints
    from hexiseq.runtime.checkpoint import save_checkpoint

    writes = context.mesh_of(plan).index == 0
    save_checkpoint(options.checkpoint_dir, next_step, model, optimizer, writes=writes)
    if context.rank == 0:
        prune_checkpoints(options.checkpoint_dir, KEEP_CHECKPOINTS)


def ask_supervisor(options: TrainOptions, context: RankContext, drift: Drift) -> dict:
    """Rank 0 reports the drift and waits for the supervisor's decision ({"action": "keep"}
    or {"action": "replan", "plan": path}); every rank gets it, or the InputError a malformed
    one is (raised on every rank, so none waits on the others)."""
    decision: list[dict] = [{"action": "keep"}]
    if context.rank == 0:
        path = supervision.drift_path(options.replan_dir, drift.step)
        supervision.write_json(path, drift.to_dict())
        print(f"drift: {drift.describe()}; asking the supervisor", flush=True)
        try:
            decision[0] = wait_for_decision(options.replan_dir, drift.step)
        except InputError as error:
            decision[0] = {"action": "error", "why": str(error)}
    dist.broadcast_object_list(decision, src=0)
    if decision[0]["action"] == "error":
        raise InputError(decision[0]["why"])
    return decision[0]


def wait_for_decision(folder: str, step: int) -> dict:
    """The supervisor's decision on the drift of `step`; none within `DECISION_TIMEOUT_S`:
    rank 0 decides to keep the plan, unless the supervisor's answer lands first."""
    deadline = time.monotonic() + supervision.DECISION_TIMEOUT_S
    path = supervision.decision_path(folder, step)
    while time.monotonic() < deadline:
        answer = supervision.read_decision(path)
        if answer is not None:
            return answer
        time.sleep(0.02)
    if supervision.claim_json(path, {"action": "keep"}):
        print(f"no decision on the drift at step {step} in time: keeping the plan", flush=True)
        return {"action": "keep"}
    return supervision.read_decision(path)


def step_entry(
    plan: Plan, rows: list[RuntimeMeasurement], drift: Sequence[float] | None = None
) -> dict:
    """One line of the supervised run's step log; `drift`: each rank's relative drift at
    this step (`_drift.DriftMonitor.last_drift`), where the monitor has its baseline."""
    entry = {
        "step": rows[0].step,
        "loss": rows[0].loss,
        "step_time_s": max(row.step_time_s for row in rows),
        "plan": plan.name,
        "world_size": len(rows),
        "ended_unix_s": time.time(),  # wall clock: restarts between steps show in a benchmark
    }
    if drift is not None:
        entry["drift"] = [round(value, 4) for value in drift]
    return entry


def check_launcher(launcher_pid: int) -> None:
    """Stop this rank when the process that started it (torchrun's agent) is gone: a launcher
    killed outright (SIGKILL) cannot stop its ranks, which would otherwise train on, orphaned,
    until their last step. Rank 0 then records the run failed with this reason."""
    if os.getppid() != launcher_pid:
        raise RuntimeError(
            f"the launcher (pid {launcher_pid}) died; this rank stops instead of training on "
            "orphaned"
        )


def end_run(store: Store | None, run_id: int | None, status: str, failure: str | None = None):
    """Record the run's end in the store (rank 0); a store that fails here only says so, so
    that the error that ended the run is the one reported."""
    if store is None or run_id is None:
        return
    try:
        store.end_runtime_run(run_id, status, failure)
    except Exception as error:  # the store itself may be what failed
        print(f"hexiseq.runtime.train: could not record the run's end: {error}", file=sys.stderr)


def failure_of(error: BaseException) -> str:
    """One line saying why the run failed."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    return f"{type(error).__name__}: {error}".strip()


def build_plan_model(plan: Plan, context: RankContext, seed: int, sharded: bool) -> LlamaModel:
    """The plan's model on this rank, over its mesh (its replica's group and layout): sharded
    in the mesh's state fractions (built on the meta device, this rank's shards drawn from
    `seed`), or whole (replicated). Over several replicas, the sharded model also gets the
    cross-replica gradient reduction (`model.cross_replica`; collective: every rank builds
    its model)."""
    mesh = context.mesh_of(plan)
    attention = CPHPAttention(mesh.layout, mesh.group)
    checkpointing = plan.train.activation_checkpointing
    if not sharded:  # the former recipe, norm and SwiGLU included (recorded as `autocast`)
        model = build_model(
            plan.model, attention, seed=seed, device=context.device, checkpointing=checkpointing
        )
        use_autograd_elementwise(model)
        return model
    model = build_model(plan.model, attention, device="meta", checkpointing=checkpointing)
    states = shard_model_states(
        model, mesh.fractions, context.compute_dtype, mesh.group, seed=seed, device=context.device
    )
    model.cross_replica = None
    if mesh.data_parallel:
        sizes = [unit.numel for unit in states.units]
        model.cross_replica = CrossReplicaReduction(plan, sizes, context.rank)
    return model


def build_optimizer(
    model: torch.nn.Module, learning_rate: float, fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW over the FP32 (master) states: torch's fused implementation (one kernel per
    step, no parameter-sized temporaries) on every device, or the multi-tensor (foreach)
    one of the former `autocast` recipe that `--state-sharding replicated` keeps."""
    if fused:
        return torch.optim.AdamW(model.parameters(), lr=learning_rate, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, foreach=True)


def open_run(
    plan: Plan, options: TrainOptions, context: RankContext, first_step: int = 0
) -> tuple[Store | None, int | None]:
    """Rank 0 opens the store and records the run; every rank learns whether that worked."""
    outcome: list[object] = [None]
    store = None
    if context.rank == 0 and options.store_url is not None:
        try:
            store = Store.open(options.store_url)
            outcome[0] = record_run(store, plan, options, context, first_step)
        except HexiseqError as error:
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], HexiseqError):
        raise outcome[0]
    return store, outcome[0]


def record_run(
    store: Store, plan: Plan, options: TrainOptions, context: RankContext, first_step: int = 0
) -> int:
    """The run's row, with the plan as run: its train spec names the recipe that ran
    (`sharded`, or `autocast` for `--state-sharding replicated`) and the compute dtype."""
    recipe = "sharded" if options.state_sharding == "sharded" else "autocast"
    dtype_bytes = torch.finfo(context.compute_dtype).bits // 8
    ran = dataclasses.replace(plan.train, runtime_recipe=recipe, compute_dtype_bytes=dtype_bytes)
    plan_json = dataclasses.replace(plan, train=ran).to_json_text()
    return store.save_runtime_run(
        plan_json,
        plan_hash=hashlib.sha256(plan_json.encode()).hexdigest(),
        plan_id=store.find_plan_id(plan_json),
        plan_name=plan.name,
        model_name=plan.model.name,
        seq_len=plan.train.seq_len,
        world_size=context.world_size,
        steps=options.steps - first_step,
        backend=dist.get_backend(),
        device=context.device.type,
        dtype=str(context.compute_dtype).removeprefix("torch."),
        emulation=any(d.emulation_slowdown != 1.0 for d in plan.cluster.devices),
        torch_version=torch.__version__,
        launch_id=os.environ.get(LAUNCH_ID_ENV),
    )


def step_tokens(plan: Plan, seed: int, step: int) -> torch.Tensor:
    """Random token ids (micro_batches, S) of the whole sequence for `step`, the same on every
    rank (drawn on the CPU from seed and step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    shape = (plan.train.micro_batches, plan.train.seq_len)
    return torch.randint(0, plan.model.vocab, shape, generator=generator)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off during a step: collections then never pause a
    step at a random moment, and what a step holds does not depend on when one happens (as
    torchtitan's training loop does). `collect_garbage` runs one before the step's clock."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def collect_garbage() -> None:
    """One full collection before a step, outside its measured time. `frozen_setup` moved
    the objects of the build out of the collector's reach, so it visits only what the steps
    made (on an H200 a collection inside the step, the model's objects included, left the
    GPU idle for 146 ms of a 0.71 s step)."""
    gc.collect()


@contextmanager
def frozen_setup() -> Iterator[None]:
    """The objects alive now (modules, parameters, the optimizer, imported libraries) frozen
    out of the cyclic collector for the block (`gc.freeze`), unfrozen after it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure_step(
    plan: Plan,
    options: TrainOptions,
    context: RankContext,
    model: LlamaModel,
    optimizer: torch.optim.Optimizer,
    padding: ComputePadding,
    positions: torch.Tensor,
    step: int,
    sharded: bool,
) -> RuntimeMeasurement:
    """Run one training step between two barriers and measure it (see the module docstring)."""
    tokens = step_tokens(plan, options.seed, step).to(context.device)
    cuda = context.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(context.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    collect_garbage()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(context.device)
        events[0].record()
    began = time.perf_counter()
    with collector_paused():
        loss = run_step(plan, context, model, optimizer, padding, tokens, positions, sharded)
    own_end = time.perf_counter()
    if cuda:
        events[1].record()
    dist.barrier()
    if cuda:
        events[2].record()
        torch.cuda.synchronize(context.device)
        rank_time_s = events[0].elapsed_time(events[1]) / 1e3
        step_time_s = events[0].elapsed_time(events[2]) / 1e3
        peak_bytes = torch.cuda.max_memory_allocated(context.device)
        reserved = cuda_reserved_bytes(context.device)
    else:
        step_time_s = time.perf_counter() - began
        rank_time_s = own_end - began
        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return RuntimeMeasurement(
        rank=context.rank,
        step=step,
        step_time_s=step_time_s,
        rank_time_s=rank_time_s,
        peak_memory_bytes=int(peak_bytes),
        memory_measure="cuda_max_allocated" if cuda else "cpu_max_rss",
        reserved_peak_bytes=reserved[0] if cuda else None,
        outside_allocator_bytes=reserved[1] if cuda else None,
        device=context.device_label,
        loss=loss,
        emulation_slowdown=context.slowdown,
        emulation_label=context.emulation_label,
        attention_kernels=take_used_kernels(),
    )


def run_step(
    plan: Plan,
    context: RankContext,
    model: LlamaModel,
    optimizer: torch.optim.Optimizer,
    padding: ComputePadding,
    tokens_MS: torch.Tensor,
    positions: torch.Tensor,
    sharded: bool,
    phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext(),
) -> float:
    """Forward and backward of each micro-batch (gradient accumulation), the gradient
    reduction (the shards' reduce-scatter in the backward, or an all-reduce of replicated
    gradients), AdamW. Returns the step's loss: the mean over its micro-batches of each
    sequence's mean. `phase(name)` wraps each part ("forward", "loss", "backward",
    "optimizer"): the memory probe (`allocations`) counts what each allocates."""
    mesh = context.mesh_of(plan)
    autocast = not sharded and context.compute_dtype != torch.float32
    losses = []
    for index in mesh.sequences:  # this replica's sequences of the step
        tokens_BS = tokens_MS[index : index + 1]
        labels = next_token_labels(tokens_BS, positions)
        with torch.autocast(context.device.type, dtype=context.compute_dtype, enabled=autocast):
            with phase("forward"):
                hidden = model.hidden_states(tokens_BS[:, positions], positions)
            with phase("loss"):  # the LM head and the loss, a chunk of tokens at a time
                loss = chunked_next_token_loss(
                    hidden,
                    model.lm_head.weight,
                    labels,
                    compute_dtype=context.compute_dtype,
                    group=mesh.group,
                )
        with phase("backward"):
            (loss.local_share / mesh.total_sequences).backward()
        losses.append(loss.global_loss.item())
    padding.flush()
    with phase("optimizer"):
        if not sharded:  # over the world: every replica's share
            all_reduce_gradients(list(model.parameters()))
        elif getattr(model, "cross_replica", None) is not None:
            model.cross_replica.reduce([unit.master for unit in model.sharded_states.units])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if not mesh.data_parallel:
        return statistics.fmean(losses)
    return step_loss(losses, mesh, context.device)


def step_loss(losses: list[float], mesh: Mesh, device: torch.device) -> float:
    """The step's loss over several replicas: the mean of every sequence's mean, each
    replica's sequences counted once (by its first rank)."""
    own = math.fsum(losses) if mesh.local_rank == 0 else 0.0
    total = torch.tensor([own], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / mesh.total_sequences


def describe_step(rows: list[RuntimeMeasurement]) -> str:
    first = rows[0]
    peak_mib = ", ".join(f"{row.peak_memory_bytes / 2**20:.0f}" for row in rows)
    return (
        f"step {first.step}: loss {first.loss:.4f}  step {first.step_time_s * 1e3:.1f} ms  "
        f"peak MiB per rank ({first.memory_measure}) [{peak_mib}]"
    )


if __name__ == "__main__":
    sys.exit(main())
