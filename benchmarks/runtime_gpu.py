"""hexiseq's runtime against Hugging Face transformers: step time, peak memory, MFU (issue 12).

For each sequence length, with and without activation checkpointing, two subprocesses train
the same model in the same recipe on the same device, one after the other (so neither's
allocator state touches the other):

- hexiseq: a one-device plan from `hexiseq.plan_search` (checkpointing forced as the row says)
  run as a user runs it: `python -m torch.distributed.run --standalone --nproc-per-node 1 -m
  hexiseq.runtime.train --plan PLAN --steps K --store sqlite:///...`; its rows are read back
  from the store. Where the planner finds no plan that fits, the single-rank plan is run
  anyway and marked "forced" (`--planned-only` skips it).
- reference: `LlamaForCausalLM` of an equal `LlamaConfig` (layers, hidden, heads, K/V heads,
  head_dim, ffn, vocab, tied embeddings, rope theta, norm epsilon), `attn_implementation=
  "sdpa"`, gradient checkpointing as the row says (this script re-run with
  `--reference-worker`, printing one JSON line).

Recipe: batch 1, full-sequence next-token loss, the runtime's random tokens for each step
(`hexiseq.runtime.train.step_tokens`), AdamW (fused on CUDA); on CUDA fp32 master weights with
bf16 autocast and `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` for both (the runtime's
launcher sets it; the reference gets the same unless the variable is set), step time by CUDA
events around the whole step (median of the steps after `--warmup`), peak memory
`torch.cuda.max_memory_allocated` (stats reset before each step; max over the steps). On CPU
fp32, step time by perf_counter, memory the process's peak RSS (`ru_maxrss`: interpreter and
libraries included). MFU: `hexiseq.flops.model_flops_per_step` (attention counted, recompute
not) / step time / the catalog's dense bf16 peak of the GPU (on CPU the catalog's `cpu` entry,
a measured fp32 peak of the 2-core development machine).

Targets (issue 12, H100/H200): hexiseq at least as fast as the reference at every length,
>= 40 % MFU at 16K tokens and more, peak memory no higher than the reference's.

Usage (here, with `pip install -e '.[bench]'`):

    .venv/bin/python benchmarks/runtime_gpu.py                 # CPU: model small, 1K-4K tokens
    .venv/bin/python benchmarks/runtime_gpu.py --lengths 2048 --steps 2 --no-write
    .venv/bin/python benchmarks/runtime_gpu.py --from-json runtime_gpu.json   # write a device run

Defaults: on CUDA model llama3.2-3b, 8192 16384 32768 tokens, 2 warm-up + 5 measured steps;
on CPU model small, 1024 2048 4096 tokens, 1 + 3, one torch thread per side (`--threads`).
Writes the RESULTS.md section `runtime_gpu` (CUDA) or `runtime_gpu-cpu` (CPU) unless
`--no-write`; `--save-json PATH` keeps the raw rows.

On the device machine (an H100 or H200: torch, scipy, scikit-learn, PyYAML and, by its package
list, transformers are there; pydantic, SQLAlchemy and optuna travel as wheels; hexiseq is
installed from the copied tree). Once, here, in the repo root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl pydantic==2.14.3 pydantic-core==2.50.4 \
      annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
      SQLAlchemy==2.1.9 greenlet==3.5.6 optuna==5.0.0 alembic==1.20.1 colorlog==6.12.0 \
      Mako==1.4.3

then one `run` with carry [".whl"] and this command (one line; about 5-8 minutes on an H100;
if it nears the 10-minute limit, split it by --lengths into two runs and merge the two JSON
files with --from-json):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
    --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps
    --no-build-isolation --no-compile --target /tmp/hexiseq-site . && export
    PYTHONPATH=/tmp/site:/tmp/hexiseq-site PYTHONUNBUFFERED=1 && python3
    benchmarks/runtime_gpu.py --no-write --save-json $OUT/runtime_gpu.json 2>&1 | tee
    $OUT/runtime_gpu.log

(`--save-json` rewrites the file after every row, so a cut-off run keeps what it measured.
If transformers >= 4.44 is missing there, carry its wheel and its Requires-Dist too.) Then,
here: `.venv/bin/python benchmarks/runtime_gpu.py --from-json <files_at>/runtime_gpu.json`
writes the `runtime_gpu` section.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _results import replace_section

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout
from hexiseq.catalog import gpu_catalog
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.errors import InfeasibleError
from hexiseq.flops import model_flops_per_step
from hexiseq.plan import Plan
from hexiseq.search import plan_search
from hexiseq.search._evaluate import Problem, build_plan
from hexiseq.store import Store

SCRIPT = Path(__file__).resolve()
RESULT_PREFIX = "RUNTIME_GPU_RESULT "
GIB = 2**30
UNKNOWN_COMMIT = "(commit unknown)"
MFU_TARGET, MFU_TARGET_FROM_TOKENS = 0.40, 16384
DEFAULTS = {  # device kind -> model, lengths, warm-up steps, measured steps
    "cuda": ("llama3.2-3b", [8192, 16384, 32768], 2, 5),
    "cpu": ("small", [1024, 2048, 4096], 1, 3),
}
# torch.cuda.get_device_name fragments -> catalog name; the first entry whose fragments all
# appear wins (so PCIe and NVL are told apart from SXM before plain "H100").
GPU_NAMES = (
    (("H100", "PCIe"), "H100-PCIe"),
    (("H100", "NVL"), None),
    (("H100",), "H100-SXM"),
    (("H200",), "H200"),
    (("H800",), "H800"),
    (("A100", "80GB"), "A100-80G"),
    (("A100",), "A100-40G"),
    (("A800",), "A800-80G"),
    (("V100", "32GB"), "V100-32G"),
    (("L40S",), "L40S"),
    (("RTX 3090",), "RTX-3090"),
    (("RTX 4090",), "RTX-4090"),
    (("B200",), "B200"),
    (("MI300X",), "MI300X"),
)


def catalog_gpu(device_name: str) -> str | None:
    """The catalog entry of a `torch.cuda.get_device_name`, or None when it has none."""
    for fragments, name in GPU_NAMES:
        if all(fragment in device_name for fragment in fragments):
            return name
    return None


# --- plans ----------------------------------------------------------------------------------


def one_device_plan(gpu: str, model: ModelSpec, seq_len: int, checkpointing: bool, force: bool):
    """(plan or None, note): hexiseq's best plan for one `gpu`; where none fits and `force`,
    the single-rank plan the planner would make, past its memory limit."""
    cluster = Cluster.from_dict(
        {"name": f"one-{gpu}", "nodes": [{"name": "n0", "gpu": gpu, "count": 1}]}
    )
    try:
        best = plan_search(cluster, model, seq_len, activation_checkpointing=checkpointing).best
        return best, "planned"
    except InfeasibleError as error:
        short = f"{sum(error.missing_bytes.values()) / GIB:.1f} GiB short"
        if not force:
            return None, f"no plan ({short})"
    train = TrainSpec(
        seq_len=seq_len,
        activation_checkpointing=checkpointing,
        compute_dtype_bytes=4 if gpu == "cpu" else 2,
    )
    layout = build_uniform_layout(seq_len, model.heads, model.kv_heads, [1])
    problem = Problem(cluster, model, train, DatasheetCostModel(), (checkpointing,))
    prediction = simulate_step(cluster, model, train, layout, problem.cost, [1.0])
    knobs = {
        "planner": "none: forced by benchmarks/runtime_gpu.py",
        "activation_checkpointing": checkpointing,
    }
    plan = build_plan(problem, layout, [1.0], "forced", knobs, prediction)
    return plan, f"forced (planner: {short})"


# --- the two sides --------------------------------------------------------------------------


def run_hexiseq(
    plan_path: Path,
    store_url: str,
    device: str,
    steps: int,
    limits: dict,
    compiled: bool,
    trace: Path | None = None,
):
    """Run the plan under torchrun as a user does; its rows from the store (`side_result`).
    With `trace`, its last step's Chrome trace is written there (`--torch-profile`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "1", "-m", "hexiseq.runtime.train", "--plan", str(plan_path)]
    command += ["--steps", str(steps), "--store", store_url, "--device", device]
    command += ["--compile"] if compiled else []
    command += ["--torch-profile", str(trace)] if trace is not None else []
    outcome = _run(command, **limits)
    rows = []
    with Store.open(store_url) as store:
        for run in store.list_runtime_runs():
            rows += store.runtime_measurements(run["id"])
    rows.sort(key=lambda row: row.step)
    times, peaks = [r.step_time_s for r in rows], [r.peak_memory_bytes for r in rows]
    result = side_result(outcome, times, peaks, [r.loss for r in rows], steps)
    result["reserved_peaks"] = [r.reserved_peak_bytes for r in rows]
    result["outside_allocator"] = [r.outside_allocator_bytes for r in rows]
    return result


