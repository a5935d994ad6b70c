"""The bandwidth-bound work of a training step as the torch runtime really does it.

Beyond the GEMMs and the attention kernels, a step of `hexiseq.runtime` runs many elementwise
kernels. This module counts, per token (or per parameter), the bytes they read and write and
how many kernels they launch, from what `runtime/model.py`, `runtime/_elementwise.py`,
`runtime/loss.py`, `runtime/_all_to_all.py`, `runtime/_ring.py`, `runtime/_block.py` and
`runtime/train.py` do, per rank (`RankKernels`):

- RMSNorm: ATen's fused kernels on a GPU (one pass each way), its FP32 math in plain
  operations on a CPU rank; RoPE: two products and two in-place half updates each way (its
  explicit backward rotates by the opposite angle); SwiGLU: silu and a product, its backward
  `runtime/_elementwise.py`'s; residual sums in the stream's dtype;
- the sharded recipe gathers each unit in the compute dtype, so nothing is cast per use; the
  former `autocast` recipe cast each linear's FP32 input and weight at every call;
- inside attention: q, k, v to head-major, K/V expanded for GQA by a broadcast copy; with one
  HP group member the all-to-all moves nothing, with one ring group nothing is merged (the
  block's result is the output, the kernel's dQ the gradient); each later ring step's result
  is merged into an FP32 state, and each tile's dK/dV are summed over the query heads of a
  K/V head into the block's FP32 partial;
- the loss runs the LM head and the cross-entropy a chunk of tokens at a time
  (`hexiseq.loss_chunks`): each chunk's logits are upcast to fp32, softmax and gradient are
  made in place and cast back, and the weight gradient is accumulated in fp32 (`loss_work`,
  `head_gemm_work`);
- AdamW: fused over the shards (the former recipe: torch's foreach implementation).

Elements: E hidden, F MLP width, Q = heads x head_dim, K = kv_heads x head_dim, V vocabulary.
`c` is the compute dtype's element size, `s` the residual stream's. Bytes are the sum over
kernels of what each reads plus writes. `benchmarks/step_census.py` counts a block's operators
in the runtime itself on one CPU rank: these counts are 97 % of its bytes and 96-99 % of its
kernels (RESULTS.md `step_census`). On an H200 the step times they give are within 10 % of
the runtime's (profiles/h200-2026-11-27).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hexiseq.flops import LINEAR_BACKWARD_FACTOR, head_flops_per_token
from hexiseq.loss_chunks import loss_chunk_tokens, weight_gradient_slab_count
from hexiseq.model import ModelSpec, TrainSpec

FP32 = 4
MASTER_BYTES = FP32  # parameters and gradients (runtime/model.py, runtime/sharding.py)


@dataclass(frozen=True, slots=True)
class RuntimeDtypes:
    """Bytes per element of what the runtime computes with (the memory model and the step
    simulator both read this one rule)."""

    compute: int
    """Matmul inputs and outputs, attention, logits."""
    stream: int
    """The residual stream, RoPE's tables, RMSNorm's input and output."""
    casts_weights: bool
    """Autocast copies each FP32 weight to `compute` at every use."""
    sharded: bool = True
    """FP32 master shards gathered in `compute` (`runtime/sharding.py`), fused AdamW."""


def runtime_dtypes(train: TrainSpec) -> RuntimeDtypes:
    """The `sharded` recipe (`TrainSpec.runtime_recipe`, what the runtime runs): the units
    are gathered in the compute dtype (`runtime/sharding.py`), so the stream is in it and
    nothing is cast per use. The former `autocast` recipe: FP32 weights under autocast, so
    the embedding's output and the residual stream stay FP32 and every linear casts its
    weight and its input (`tests/costmodel/test_memory_runtime.py` checks the first)."""
    compute = train.compute_dtype_bytes
    if train.runtime_recipe == "sharded":
        return RuntimeDtypes(compute, compute, False, True)
    return RuntimeDtypes(compute, MASTER_BYTES, compute != MASTER_BYTES, False)


FUSED_ADAMW_BYTES_PER_PARAM = 28
"""torch.optim.AdamW(fused=True) (aten/src/ATen/native/cuda/fused_adamw_impl.cu), fp32: one
kernel reads param, grad, exp_avg, exp_avg_sq (16) and writes param, exp_avg, exp_avg_sq
(12). Priced at the elementwise rate: its speed on a GPU is not yet measured."""

ADAMW_BYTES_PER_PARAM = 84
"""torch.optim.AdamW, foreach (torch/optim/adam.py `_multi_tensor_adam`), fp32 everything:
params *= 1 - lr·wd (r+w 8), exp_avg.lerp_(grad) (12), exp_avg_sq *= beta2 (8),
exp_avg_sq.addcmul_(grad, grad) (16: grad read twice), sqrt -> a new temporary (8), its div_ (8)
and add_ eps (8), params.addcdiv_(exp_avg, temporary) (16)."""

ADAMW_MEASURED_SLOWDOWN = 1.5
"""How much longer foreach AdamW takes than its bytes at the elementwise rate. Measured on H100
(../shared/data/h100-3b-8k-step-profile.txt, the 3B 8K plan = runtime runs 3 and 5, which this
makes in-sample for this one constant): `Optimizer.step#AdamW.step` spans 414 ms over 3 steps,
~135 ms per steady step once the first step's state allocation (~9 ms) is taken out, where
84 B/param x 3.21e9 params at the measured elementwise rate (2.93 TB/s) takes 92 ms: 135 / 92
= 1.47. Its largest kernels alone run at 2.7-2.9 TB/s, so the rest is the gaps between the
~1,200 chunked multi_tensor_apply launches of a step."""

ADAMW_FOREACH_OPS = 8
"""The foreach kernels of one AdamW step (the list above)."""

FOREACH_CHUNK_ELEMENTS = 320 * 65536
"""Elements one multi_tensor_apply launch covers (aten/src/ATen/native/cuda/MultiTensorApply.cuh:
320 blocks of 65536 elements), so a foreach op over N elements launches ceil(N / this) kernels."""

GRAD_ACCUMULATE_BYTES_PER_PARAM = 3 * FP32
"""A later micro-batch adds its fp32 gradient into `.grad`: read both, write one."""


@dataclass(frozen=True)
class Work:
    """Bandwidth-bound work: bytes read + written and kernels launched."""

    bytes: float
    kernels: float

    def __add__(self, other: Work) -> Work:
        return Work(self.bytes + other.bytes, self.kernels + other.kernels)

    def scaled(self, factor: float) -> Work:
        """`factor` x the bytes, same kernels (per-token work for `factor` tokens)."""
        return Work(self.bytes * factor, self.kernels)


def _widths(model: ModelSpec) -> tuple[int, int, int, int]:
    return (
        model.hidden,
        model.ffn_hidden,
        model.heads * model.head_dim,
        (model.kv_heads * model.head_dim),
    )


@dataclass(frozen=True, slots=True)
class RankKernels:
    """What decides a rank's elementwise kernels beyond the model and the dtypes."""

    fused_norm: bool = False
    """RMSNorm by ATen's fused kernels (`runtime/_elementwise.py`: on CUDA), else its math in
    plain tensor operations (a CPU rank)."""
    ring_steps: int = 1
    """HP groups in the ring: a rank's queries get one block result per group; the first is
    taken as it is, each later one merged (`runtime/_block.py` `OnlineSoftmax`, `RowSum`)."""
    alone: bool = True
    """A one-member HP group: the all-to-all is the identity (`runtime/_all_to_all.py`)."""


