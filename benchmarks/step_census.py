"""What one decoder block of the runtime really moves, against what the step simulator counts.

The simulator prices a block's elementwise kernels (norms, RoPE, SwiGLU, residuals, the
attention's packing, sorting and merging, casts) from hand counts of bytes and kernels per
token (`costmodel._runtime_work`). This script counts them in the runtime itself: its real
training step (`runtime.train.run_step`, model, sharded states and fused AdamW built as
`hexiseq run` builds them) runs on the CPU in bfloat16 under a `TorchDispatchMode` that adds,
for every operator that is not a view, the bytes of every tensor it reads or writes and one
kernel. GEMMs and the attention kernels are counted apart (the simulator prices them by
FLOPs). One block's work is the difference between a 2-layer and a 1-layer model of the same
shape, and its per-token part the difference between two lengths, so the head, the loss and
the optimizer drop out.

On a GPU the same operators run, with two differences this CPU count does not see: cuDNN
attention gets contiguous copies of q, k, v and the output (the CPU flash kernel takes
strided ones), and the kernels a CPU backward composes may be fused there.

Run: `.venv/bin/python benchmarks/step_census.py` (about 3 minutes on 2 cores); prints the table
and writes the RESULTS.md section `step_census` (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
from _results import cpu_seconds, replace_section
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hexiseq import Cluster, ModelSpec, TrainSpec, plan_search
from hexiseq.costmodel._runtime_work import (
    block_activation_casts_per_token,
    block_elementwise_per_token,
    runtime_dtypes,
    weight_casts_per_layer,
)
from hexiseq.runtime import train as training
from hexiseq.runtime._emulation import ComputePadding
from hexiseq.runtime.model import token_positions

SECTION = "step_census"
GEMM_OPS = {"mm", "addmm", "bmm", "matmul", "linear"}
ALLOCATION_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "set_", "resize_"}
ALIAS_OPS = {"_unsafe_view", "detach", "alias", "lift_fresh"}  # no data moves; not `is_view`
LENGTHS = (512, 1024)
VOCAB = 8192  # the loss drops out of the block's difference; a small vocabulary keeps it quick


class OperatorCensus(TorchDispatchMode):
    """Bytes read + written and calls of every non-view operator, by kind and by name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.counting or func.is_view or name in ALLOCATION_OPS | ALIAS_OPS:
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        for key in (kind_of(name), f"op:{name}"):
            self.bytes[key] += moved
            self.calls[key] += 1
        return out


def kind_of(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if "attention" in name:
        return "attention"
    return "elementwise"


def census(model: ModelSpec, seq_len: int, checkpointing: bool) -> OperatorCensus:
    """The operators of the runtime's second (steady) step on one CPU rank, bf16 compute."""
    cluster = Cluster.from_dict({"name": "c", "nodes": [{"name": "n0", "gpu": "cpu", "count": 1}]})
    plan = plan_search(cluster, model, seq_len, activation_checkpointing=checkpointing).best
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, compute_dtype_bytes=2))
    context = training.RankContext.cpu(0, 1, torch.bfloat16)
    built = training.build_plan_model(plan, context, 0, True)
    optimizer = training.build_optimizer(built, 1e-3, fused=True)
    positions = token_positions(context.mesh_of(plan).layout, 0)
    counted = OperatorCensus()
    with counted:
        for step in range(2):
            counted.counting = step == 1
            tokens = training.step_tokens(plan, 0, step)
            with training.collector_paused():
                training.run_step(
                    plan, context, built, optimizer, ComputePadding(built, 1.0), tokens,
                    positions, True,
                )  # fmt: skip
    return counted


@dataclasses.dataclass(frozen=True)
class BlockCount:
    bytes_per_token: float
    kernels: float
    top: list[tuple[str, float]]  # operator, bytes per token