def run_reference(
    plan_path: Path, device: str, steps: int, limits: dict, trace: Path | None = None
) -> dict:
    """Run the transformers reference in a subprocess of this script (with `trace`, its last
    step's Chrome trace written there)."""
    command = [sys.executable, str(SCRIPT), "--reference-worker", str(plan_path)]
    command += ["--trace-dir", str(trace)] if trace is not None else []
    outcome = _run([*command, "--steps", str(steps), "--device", device], **limits)
    found = _result_line(outcome["output"]) or {}
    if found.get("error"):
        outcome = {**outcome, "output": found["error"]}
    times, peaks = found.get("step_times_s", []), found.get("peaks", [])
    result = side_result(outcome, times, peaks, found.get("losses", []), steps)
    return {**result, "params": found.get("params")}


def _run(command: list[str], timeout_s: float, threads: int | None = None) -> dict:
    """rc (None: timed out) and stdout + stderr of a subprocess; `threads`: its CPU threads
    (OMP_NUM_THREADS, which torch reads at start)."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    try:  # run from a neutral folder: `-m` puts the folder first on sys.path, and the repo
        # root's hexiseq/ (without the subpackages its install maps in) would shadow the install
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=tempfile.gettempdir(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "output": f"timed out after {timeout_s:.0f} s"}
    return {"rc": done.returncode, "output": done.stdout + done.stderr}


def _result_line(output: str) -> dict | None:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX)) if lines else None


def side_result(outcome: dict, times: list, peaks: list, losses: list, steps: int) -> dict:
    """status ("ok", "OOM at step k", "failed: <error line>"), the step times and peaks
    recorded (one per step, in order) and the first step's loss."""
    status = "ok"
    if outcome["rc"] != 0 or len(times) != steps:
        output = outcome["output"]
        if "OutOfMemoryError" in output or "out of memory" in output.lower():
            status = f"OOM at step {len(times)}"
        else:
            status = f"failed: {_error_line(output)}"
    first_loss = losses[0] if losses else None
    result = {"status": status, "step_times_s": times, "peaks": peaks, "loss_first": first_loss}
    if status != "ok":
        result["output_tail"] = outcome["output"][-OUTPUT_TAIL_CHARS:]
    return result