def rank_kernels(gpu: str, ring_steps: int, hp_degree: int) -> RankKernels:
    """The `RankKernels` of a rank on catalog GPU `gpu` (`"cpu"`: a CPU rank)."""
    return RankKernels(gpu != "cpu", int(ring_steps), int(hp_degree) == 1)


NORM_FUSED_FORWARD = (2, 1)
"""ATen's `_fused_rms_norm` (aten/src/ATen/native/cuda/layer_norm_kernel.cu, the RMS path):
(reads + writes in units of the stream's element per hidden element, kernels): x in, y out."""
NORM_FUSED_BACKWARD = (5, 2)
"""`_fused_rms_norm_backward`: the input-gradient kernel reads dy and x and writes dx, the
weight-gradient kernel reads dy and x again."""


@lru_cache(maxsize=1024)  # pure; asked per rank kind of every simulation
def block_elementwise_per_token(
    model: ModelSpec,
    dtypes: RuntimeDtypes,
    *,
    backward: bool,
    rank: RankKernels = RankKernels(),
) -> Work:
    """One decoder block's elementwise kernels per token, forward or backward (casts apart).
    RMSNorm: fused (one pass of the stream each way, `NORM_FUSED_*`), or its math in FP32
    whatever the stream (`runtime/_elementwise.py`): a stream in the compute dtype adds its
    upcast and its output's cast back. RoPE: two products and two in-place half updates each
    way (`runtime/model.py` `rotate_pairs`), on q and k."""
    e, f, q, k = _widths(model)
    c, s = dtypes.compute, dtypes.stream
    norms = _norm_work(e, dtypes, backward=backward, fused=rank.fused_norm)
    rope = Work(7 * max(c, s) * (q + k), 8)
    if not backward:
        residual = Work(2 * (2 * s + c) * e, 2)  # x + the branch -> the stream's dtype
        swiglu = Work(5 * c * f, 2)  # silu (2), mul (3)
        attention = _attention_forward_work(q, k, c, model.gqa_ratio > 1, rank)
        return norms + rope + residual + swiglu + attention
    # `runtime/_elementwise.py` `swiglu_backward`: dP * up, silu_backward, silu(gate), its
    # product with dP; autograd's (the former recipe): two products, silu backward
    swiglu = Work(11 * c * f, 4) if dtypes.sharded else Work(9 * c * f, 3)
    residual = Work(2 * (s + c) * e + 2 * 3 * s * e, 4)  # grads to the branches; skip sums
    input_grad_sums = Work(3 * 3 * s * e, 3)  # q+k+v and gate+up input gradients summed
    attention = _attention_backward_work(q, k, c, model.gqa_ratio > 1, rank)
    return norms + rope + residual + input_grad_sums + swiglu + attention


