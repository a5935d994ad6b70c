"""What the runtime costs and moves on this CPU (issue 4).

Three measurements, each a section of benchmarks/RESULTS.md:

1. attention: `CPHPAttention` forward + backward at world 2 (gloo, one thread per rank; ring
   and Ulysses layouts) against one process running the fused CPU SDPA on the whole sequence
   (one thread, and two threads: the same two cores), causal, fp32. Its output is checked
   against that reference at the smallest length.
2. traffic: the bytes one training step of the model really sends (all-to-alls, ring K/V,
   dK/dV, GQA folds; counted by wrapping torch.distributed's calls in every rank) against the
   simulator's count (`hexiseq.costmodel.traffic.step_traffic_bytes`). They must be equal.
3. emulation: the `cpu-emulated-2type` cluster (2 ranks at normal speed, 2 padded to 2x by
   sleeping): measured step time of the uniform plan (the best uniform-USP grid) against
   hexiseq's plan for it, both run by `hexiseq run`. Goal: >= 1.3x.

Run: `.venv/bin/python benchmarks/runtime.py [--quick] [--only attention|traffic|emulation]`
(prints each table and updates its section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _results import replace_section
from _runs import run_plan, uniform_grids

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout, build_zigzag_layout
from hexiseq.costmodel import DatasheetCostModel
from hexiseq.costmodel.traffic import TRAFFIC_KINDS, step_traffic_bytes
from hexiseq.layout import AttentionLayout
from hexiseq.plan import Plan
from hexiseq.search import plan_search
from hexiseq.search._evaluate import Problem, evaluate

HEADS, HEAD_DIM = 8, 64
ATTENTION_REPEATS = 3
MACHINE = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


# --- spawning gloo ranks -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(worker, world: int, *args) -> list[dict]:
    """Run `worker(rank, world, port, out_dir, *args)` in `world` gloo processes; each rank
    writes a JSON result to out_dir/<rank>.json."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main,
            args=(worker, world, _free_port(), out_dir, args),
            nprocs=world,
            start_method="spawn",
        )
        return [json.loads((Path(out_dir) / f"{r}.json").read_text()) for r in range(world)]


def _rank_main(rank, worker, world, port, out_dir, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = worker(rank, world, *args)
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(result))


# --- 1. attention at world 2 ---------------------------------------------------------------


def _world2_layouts(seq_len: int) -> dict[str, AttentionLayout]:
    return {
        "ring (cp=2, zigzag)": build_uniform_layout(seq_len, HEADS, HEADS, [1, 1]),
        "ulysses (hp=2)": build_uniform_layout(seq_len, HEADS, HEADS, [2]),
    }


def _full_inputs(seq_len: int, seed: int) -> list[torch.Tensor]:
    """q, k, v, dout (1, S, H, D), random, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=generator) for _ in range(4)]


def _attention_worker(rank: int, world: int, seq_lens: list[int], check_len: int) -> dict:
    from hexiseq.runtime import CPHPAttention
    from hexiseq.runtime.model import token_positions

    results = {}
    for seq_len in seq_lens:
        full = _full_inputs(seq_len, seed=seq_len)
        for name, layout in _world2_layouts(seq_len).items():
            attention = CPHPAttention(layout)
            index = token_positions(layout, rank)
            q, k, v, dout = (x[:, index].clone() for x in full)
            leaves = [x.requires_grad_() for x in (q, k, v)]
            times = []
            for _ in range(1 + ATTENTION_REPEATS):  # the first is a warm-up
                for leaf in leaves:
                    leaf.grad = None
                dist.barrier()
                began = time.perf_counter()
                out = attention(*leaves, causal=True)
                out.backward(dout)
                elapsed = torch.tensor([time.perf_counter() - began])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(float(elapsed))
            result = {"seconds": statistics.median(times[1:])}
            if seq_len == check_len:
                result["max_rel_error"] = _error_against_reference(full, index, out, leaves)
            results[f"{seq_len}|{name}"] = result
    return results


def _reference(full: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Fused SDPA on the whole sequence: output and dq, dk, dv in (1, S, H, D)."""
    q, k, v, dout = (x.transpose(1, 2).detach().clone().requires_grad_() for x in full)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout.detach())
    return out.transpose(1, 2), [x.grad.transpose(1, 2) for x in (q, k, v)]