OUTPUT_TAIL_CHARS = 4000  # of a failed side's output, kept in the saved rows


def _error_line(output: str) -> str:
    """The last line that names an error (torchrun ends with a banner), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    return (errors or lines or ["no output"])[-1][:160]


# --- the reference worker (a subprocess) ----------------------------------------------------


def reference_worker(
    plan_path: str, steps: int, device_kind: str, trace: str | None = None
) -> dict:
    """Train the transformers twin of the plan's model `steps` steps on the runtime's tokens;
    what was measured (an OOM ends it with an "error"). With `trace`, the last step runs
    under torch.profiler and its Chrome trace is written there."""
    import torch

    from hexiseq.runtime._torch_profile import profiled_step
    from hexiseq.runtime.train import step_tokens

    plan = Plan.from_json(plan_path)
    device = torch.device(device_kind)
    model = _reference_model(plan, device)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)
    result = {"params": sum(p.numel() for p in model.parameters())}
    result |= {"step_times_s": [], "peaks": [], "losses": []}
    try:
        for step in range(steps):
            tokens = step_tokens(plan, 0, step).to(device)  # the runtime's seed 0
            profile_to = trace if step == steps - 1 else None
            with profiled_step(profile_to, 0, device):
                seconds, peak, loss = _reference_step(model, optimizer, tokens, device)
            result["step_times_s"].append(seconds)
            result["peaks"].append(peak)
            result["losses"].append(loss)
    except torch.cuda.OutOfMemoryError as error:
        result["error"] = f"OutOfMemoryError: {str(error).splitlines()[0]}"
    return result


def _reference_model(plan: Plan, device):
    """LlamaForCausalLM with the plan model's shape, fp32 on `device`, SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = plan.model
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=plan.train.seq_len,
        rms_norm_eps=getattr(spec, "norm_eps", 1e-5),  # getattr: specs without it (older plans)
        rope_theta=getattr(spec, "rope_theta", 10000.0),
        tie_word_embeddings=spec.tied_embeddings,
        use_cache=False,
    )
    with torch.device(device):  # initialised where it trains: no host copy
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.float().train()
    if plan.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _reference_step(model, optimizer, tokens, device) -> tuple[float, int, float]:
    """One step, measured as the runtime measures its own: (seconds, peak bytes, loss)."""
    import resource

    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        loss = model(input_ids=tokens, labels=tokens).loss  # shifted inside: next token
    loss.backward()
    value = loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device), value
    seconds = time.perf_counter() - began
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, value