def _norm_work(e: int, dtypes: RuntimeDtypes, *, backward: bool, fused: bool) -> Work:
    """A block's two RMSNorms, one direction."""
    s, r = dtypes.stream, FP32
    if fused and dtypes.sharded:  # RMSNormFunction (the former recipe: autograd's)
        passes, kernels = NORM_FUSED_BACKWARD if backward else NORM_FUSED_FORWARD
        return Work(2 * passes * s * e, 2 * kernels)
    if not backward:
        casts = 0 if s == r else 2 * (s + r) * e  # x up, y back
        # pow (2), mean (1), x*rsqrt (2), *weight (2)
        return Work(2 * (7 * r * e + casts), 2 * (6 + (2 if casts else 0)))
    if dtypes.sharded:  # `rms_norm_backward_math`
        casts = 3 * (s + r) * e if s != r else 0  # x and dy up, dx back
        weight_casts = 2 if dtypes.compute != r else 0  # the weight up, its gradient back
        # x*rstd, dy*n, sum, dy*w, g*n, mean, n*=, g-=, g*=rstd
        return Work(2 * (76 * e + casts), 2 * (9 + (3 if casts else 0) + weight_casts))
    casts = 0 if s == r else 2 * (s + r) * e
    # mul/weight-grad, x*rsqrt, rsqrt-grad, mean/pow, sum (autograd's FP32 norm)
    return Work(2 * (16 * r * e + casts), 2 * (10 + (2 if casts else 0)))


def _attention_forward_work(q: int, k: int, c: int, gqa: bool, rank: RankKernels) -> Work:
    """`runtime/_all_to_all.py`, `_ring.py`, `_block.py` forward, per token: pack and unpack
    (q, k, v in; output out; none for a one-member group), q and the stacked k, v to
    head-major, the GQA expansion (a broadcast copy), the merge of each block result after
    the first into an FP32 state (its upcast, the rescale, the result's upcast, product and
    sum), the cast back after a merge, the transpose back."""
    r = FP32
    packing = Work(0.0, 0) if rank.alone else Work(2 * c * (q + 2 * k) + 2 * c * q, 6)
    sorting = Work(2 * c * q + 2 * 2 * 2 * c * k, 3)  # q; stack k, v; the stack
    expansion = Work(2 * c * (k + q), 1) if gqa else Work(0.0, 0)
    merges = rank.ring_steps - 1
    merge = Work((c + r) * q + merges * (8 * r + c) * q, 1 + 8 * merges) if merges else Work(0, 0)
    back = Work((r + c) * q if merges else 0.0, 1 if merges else 0) + Work(2 * c * q, 1)
    return packing + sorting + expansion + merge + back