def measured_block(base: ModelSpec, checkpointing: bool) -> BlockCount:
    """One block's elementwise bytes per token and kernels, from four censuses."""
    runs = {
        (layers, n): census(shape(base, layers), n, checkpointing)
        for layers in (1, 2)
        for n in LENGTHS
    }
    short, long = LENGTHS

    def per_token(key: str) -> float:
        block = [runs[(2, n)].bytes[key] - runs[(1, n)].bytes[key] for n in LENGTHS]
        return (block[1] - block[0]) / (long - short)

    kernels = runs[(2, long)].calls["elementwise"] - runs[(1, long)].calls["elementwise"]
    names = {
        k
        for run in runs.values()
        for k in run.bytes
        if k.startswith("op:") and kind_of(k[3:]) == "elementwise"
    }
    top = sorted(((k[3:], per_token(k)) for k in names), key=lambda item: -item[1])[:8]
    return BlockCount(per_token("elementwise"), kernels, top)


def modelled_block(base: ModelSpec, checkpointing: bool) -> BlockCount:
    """The simulator's count for one block (`costmodel._runtime_work`), bf16 sharded recipe:
    elementwise and activation casts per token, forward (twice with checkpointing: the
    recompute) and backward; weight casts per pass (not per token)."""
    dtypes = runtime_dtypes(TrainSpec(seq_len=LENGTHS[-1], activation_checkpointing=checkpointing))
    passes = {False: 1, True: 2}[checkpointing]
    total, kernels = 0.0, 0.0
    for backward, times in ((False, passes), (True, 1)):
        for work in (
            block_elementwise_per_token(base, dtypes, backward=backward),
            block_activation_casts_per_token(base, dtypes, backward=backward),
        ):
            total += times * work.bytes
            kernels += times * work.kernels
        kernels += times * weight_casts_per_layer(dtypes, backward=backward).kernels
    return BlockCount(total, kernels, [])


def shape(base: ModelSpec, layers: int) -> ModelSpec:
    return dataclasses.replace(base, layers=layers, vocab=VOCAB, name=f"{base.name}-{layers}L")


def render(rows: list[tuple[bool, BlockCount, BlockCount]], meta: dict) -> str:
    lines = [
        "## Step census: one block's elementwise work, runtime against simulator",
        "",
        f"Model `{meta['model']}` shape (hidden {meta['hidden']}, FFN {meta['ffn']}, "
        f"{meta['heads']} heads, {meta['kv_heads']} K/V heads), bf16 compute, sharded states, "
        f"one CPU rank; per token from {LENGTHS[0]} and {LENGTHS[1]} tokens, per block from 1 "
        "and 2 layers. Bytes: every tensor each non-view operator reads or writes; kernels: "
        "its calls (GEMMs and attention kernels apart).",
        "",
        "| checkpointing | runtime KiB/token | simulator KiB/token | simulator / runtime | "
        "runtime kernels | simulator kernels |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for checkpointing, measured, modelled in rows:
        lines.append(
            f"| {'on' if checkpointing else 'off'} | {measured.bytes_per_token / 1024:,.1f} | "
            f"{modelled.bytes_per_token / 1024:,.1f} | "
            f"{modelled.bytes_per_token / measured.bytes_per_token:.2f} | "
            f"{measured.kernels:,.0f} | {modelled.kernels:,.0f} |"
        )
    for checkpointing, measured, _ in rows:
        top = ", ".join(f"`{name}` {value / 1024:,.1f}" for name, value in measured.top)
        lines.append(
            f"\n- Heaviest operators per token, checkpointing {'on' if checkpointing else 'off'} "
            f"(KiB): {top}."
        )
    lines.append(
        f"\nProduced by `.venv/bin/python benchmarks/step_census.py` in {meta['wall_s']:.0f} s "
        f"wall, {meta['cpu_s']:.0f} s CPU, torch {torch.__version__}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-3b", help="ModelSpec preset (its shape)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    began = time.perf_counter()
    base = ModelSpec.preset(args.model)
    try:
        rows = [(c, measured_block(base, c), modelled_block(base, c)) for c in (False, True)]
    finally:
        dist.destroy_process_group()
    meta = {
        "model": base.name,
        "hidden": base.hidden,
        "ffn": base.ffn_hidden,
        "heads": base.heads,
        "kv_heads": base.kv_heads,
        "wall_s": time.perf_counter() - began,
        "cpu_s": cpu_seconds(),
    }
    text = render(rows, meta)
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