def probe_device() -> dict:
    """What this machine computes on (run in a subprocess: the parent never starts CUDA)."""
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()})"
    return {"kind": "cuda" if cuda else "cpu", "name": name, "torch": torch.__version__}


# --- measuring ------------------------------------------------------------------------------


def measure(args: argparse.Namespace, device_kind: str, gpu: str, on_row) -> list[dict]:
    """Every (length, checkpointing) row: plan, hexiseq run, reference run; `on_row(rows)`
    after each (so a cut-off run keeps what it measured)."""
    model, rows = ModelSpec.preset(args.model), []
    steps = args.warmup + args.steps
    limits = {"timeout_s": args.timeout, "threads": args.threads if device_kind == "cpu" else None}
    with_reference = not args.hexiseq_only
    cases = [
        (n, c, with_reference) for n in args.lengths for c in CHECKPOINTING[args.checkpointing]
    ]
    if args.near_cap:
        cases.append((near_cap_length(gpu, model), False, False))
    with tempfile.TemporaryDirectory() as scratch:
        for index, (seq_len, checkpointing, with_reference) in enumerate(cases):
            plan, note = one_device_plan(gpu, model, seq_len, checkpointing, args.force)
            row = {"seq_len": seq_len, "checkpointing": checkpointing, "plan": note}
            if plan is not None:
                # the row's index too: a near-cap length may equal a listed one
                name = f"{index}-{seq_len}-{'ckpt' if checkpointing else 'full'}"
                path, store = Path(scratch, f"{name}.json"), f"sqlite:///{scratch}/{name}.db"
                plan.to_json(path)
                row |= predicted_fields(plan)
                traces = _trace_paths(args.trace_dir, name)
                row["hexiseq"] = run_hexiseq(
                    path, store, device_kind, steps, limits, args.compile, traces[0]
                )
                if with_reference:
                    row["reference"] = run_reference(path, device_kind, steps, limits, traces[1])
            print(_progress(row, args.warmup), flush=True)
            rows.append(row)
            on_row(rows)
    return rows


def _trace_paths(trace_dir: Path | None, name: str) -> tuple[Path | None, Path | None]:
    """Where each side's Chrome trace goes (`--trace-dir`), or none."""
    if trace_dir is None:
        return None, None
    return trace_dir / f"hexiseq-{name}.json.gz", trace_dir / f"reference-{name}.json.gz"


CHECKPOINTING = {"both": (False, True), "off": (False,), "on": (True,)}
NEAR_CAP_STEP_TOKENS = 1024


def near_cap_length(gpu: str, model: ModelSpec) -> int:
    """The longest sequence, in steps of 1024 tokens, whose one-device plan without
    checkpointing the planner passes (under its memory cap): the run that shows whether a
    plan at the cap really fits."""

    def fits(tokens: int) -> bool:
        return one_device_plan(gpu, model, tokens, False, force=False)[0] is not None

    low, high = 0, 1
    while fits(high * NEAR_CAP_STEP_TOKENS):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * NEAR_CAP_STEP_TOKENS) else (low, middle)
    if low == 0:
        raise SystemExit(f"runtime_gpu: error: no plan of {model.name} fits one {gpu}")
    return low * NEAR_CAP_STEP_TOKENS


def predicted_fields(plan: Plan) -> dict:
    """What the plan predicts for its one rank: step time, peak memory and its terms."""
    rank = plan.predicted.ranks[0]
    return {
        "predicted_step_s": plan.predicted.step_time_s,
        "predicted_peak_bytes": rank.memory_bytes,
        "predicted_memory_fraction": rank.memory_fraction,
        "predicted_memory_terms": dict(rank.memory_terms),
    }


def _progress(row: dict, warmup: int) -> str:
    parts = [f"{row['seq_len']} tokens, checkpointing {row['checkpointing']}: {row['plan']}"]
    for name in SIDES:
        if name in row:
            side = Side.of(row[name], warmup)
            parts.append(f"{name} {side.status} {side.time_cell()} s, {side.peak_cell()} GiB")
    return "; ".join(parts)


# --- the table ------------------------------------------------------------------------------

SIDES = ("hexiseq", "reference")