def _attention_backward_work(q: int, k: int, c: int, gqa: bool, rank: RankKernels) -> Work:
    """The same, backward: dO unpacked and to head-major; per block after the first, the
    FP32 dQ sum (its upcast once, then reads and writes); each block's dK/dV reduced over
    the query heads of a K/V head (FP32) and written into the block's FP32 partial; the casts
    and transposes back, packing out."""
    r = FP32
    d_out = Work(2 * c * q + (0.0 if rank.alone else 2 * c * q), 1 if rank.alone else 2)
    expansion = Work(2 * c * (k + q), 1) if gqa else Work(0.0, 0)
    merges = rank.ring_steps - 1
    dq_sum = Work((c + r) * q + merges * (c + 2 * r) * q, 1 + merges) if merges else Work(0, 0)
    reduced = 2 * ((c * q + r * k) if gqa else 0.0)  # the sum over a view, to FP32
    partial = 2 * (2 * r * k if gqa else (c + r) * k)  # into the block's FP32 partial
    blocks = rank.ring_steps
    dkv = Work(blocks * (reduced + partial), blocks * (4 if gqa else 2))
    hops = Work(merges * 3 * 2 * r * k, 2 * merges)  # each later block's dK/dV summed in
    dq_back = Work(((r + c) * q if merges else 0.0) + 2 * c * q, 2 if merges else 1)
    dkv_back = Work(2 * (r + c) * k + 4 * c * k, 4)
    packing = Work(0.0, 0) if rank.alone else Work(2 * c * (q + 2 * k), 3)
    return d_out + expansion + dq_sum + dkv + hops + dq_back + dkv_back + packing


@lru_cache(maxsize=1024)  # pure; asked per rank kind of every simulation
def block_activation_casts_per_token(
    model: ModelSpec, dtypes: RuntimeDtypes, *, backward: bool
) -> Work:
    """Autocast's casts of the normed activations to the compute dtype, one per linear that
    reads them (q, k, v, gate, up), and in backward their gradients back; none when the
    stream is already in the compute dtype."""
    c, s = dtypes.compute, dtypes.stream
    if c == s:
        return Work(0.0, 0)
    return Work(5 * (s + c) * model.hidden, 5)


def weight_casts_per_layer(dtypes: RuntimeDtypes, *, backward: bool) -> Work:
    """Per matmul weight of a block, bytes of its casts: each use under autocast (forward,
    and the recompute under checkpointing) reads fp32 and writes bf16, the backward turns the
    bf16 weight gradient into fp32; with sharded states the shard's cast before the gather and the
    gradient's before the fp32 reduce-scatter (`_step_parts._cast_params` counts which).
    Multiply by the block's matmul parameters (7 kernels a pass)."""
    if dtypes.compute == MASTER_BYTES:
        return Work(0.0, 0)
    return Work(float(MASTER_BYTES + dtypes.compute), 7)


def head_weight_bytes(dtypes: RuntimeDtypes) -> int:
    """Bytes per element of the LM head weight the loss gets (and of the gradient it hands
    back): FP32 where autocast runs over FP32 weights, else the compute dtype."""
    return MASTER_BYTES if dtypes.casts_weights else dtypes.compute


LOSS_CHUNK_KERNELS = 17
"""Elementwise kernels of one chunk of `runtime/loss.py` (`_chunk_loss_and_gradient` and its
loop), casts and weight-gradient additions apart: the label mask and targets (2), row max
and shift (2), the target's gather, exp, row sum, the row scale (2), the loss (log, sub, mul,
sum), the softmax scale (div, mul), the one-hot's negation and scatter-add, the loss sum."""

LOSS_STEP_KERNELS = 6
"""Kernels of the chunked loss once a micro-batch: the labelled-token count (2), the weight
gradient accumulator's zeroing, the local share's cast, the backward's two scalings."""