def _error_against_reference(full, index, out, leaves) -> float:
    """Largest relative error (norm of difference / norm of reference) of this rank's output
    and gradients against the single-process reference."""
    ref_out, ref_grads = _reference(full)
    pairs = [(out, ref_out[:, index])]
    pairs += [(leaf.grad, grad[:, index]) for leaf, grad in zip(leaves, ref_grads)]
    return max(float((a - b).norm() / b.norm()) for a, b in pairs)


def _reference_seconds(seq_len: int, threads: int) -> float:
    torch.set_num_threads(threads)
    full = _full_inputs(seq_len, seed=seq_len)
    times = []
    for _ in range(1 + ATTENTION_REPEATS):
        began = time.perf_counter()
        _reference(full)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def attention_section(quick: bool) -> str:
    seq_lens = [2048, 4096] if quick else [4096, 8192, 16384]
    measured = {}
    for r in _spawn(_attention_worker, 2, seq_lens, seq_lens[0]):
        for key, value in r.items():
            measured.setdefault(key, []).append(value)
    threads_before = torch.get_num_threads()
    lines = [
        "| tokens | layout (world 2) | fwd+bwd s | 1-process SDPA s (1 / 2 threads) | "
        "speedup vs 1 thread | vs 2 threads | max rel. error |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for seq_len in seq_lens:
        one, two = _reference_seconds(seq_len, 1), _reference_seconds(seq_len, 2)
        for name in _world2_layouts(seq_len):
            ranks = measured[f"{seq_len}|{name}"]
            seconds = ranks[0]["seconds"]
            errors = [r["max_rel_error"] for r in ranks if "max_rel_error" in r]
            error = f"{max(errors):.1e}" if errors else "—"
            lines.append(
                f"| {seq_len:,} | {name} | {seconds:.3f} | {one:.3f} / {two:.3f} | "
                f"{one / seconds:.2f}x | {two / seconds:.2f}x | {error} |"
            )
    torch.set_num_threads(threads_before)
    return "\n".join(lines)


# --- 2. communication volume ---------------------------------------------------------------


CHECKPOINTED = " + activation checkpointing"


def traffic_layouts(seq_len: int) -> dict[str, AttentionLayout]:
    """World-4 layouts of the 'tiny' model (8 query heads, 2 K/V heads: GQA boundaries); a
    name ending in CHECKPOINTED runs with activation checkpointing (the recompute)."""
    model = ModelSpec.preset("tiny")
    h, kv = model.heads, model.kv_heads
    uneven = build_zigzag_layout(
        seq_len,
        h,
        kv,
        groups=[[0, 1], [2, 3]],
        segment_lengths=[seq_len * 5 // 8, seq_len * 3 // 8],
        token_weights=[[2, 1], [1, 3]],
        head_counts=[[5, 3], [3, 5]],
        chunk_quantum=16,
    )
    return {
        "ring cp=4 (zigzag)": build_uniform_layout(seq_len, h, kv, [1, 1, 1, 1]),
        "ulysses hp=4": build_uniform_layout(seq_len, h, kv, [4]),
        "2 groups of 2, uneven tokens and heads 5/3": uneven,
        "2 groups of 2, uneven" + CHECKPOINTED: uneven,
    }


class _Recorder:
    """Wraps the two communication calls of CPHPAttention and adds up bytes by kind."""

    def __init__(self) -> None:
        from hexiseq.runtime._p2p import DKV_TAG, FOLD_TAG, KV_TAG

        self.kinds = {
            KV_TAG: "ring_kv_received",
            DKV_TAG: "ring_dkv_received",
            FOLD_TAG: "fold_received",
        }
        self.bytes = defaultdict(int)
        self._batch, self._all_to_all = dist.batch_isend_irecv, dist.all_to_all_single
        dist.batch_isend_irecv, dist.all_to_all_single = self._record_batch, self._record_a2a

    def _record_batch(self, ops):
        for op in ops:
            if op.op is dist.irecv:
                size = op.tensor.numel() * op.tensor.element_size()
                self.bytes[self.kinds[op.tag]] += size
        return self._batch(ops)

    def _record_a2a(self, output, flat, output_splits, input_splits, group=None):
        own = dist.get_rank(group)
        sent = sum(n for i, n in enumerate(input_splits) if i != own)
        self.bytes["all_to_all_sent"] += sent * flat.element_size()
        return self._all_to_all(output, flat, output_splits, input_splits, group=group)


def _traffic_worker(rank: int, world: int, layout_dicts: dict[str, dict]) -> dict:
    from hexiseq.runtime import CPHPAttention
    from hexiseq.runtime.loss import next_token_labels, sharded_next_token_loss
    from hexiseq.runtime.model import build_model, token_positions

    spec = ModelSpec.preset("tiny")
    results = {}
    for name, document in layout_dicts.items():
        layout = AttentionLayout.from_dict(document)
        checkpointing = name.endswith(CHECKPOINTED)
        model = build_model(spec, CPHPAttention(layout), seed=0, checkpointing=checkpointing)
        positions = token_positions(layout, rank)
        tokens = torch.randint(0, spec.vocab, (1, layout.seq_len), generator=_seeded(1))
        recorder = _Recorder()
        logits = model(tokens[:, positions], positions)
        loss = sharded_next_token_loss(logits, next_token_labels(tokens, positions))
        loss.local_share.backward()
        dist.batch_isend_irecv, dist.all_to_all_single = recorder._batch, recorder._all_to_all
        results[name] = dict(recorder.bytes)
    return results


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def traffic_section(quick: bool) -> str:
    seq_len = 1024 if quick else 4096
    layouts = traffic_layouts(seq_len)
    model = ModelSpec.preset("tiny")
    # The runtime runs fp32 on CPU: count the same.
    trains = {
        checkpointing: TrainSpec(
            seq_len=seq_len, activation_checkpointing=checkpointing, compute_dtype_bytes=4
        )
        for checkpointing in (False, True)
    }
    measured = _spawn(_traffic_worker, 4, {n: lay.to_dict() for n, lay in layouts.items()})
    lines = [
        f"Model `tiny` (2 layers, 8 heads, 2 K/V heads, head_dim 16), {seq_len:,} tokens, "
        "fp32, one training step (forward, recompute where checkpointed, backward), bytes "
        "summed over the 4 ranks.",
        "",
        "| layout | kind | measured bytes | simulator bytes | equal per rank |",
        "|---|---|---:|---:|---|",
    ]
    all_equal = True
    for name, layout in layouts.items():
        counted = step_traffic_bytes(layout, model, trains[name.endswith(CHECKPOINTED)])
        for kind in TRAFFIC_KINDS:
            got = [int(rank_result[name].get(kind, 0)) for rank_result in measured]
            want = [int(round(x)) for x in counted[kind]]
            equal = got == want
            all_equal &= equal
            lines.append(
                f"| {name} | {kind} | {sum(got):,} | {sum(want):,} | "
                f"{'yes' if equal else 'NO: ' + str(got) + ' vs ' + str(want)} |"
            )
    lines.append("")
    lines.append(f"All counts equal rank by rank: **{'yes' if all_equal else 'no'}**.")
    return "\n".join(lines)


# --- 3. emulated 2-type cluster ------------------------------------------------------------


def emulation_section(quick: bool) -> str:
    seq_len, steps = (8192, 3) if quick else (16384, 4)
    cluster, model = Cluster.preset("cpu-emulated-2type"), ModelSpec.preset("small")
    result = plan_search(cluster, model, seq_len, activation_checkpointing=False)
    grids = uniform_grids(result.baselines["uniform-usp"], DatasheetCostModel(), (False,))
    plans = {
        **grids,
        "balanced for the slowdown (tokens 2:2:1:1)": _balanced_plan(result.best, seq_len),
        "hexiseq (datasheet-planned)": result.best,
    }
    lines = [
        f"Cluster `cpu-emulated-2type` (4 CPU ranks, 2 of them emulated 2x slower by sleeping; "
        f"{MACHINE}), model `small`, {seq_len:,} tokens, fp32, no activation checkpointing; "
        f"`hexiseq run` {steps} steps, the first left out (warm-up).",
        "",
        "| plan | tokens per rank | measured step s (median) | steps s | predicted step s |",
        "|---|---|---:|---|---:|",
    ]
    measured = {}
    with tempfile.TemporaryDirectory() as scratch:
        store_url = f"sqlite:///{scratch}/runs.db"
        for name, plan in plans.items():
            run = run_plan(plan, Path(scratch) / "plan.json", store_url, steps=steps)
            measured[name] = run.median_step_s
            print(f"{name}: {run.step_times_s}", flush=True)
            tokens = [plan.layout().num_tokens(r) for r in range(cluster.world_size)]
            lines.append(
                f"| {name} | {tokens} | {run.median_step_s:.3f} | "
                f"{', '.join(f'{s:.3f}' for s in run.step_times_s)} | "
                f"{plan.predicted.step_time_s:.3f} |"
            )
    # Against the uniform grid that ran fastest here, not only the one the model picked.
    strongest = min(grids, key=measured.__getitem__)
    uniform_s = measured[strongest]
    lines.append("")
    for name in list(plans)[len(grids) :]:
        speedup = uniform_s / measured[name]
        verdict = "met" if speedup >= 1.3 else "not met"
        lines.append(
            f"Measured speedup of {name} over the fastest uniform grid measured ({strongest}): "
            f"**{speedup:.3f}x** (goal >= 1.3x: {verdict})."
        )
    predicted = [plan.predicted.step_time_s for plan in grids.values()]
    lines.append(
        "Predicted times use the cost model the plan was made with (here the embedded default; "
        "the closed-loop benchmark plans with the profiled, fitted model). Every uniform grid "
        f"is run: their predicted steps lie within {max(predicted) / min(predicted) - 1:.1%} "
        "of each other, so the model's pick (uniform-USP) need not be the one that runs fastest."
    )
    return "\n".join(lines)


def _balanced_plan(like: Plan, seq_len: int) -> Plan:
    """One rank per ring group, zigzag segments in proportion to each rank's speed (2:2:1:1),
    all heads on every rank, states even: the layout balanced for the slowdown."""
    model = like.model
    third = seq_len // 3 // 2 * 2  # even, so each segment splits into two zigzag chunks
    segments = [third, third, (seq_len - 2 * third) // 2, (seq_len - 2 * third) // 2]
    layout = build_zigzag_layout(
        seq_len,
        model.heads,
        model.kv_heads,
        groups=[[0], [1], [2], [3]],
        segment_lengths=segments,
        token_weights=[[1]] * 4,
        head_counts=[[model.heads]] * 4,
    )
    problem = Problem(like.cluster, model, like.train, DatasheetCostModel())
    plan = evaluate(problem, layout, [0.25] * 4, "balanced 2:2:1:1", {"planner": "by hand"})
    assert isinstance(plan, Plan), plan
    return plan


SECTIONS = {
    "attention": ("Runtime: attention at world 2 (CPU)", attention_section),
    "traffic": ("Runtime: communication volume, measured vs simulator", traffic_section),
    "emulation": ("Runtime: emulated 2-type cluster, uniform vs hexiseq", emulation_section),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run one measurement")
    args = parser.parse_args()
    command = "python benchmarks/runtime.py" + (" --quick" if args.quick else "")
    for key, (title, build) in SECTIONS.items():
        if args.only and key != args.only:
            continue
        began = time.perf_counter()
        table = build(args.quick)
        took = time.perf_counter() - began
        body = f"## {title}\n\n`{command}{'' if args.only is None else ' --only ' + key}` "
        body += f"({took:.0f} s, torch {torch.__version__}, {MACHINE})\n\n{table}"
        print(body, "\n", flush=True)
        if not args.quick:
            replace_section(f"runtime-{key}", body)


if __name__ == "__main__":
    main()