@dataclass(frozen=True)
class Side:
    """One side of a row as the table shows it."""

    status: str  # "ok", "OOM at step k", "failed: ...", "not run"
    step_s: float | None  # median after the warm-up
    peak_bytes: int | None  # max over the steps recorded

    @classmethod
    def of(cls, side: dict | None, warmup: int) -> Side:
        if side is None:
            return cls("not run", None, None)
        measured = side["step_times_s"][warmup:]
        step_s = statistics.median(measured) if measured else None
        return cls(side["status"], step_s, max(side["peaks"]) if side["peaks"] else None)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def time_cell(self) -> str:
        if self.step_s is None:
            return self.status
        return f"{self.step_s:.3f}" + ("" if self.ok else f" ({self.status})")

    def peak_cell(self) -> str:
        if self.peak_bytes is None:
            return "—"
        return ("" if self.ok else "≥ ") + f"{self.peak_bytes / GIB:.2f}"

    def mfu_cell(self, flops: float, peak_flops: float | None) -> str:
        if self.step_s is None:
            return "—"
        return f"{100 * flops / self.step_s / peak_flops:.1f} %" if peak_flops else "unknown"


def render(report: dict) -> str:
    """The RESULTS.md section of a report (its meta and rows)."""
    meta = report["meta"]
    model = ModelSpec.preset(meta["model"])
    peak_flops = gpu_catalog()[meta["gpu"]].peak_flops if meta["gpu"] else None
    memory = "peak RSS GiB" if meta["device_kind"] == "cpu" else "peak GiB"
    lines = [
        "## Runtime vs Hugging Face transformers"
        + (
            " (CPU stand-in: small model, fp32)"
            if meta["device_kind"] == "cpu"
            else f" ({meta['gpu']})"
        ),
        "",
        _intro(meta, model, peak_flops),
        "",
        "| tokens | ckpt | hexiseq plan | hexiseq s | reference s | speedup | hexiseq MFU "
        f"| reference MFU | hexiseq {memory} | reference {memory} | speed ≥ ref "
        "| MFU ≥ 40 % (16K+) | peak ≤ ref |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    lines += [_table_row(row, model, peak_flops, meta) for row in report["rows"]]
    return "\n".join([*lines, "", *_notes(report, model), *_prediction_table(report)])


PREDICTED_BY_RUN = "datasheet cost model, as planned for the run"


def repredict(report: dict) -> dict:
    """`report` with every row's predictions made again by this hexiseq: the same one-device
    plan search (`one_device_plan` on the row's catalog GPU, length and checkpointing), so a
    model change can be held against measurements taken before it."""
    model = ModelSpec.preset(report["meta"]["model"])
    gpu = report["meta"]["gpu"] or "H100-SXM"
    for row in report["rows"]:
        if "predicted_peak_bytes" not in row:
            continue
        plan, _ = one_device_plan(gpu, model, row["seq_len"], row["checkpointing"], True)
        row.update(predicted_fields(plan))
    report["meta"]["predicted_by"] = (
        f"datasheet cost model of hexiseq {_commit()}, re-planned for the rows measured by "
        f"hexiseq {report['meta']['commit']} (`--repredict`)"
    )
    return report


def _prediction_table(report: dict) -> list[str]:
    """The plan's predictions against hexiseq's measured step and peak (issue 11), for rows
    saved with them. The allocated peak is compared without the model's `reserve` term (the
    CUDA context and the allocator's slack, outside `max_memory_allocated`); the peak with
    it against what the device held: the allocator's reserved peak plus the memory in use
    outside its pool (rows measured since hexiseq recorded them)."""
    warmup = report["meta"]["warmup"]
    rows = [r for r in report["rows"] if "predicted_peak_bytes" in r and r.get("hexiseq")]
    if not rows or report["meta"]["device_kind"] == "cpu":  # peak RSS is no allocated peak
        return []
    lines = [
        "",
        f"Predicted by the plan ({report['meta'].get('predicted_by', PREDICTED_BY_RUN)}) "
        "against measured, hexiseq's side:",
        "",
        "| tokens | ckpt | predicted s | measured s | measured / predicted | predicted "
        "allocated GiB | measured GiB | error | with reserve: % of card | with reserve GiB "
        "| reserved + outside GiB | error |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours = Side.of(row["hexiseq"], warmup)
        if ours.step_s is None or ours.peak_bytes is None:
            continue
        allocated = row["predicted_peak_bytes"] - row["predicted_memory_terms"].get("reserve", 0)
        cells = [
            f"{row['seq_len']:,}",
            "on" if row["checkpointing"] else "off",
            f"{row['predicted_step_s']:.3f}",
            f"{ours.step_s:.3f}",
            f"{ours.step_s / row['predicted_step_s']:.2f}x",
            f"{allocated / GIB:.2f}",
            f"{ours.peak_bytes / GIB:.2f}",
            f"{100 * (allocated / ours.peak_bytes - 1):+.1f} %",
            f"{100 * row['predicted_memory_fraction']:.1f} %",
            *_held_cells(row["hexiseq"], row["predicted_peak_bytes"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _held_cells(side: dict, predicted_bytes: int) -> list[str]:
    """The peak with its reserve against the reserved peak plus the memory outside the
    allocator (max over the steps of each); "—" where a run did not record them."""
    reserved = [b for b in side.get("reserved_peaks", []) if b is not None]
    outside = [b for b in side.get("outside_allocator", []) if b is not None]
    if not reserved or not outside:
        return [f"{predicted_bytes / GIB:.2f}", "—", "—"]
    held = max(reserved) + max(outside)
    return [
        f"{predicted_bytes / GIB:.2f}",
        f"{held / GIB:.2f}",
        f"{100 * (predicted_bytes / held - 1):+.1f} %",
    ]


def _intro(meta: dict, model: ModelSpec, peak_flops: float | None) -> str:
    cpu = meta["device_kind"] == "cpu"
    recipe = "fp32" if cpu else "fp32 master weights, bf16 compute (the reference by autocast)"
    measures = "CUDA events, max_memory_allocated"
    if cpu:
        measures = (
            f"perf_counter, peak RSS, {meta.get('threads') or 'default'} torch thread(s) each"
        )
    if peak_flops is None:
        mfu = "MFU unknown: the GPU is not in the catalog"
    else:
        source = f"catalog {meta['gpu']} dense bf16"
        if cpu:
            source = "catalog `cpu`: a measured fp32 matmul peak of the development machine"
        mfu = f"MFU: `model_flops_per_step` / step time / {peak_flops / 1e12:.4g} TFLOP/s "
        mfu += f"({source})"
    load = meta.get("load_average", [])
    if cpu and load:  # the CPU is shared: say how busy it was
        measures += f"; 1-minute load average {' then '.join(f'{x:.1f}' for x in load)}"
    return (
        f"`{meta['command']}` ({meta['took_s']:.0f} s) on {meta['device']}, torch "
        f"{meta['torch']}, transformers {meta['transformers']}, hexiseq {meta['commit']}. "
        f"Model `{model.name}` ({model.params / 1e6:,.1f} M parameters), batch 1, {recipe}, "
        f"AdamW; median of {meta['steps']} steps after {meta['warmup']} warm-up "
        f"({measures}). {mfu}."
    )


def _table_row(row: dict, model: ModelSpec, peak_flops: float | None, meta: dict) -> str:
    ours, ref = (Side.of(row.get(name), meta["warmup"]) for name in SIDES)
    flops = model_flops_per_step(model, row["seq_len"])
    speedup = f"{ref.step_s / ours.step_s:.2f}x" if ours.step_s and ref.step_s else "—"
    cells = [
        f"{row['seq_len']:,}",
        "on" if row["checkpointing"] else "off",
        row["plan"],
        ours.time_cell(),
        ref.time_cell(),
        speedup,
        ours.mfu_cell(flops, peak_flops),
        ref.mfu_cell(flops, peak_flops),
        ours.peak_cell(),
        ref.peak_cell(),
        _against_reference(ours, ref, ours.step_s, ref.step_s),
        _mfu_target(ours, row["seq_len"], flops, peak_flops, meta["device_kind"] == "cpu"),
        _against_reference(ours, ref, ours.peak_bytes, ref.peak_bytes),
    ]
    return "| " + " | ".join(cells) + " |"


def _against_reference(ours: Side, ref: Side, our_value, ref_value) -> str:
    """met when hexiseq finished with a value no higher than the reference's; running out of
    memory counts against the side that did; a reference that failed otherwise decides
    nothing."""
    if ours.status == "not run":
        return "— (no plan)"
    if not ours.ok:
        return "missed"
    if ref.status == "not run":
        return "— (hexiseq only)"
    if ref.status.startswith("OOM"):
        return f"met (reference {ref.status})"
    if not ref.ok:
        return "— (reference failed)"
    return "met" if our_value <= ref_value else "missed"


def _mfu_target(ours: Side, seq_len: int, flops: float, peak_flops, cpu: bool) -> str:
    if cpu:
        return "n/a (CPU)"
    if seq_len < MFU_TARGET_FROM_TOKENS or ours.status == "not run":
        return "—"
    if peak_flops is None:
        return "unknown"
    return "met" if ours.ok and flops / ours.step_s / peak_flops >= MFU_TARGET else "missed"


def _notes(report: dict, model: ModelSpec) -> list[str]:
    counts = {row["reference"].get("params") for row in report["rows"] if "reference" in row}
    counts = sorted(counts - {None})
    notes = [
        f"- Parameters: hexiseq's spec {model.params:,}, the reference's "
        + (", ".join(f"{n:,}" for n in counts) or "—")
        + f"; rope theta {getattr(model, 'rope_theta', 10000.0):g} and norm eps "
        f"{getattr(model, 'norm_eps', 1e-5):g} in both.",
        "- speedup = reference step time / hexiseq step time. hexiseq plan: `planned` is "
        "`plan_search`'s best one-device plan; `forced` the single-rank plan, run although the "
        "planner's memory model says it does not fit; `no plan`: not run (`--planned-only`). "
        "OOM at step k: k steps finished before memory ran out (their peak then a lower bound).",
    ]
    notes.append(_loss_note(report["rows"], model))
    if report["meta"]["device_kind"] == "cpu":
        notes.append(
            "- CPU: peak RSS counts the whole process (interpreter, torch, and transformers or "
            "hexiseq's store libraries), so the memory columns compare more than the training; "
            "the 40 % MFU target is for H100/H200 only."
        )
    return notes


def _loss_note(rows: list[dict], model: ModelSpec) -> str:
    """First-step losses: both start near ln(vocab) on the same tokens (a check that both
    train the same objective; their random weights differ)."""
    losses = {name: [] for name in SIDES}
    for row in rows:
        for name in SIDES:
            if row.get(name, {}).get("loss_first") is not None:
                losses[name].append(row[name]["loss_first"])
    spans = {
        name: f"{min(values):.3f}-{max(values):.3f}" if values else "—"
        for name, values in losses.items()
    }
    return (
        f"- First-step loss (same tokens, different random weights): hexiseq {spans['hexiseq']}, "
        f"reference {spans['reference']}; ln(vocab) = {math.log(model.vocab):.3f}."
    )


# --- entry point ----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", help="ModelSpec preset (default: llama3.2-3b on CUDA, small on CPU)")
    add("--lengths", type=int, nargs="+", metavar="TOKENS", help="sequence lengths")
    add("--warmup", type=int, metavar="K", help="warm-up steps left out of the median")
    add("--steps", type=int, metavar="N", help="measured steps after the warm-up")
    add("--gpu", help="catalog GPU to plan for and take the peak of (default: detected)")
    add(
        "--planned-only",
        dest="force",
        action="store_false",
        help="do not run the single-rank plan where the planner finds none that fits",
    )
    add(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="CPU only: torch threads of each side (default 1: the same for both, and steady "
        "on a shared machine)",
    )
    add(
        "--checkpointing",
        choices=tuple(CHECKPOINTING),
        default="both",
        help="rows with activation checkpointing off, on or both (default)",
    )
    add(
        "--hexiseq-only",
        action="store_true",
        help="run hexiseq's side only (the reference's figures of an earlier run stand)",
    )
    add(
        "--compile",
        action="store_true",
        help="run hexiseq with --compile (RMSNorm and SwiGLU math through torch.compile)",
    )
    add(
        "--near-cap",
        action="store_true",
        help="add a hexiseq-only row without checkpointing at the longest length the planner "
        "passes on this GPU (just under its memory cap)",
    )
    add("--timeout", type=float, default=300.0, metavar="S", help="limit per subprocess")
    add("--no-write", action="store_true", help="do not update RESULTS.md")
    add(
        "--section",
        metavar="NAME",
        help="the RESULTS.md section to write (default runtime_gpu, or runtime_gpu-cpu on CPU)",
    )
    add("--save-json", type=Path, metavar="PATH", help="also write the raw rows here")
    add(
        "--trace-dir",
        type=Path,
        metavar="DIR",
        help="write each side's last step as a Chrome trace (torch.profiler) into DIR, for "
        "benchmarks/step_trace.py; that step's time then includes the profiler's overhead",
    )
    add(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="render saved rows (several files merged) instead of measuring",
    )
    add(
        "--repredict",
        action="store_true",
        help="with --from-json: the predictions of this hexiseq's model for the saved rows "
        "(plans made again), not those stored when they ran",
    )
    add("--reference-worker", metavar="PLAN", help=argparse.SUPPRESS)
    add("--probe-device", action="store_true", help=argparse.SUPPRESS)
    add("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repredict and not args.from_json:
        parser.error("--repredict re-plans saved rows: it needs --from-json PATH [PATH ...]")
    for name in ("warmup", "steps"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be at least {0 if name == 'warmup' else 1}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.probe_device:
        print(RESULT_PREFIX + json.dumps(probe_device()))
        return 0
    if args.reference_worker:
        trace = None if args.trace_dir is None else str(args.trace_dir)
        result = reference_worker(args.reference_worker, args.steps, args.device, trace)
        print(RESULT_PREFIX + json.dumps(result))
        return 0
    if args.from_json:
        report = _merge([json.loads(path.read_text()) for path in args.from_json])
        if args.repredict:
            report = repredict(report)
        if report["meta"]["commit"] == UNKNOWN_COMMIT:  # measured on a copy without .git
            report["meta"]["commit"] = f"{_commit()} (the tree that rendered it)"
    elif importlib.util.find_spec("transformers") is None:
        print(
            "runtime_gpu: error: the reference needs Hugging Face transformers, which is not "
            "installed: pip install -e '.[bench]' (or pip install 'transformers>=4.44')",
            file=sys.stderr,
        )
        return 2
    else:
        report = _measure_report(args, argv)
    text = render(report)
    print(text)
    if not args.no_write:
        cpu = report["meta"]["device_kind"] == "cpu"
        replace_section(args.section or ("runtime_gpu-cpu" if cpu else "runtime_gpu"), text)
    return 0


def _measure_report(args: argparse.Namespace, argv: list[str]) -> dict:
    device = _probe()
    model, lengths, warmup, steps = DEFAULTS[device["kind"]]
    args.model, args.lengths = args.model or model, args.lengths or lengths
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    gpu = args.gpu or ("cpu" if device["kind"] == "cpu" else catalog_gpu(device["name"]))
    meta = {
        "command": _shown_command(argv),
        "device": device["name"] + ("" if gpu else " (not in the catalog: planned as H100-SXM)"),
        "device_kind": device["kind"],
        "gpu": gpu,
        "torch": device["torch"],
        "transformers": importlib.metadata.version("transformers"),
        "commit": _commit(),
        "model": args.model,
        "warmup": args.warmup,
        "steps": args.steps,
        "compiled": args.compile,
        "threads": args.threads if device["kind"] == "cpu" else None,
        "load_average": [os.getloadavg()[0]],
    }
    began = time.perf_counter()

    def save(rows: list[dict]) -> dict:
        meta.update(took_s=time.perf_counter() - began)
        report = {"meta": meta, "rows": rows}
        if args.save_json:
            args.save_json.write_text(json.dumps(report, indent=1))
        return report

    rows = measure(args, device["kind"], gpu or "H100-SXM", save)
    meta["load_average"].append(os.getloadavg()[0])
    return save(rows)


def _probe() -> dict:
    probe = _run([sys.executable, str(SCRIPT), "--probe-device"], 300)
    device = _result_line(probe["output"])
    if device is None:
        raise SystemExit(
            f"runtime_gpu: error: device probe failed: {_error_line(probe['output'])}"
        )
    return device


def _shown_command(argv: list[str]) -> str:
    """The command as the table shows it: without the options that only say where output
    goes."""
    shown, skip = [], False
    for arg in argv:
        if skip or arg == "--no-write" or arg.startswith("--save-json="):
            skip = False
            continue
        skip = arg == "--save-json"
        if not skip:
            shown.append(arg)
    return shlex.join(["python", "benchmarks/runtime_gpu.py", *shown])


def _merge(reports: list[dict]) -> dict:
    """Saved reports of one device and model as one (a later row replaces an earlier one)."""
    rows = {(r["seq_len"], r["checkpointing"]): r for report in reports for r in report["rows"]}
    meta = dict(reports[-1]["meta"], took_s=sum(r["meta"]["took_s"] for r in reports))
    commands = list(dict.fromkeys(r["meta"]["command"] for r in reports))
    meta["command"] = "` then `".join(commands)
    return {"meta": meta, "rows": [rows[key] for key in sorted(rows)]}


def _commit() -> str:
    done = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        cwd=SCRIPT.parents[1],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or UNKNOWN_COMMIT


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