def loss_chunks(model: ModelSpec, dtypes: RuntimeDtypes, tokens: np.ndarray) -> np.ndarray:
    """[rank] chunks the loss runs over `tokens[rank]` tokens of a micro-batch: the chunked
    loss's (`hexiseq.loss_chunks`), or one where the former `autocast` recipe made every
    logit at once."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if not dtypes.sharded:
        return np.minimum(tokens, 1.0)
    return np.ceil(tokens / loss_chunk_tokens(model.vocab))


def loss_work(model: ModelSpec, dtypes: RuntimeDtypes, tokens: np.ndarray) -> Work:
    """[rank] bandwidth-bound work of `runtime/loss.py`'s chunked loss for one micro-batch
    (its GEMMs are `head_gemm_work`; the head weight's compute-dtype copy is a cast). Per
    logit: upcast (c + r), row max (r), shift (2r), exp (2r), row sum (r), softmax scale (2r),
    cast back (r + c). Per chunk, with c narrower than fp32, each weight-gradient slab's
    partial is added into the fp32 accumulator (c + 2r per weight element). Per micro-batch:
    the accumulator zeroed (r), cast to a narrower weight's dtype (r + w); with a stream wider
    than c, each chunk's hidden rows cast to c and their gradient back (2 (s + c) per hidden
    element); the backward scales both gradients in place (2w and 2s)."""
    c, s, r = dtypes.compute, dtypes.stream, FP32
    e, v = model.hidden, model.vocab
    w = head_weight_bytes(dtypes)
    tokens = np.asarray(tokens, dtype=np.float64)
    chunks = loss_chunks(model, dtypes, tokens)
    casts = 0 if c == r else 2 * (c + r)
    per_logit = casts + 8 * r
    slabs = weight_gradient_slab_count(v, e, c) if c < r else 0
    accumulate = (c + 2 * r) * v * e if c < r else 0.0
    hidden_casts = 2 * (s + c) * e if s != c else 0
    weight = r * v * e + ((r + w) * v * e if w != r else 0.0) + 2 * w * v * e
    per_token = per_logit * v + hidden_casts + 2 * s * e
    kernels = chunks * (LOSS_CHUNK_KERNELS + (2 if casts else 0) + (2 if hidden_casts else 0))
    kernels = kernels + chunks * slabs + LOSS_STEP_KERNELS + (1 if w != r else 0)
    return Work(per_token * tokens + chunks * accumulate + weight, kernels)


def head_gemm_work(
    model: ModelSpec, dtypes: RuntimeDtypes, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[rank] (FLOPs, operand bytes, GEMM calls) of the LM head inside the chunked loss, one
    micro-batch. Per chunk of n tokens three GEMMs in the compute dtype: logits (n x E by
    E x V), the hidden gradient (n x V by V x E) and the weight gradient (V x n by n x E):
    the forward plus the 2x backward `hexiseq.flops` counts for the head, no more. Each reads
    the whole weight (or writes its gradient) once per chunk; the weight gradient goes into
    the fp32 accumulator in place (read and written) in fp32, or slab by slab through a
    compute-dtype partial."""
    c, r = dtypes.compute, FP32
    e, v = model.hidden, model.vocab
    tokens = np.asarray(tokens, dtype=np.float64)
    chunks = loss_chunks(model, dtypes, tokens)
    flops = (1 + LINEAR_BACKWARD_FACTOR) * head_flops_per_token(model) * tokens
    gradient_out = 2 * r if c >= r else c
    operand_bytes = c * 3 * tokens * (e + v) + chunks * v * e * (2 * c + gradient_out)
    slabs = weight_gradient_slab_count(v, e, c) if c < r else 1
    return flops, operand_bytes, chunks * (2 + slabs)


@lru_cache(maxsize=1024)  # pure; asked per rank kind of every simulation
def head_elementwise_per_token(
    model: ModelSpec, dtypes: RuntimeDtypes, rank: RankKernels = RankKernels()
) -> Work:
    """Embedding lookup (rows written in the stream's dtype) and its backward's per-token
    reads, the final RMSNorm forward and backward (as one of a block's norms)."""
    e, s = model.hidden, dtypes.stream
    embedding = Work(float(2 * s * e), 2)
    norm = [_norm_work(e, dtypes, backward=b, fused=rank.fused_norm) for b in (False, True)]
    return embedding + Work(
        (norm[0].bytes + norm[1].bytes) / 2, (norm[0].kernels + norm[1].kernels) // 2
    )


def embedding_gradient_bytes(model: ModelSpec) -> float:
    """The embedding's dense fp32 gradient is zeroed and, when tied to the LM head, added to
    the head's weight gradient (read both, write one)."""
    table = model.vocab * model.hidden
    return FP32 * table + (3 * FP32 * table if model.tied_embeddings else 0.0)


def matmul_params_per_layer(model: ModelSpec) -> int:
    """Weights of a block's seven matmuls (its parameters less the two norms)."""
    return model.params_per_layer - 2 * model.hidden


def adamw_launches(params: np.ndarray, fused: bool = False) -> np.ndarray:
    """[rank] kernels of one AdamW step over `params[rank]` fp32 parameters: the fused
    kernel, or the foreach implementation's eight, per multi_tensor_apply chunk."""
    ops = 1 if fused else ADAMW_FOREACH_OPS
    return ops * np.maximum(1.0, np.ceil(params / FOREACH_CHUNK_ELEMENTS))
