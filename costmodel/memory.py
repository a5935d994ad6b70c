"""Closed-form memory model per rank (DESIGN.md §6).

Peak memory of a rank during a training step is

    model states + sharding buffers + activation checkpoints + framework reserve
    + the largest transient: one layer's backward at its peak phase, or the loss's logits.

A layer's backward peaks either in its MLP phase (all its activations + MLP gradients) or in
its attention phase (the MLP activations freed; dq/dk/dv and the ring's travelling blocks).
The logits live between the last layer's forward and the LM head's backward, when no layer
is being recomputed, so they never coexist with a layer's working set. Each term's source is
in its function's docstring. Everything is in bytes.

Where peaks were measured (`hexiseq run` records each rank's), a fitted cost model carries a
`MemoryCalibration` per device type: the measured peak ≈ reserve + scale x (the model's peak
without its reserve), fitted by `hexiseq fit`. `rank_memory` applies it term by term (every
term scaled, the reserve replaced), so the terms still add up and stay affine in the tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from hexiseq.catalog import GiB
from hexiseq.cluster import Cluster
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec

MEMORY_LIMIT_FRACTION = 0.95
# CUDA context (~0.5 GiB on Hopper), NCCL channel buffers and caching-allocator fragmentation:
# an assumption where no peak was measured (a `MemoryCalibration` replaces it).
GPU_RESERVE_BYTES = 2 * GiB
CPU_RESERVE_BYTES = GiB // 4
LOGITS_BYTES_PER_ELEMENT = 6  # BF16 logits + their FP32 upcast for a stable cross-entropy
FP32 = 4


@dataclass(frozen=True, slots=True)
class MemoryCalibration:
    """Measured peak ≈ `reserve_bytes` + `scale` x (modelled peak - modelled reserve), for one
    device type: the framework's fixed footprint as measured, and how the measured growth
    with the work compares with the model's terms (allocator rounding, temporaries)."""

    reserve_bytes: int
    scale: float

    def term(self, modelled_bytes: int) -> int:
        return int(round(self.scale * modelled_bytes))


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """One rank's predicted peak memory, by term, in bytes.

    Persistent through the step: model states, sharding buffers, checkpoints, reserve.
    Transient, one at a time: a layer's backward (its activations plus the MLP-phase or the
    attention-phase transients, whichever is larger) or the loss's logits.
    """

    model_states: int
    sharding_buffers: int
    checkpoints: int
    layer_activations: int
    mlp_activations: int
    mlp_backward_transients: int
    attention_backward_transients: int
    ring_buffers: int
    logits: int
    reserve: int

    @property
    def working_set_bytes(self) -> int:
        """The largest transient: one layer's backward at its peak phase, or the logits."""
        mlp_phase = self.layer_activations + self.mlp_backward_transients
        attention_phase = (
            self.layer_activations
            - self.mlp_activations
            + self.attention_backward_transients
            + self.ring_buffers
        )
        return max(mlp_phase, attention_phase, self.logits)

    @property
    def peak_bytes(self) -> int:
        persistent = self.model_states + self.sharding_buffers + self.checkpoints + self.reserve
        return persistent + self.working_set_bytes

    def terms(self) -> dict[str, int]:
        """The peak split into the terms a person reads: they add up to `peak_bytes`."""
        return {
            "model_states": self.model_states,
            "sharding_buffers": self.sharding_buffers,
            "checkpoints": self.checkpoints,
            "working_set": self.working_set_bytes,
            "reserve": self.reserve,
        }

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def memory_limit_bytes(capacity_bytes: int) -> int:
    """What a plan may use of a device: 95 % of its capacity (the HexiSeq paper's bound)."""
    return int(capacity_bytes * MEMORY_LIMIT_FRACTION)


def even_state_fractions(world_size: int) -> list[float]:
    """Model states sharded evenly across the domain (FSDP/ZeRO-3 default)."""
    return [1.0 / world_size] * world_size


@dataclass(frozen=True, slots=True)
class RankShape:
    """What a rank's memory depends on: its tokens, its group's segment, its heads and K/V
    heads, the largest ring block that visits it (0 with one group), and whether it is a CPU."""

    tokens: int
    segment: int
    heads: int
    kv_heads: int
    largest_block: int
    is_cpu: bool = False


def rank_shapes(cluster: Cluster, layout: AttentionLayout) -> list[RankShape]:
    """The `RankShape` of every rank under `layout`."""
    group_count = len(layout.groups)
    lengths = [layout.segment_length(g) for g in range(group_count)]
    largest = max(lengths) if group_count > 1 else 0
    # One pass over the groups: `layout.group_of(rank)` per rank would be O(N²) on 1024 ranks.
    group_of = {rank: g for g, members in enumerate(layout.groups) for rank in members}
    shapes = []
    for rank, device in enumerate(cluster.devices):
        low, high = layout.kv_head_range(rank)
        shapes.append(
            RankShape(
                tokens=layout.num_tokens(rank),
                segment=lengths[group_of[rank]],
                heads=layout.num_heads_of(rank),
                kv_heads=high - low,
                largest_block=largest,
                is_cpu=device.gpu == "cpu",
            )
        )
    return shapes


def estimate_memory(
    cluster: Cluster,
    model: ModelSpec,
    train: TrainSpec,
    layout: AttentionLayout,
    state_fractions: Sequence[float] | None = None,
    calibrations: Mapping[str, MemoryCalibration] | None = None,
) -> list[MemoryBreakdown]:
    """Peak memory of every rank under `layout`, with model states sharded by `state_fractions`
    (even when None), calibrated per device type where `calibrations` has one. Returns one
    `MemoryBreakdown` per rank."""
    fractions = state_fractions or even_state_fractions(layout.world_size)
    calibrations = calibrations or {}
    return [
        rank_memory(model, train, shape, fraction, calibrations.get(device.gpu))
        for shape, fraction, device in zip(
            rank_shapes(cluster, layout), fractions, cluster.devices
        )
    ]


def rank_memory(
    model: ModelSpec,
    train: TrainSpec,
    shape: RankShape,
    state_fraction: float,
    calibration: MemoryCalibration | None = None,
) -> MemoryBreakdown:
    """Peak memory of one rank of the given shape, by term. Every term is affine in the
    shape's token counts and in `state_fraction` (the planner's MILP relies on it), with a
    `calibration` too."""
    modelled = _modelled_memory(model, train, shape, state_fraction)
    if calibration is None:
        return modelled
    terms = {name: calibration.term(value) for name, value in asdict(modelled).items()}
    return MemoryBreakdown(**(terms | {"reserve": calibration.reserve_bytes}))


def _modelled_memory(
    model: ModelSpec, train: TrainSpec, shape: RankShape, state_fraction: float
) -> MemoryBreakdown:
    return MemoryBreakdown(
        model_states=model_state_bytes(model, train, state_fraction),
        sharding_buffers=sharding_buffer_bytes(model, train),
        checkpoints=checkpoint_bytes(model, train, shape),
        layer_activations=layer_activation_bytes(model, train, shape),
        mlp_activations=mlp_activation_bytes(model, train, shape.tokens),
        mlp_backward_transients=mlp_backward_bytes(model, train, shape.tokens),
        attention_backward_transients=attention_backward_bytes(model, train, shape),
        ring_buffers=ring_buffer_bytes(model, shape),
        logits=logits_bytes(model, shape.tokens),
        reserve=CPU_RESERVE_BYTES if shape.is_cpu else GPU_RESERVE_BYTES,
    )


def model_state_bytes(model: ModelSpec, train: TrainSpec, state_fraction: float) -> int:
    """This rank's shard of parameters, gradients and Adam states.

    Mixed-precision Adam keeps 16 bytes per parameter (FP32 master weights 4, momentum 4,
    variance 4, BF16 weights 2 and gradients 2: Rajbhandari et al. 2020, ZeRO, §3.1); ZeRO-3 /
    FSDP shards all of it across the data domain, here the whole CP-HP domain (DESIGN.md §6).
    """
    return int(model.params * train.bytes_per_param_state * state_fraction)


def sharding_buffer_bytes(model: ModelSpec, train: TrainSpec) -> int:
    """Unsharded parameters gathered for compute and unsharded gradients before reduce-scatter.

    FSDP keeps the current layer's BF16 weights, prefetches the next layer's, and holds the
    current layer's BF16 gradients until they are reduce-scattered (PyTorch FSDP paper, Zhao et
    al. 2023, §3.3-3.4): three layers' worth; the LM head/embedding are gathered on their own.
    """
    layer = 3 * model.params_per_layer
    head = 2 * model.vocab * model.hidden  # weights + gradients of the LM head when gathered
    return max(layer, head) * train.compute_dtype_bytes


def checkpoint_bytes(model: ModelSpec, train: TrainSpec, shape: RankShape) -> int:
    """Activations kept through the forward pass.

    With full activation checkpointing only each layer's input (hidden per token) is kept
    (Chen et al. 2016; Korthikanti et al. 2022 §4); without it every layer keeps its working set.
    """
    if train.activation_checkpointing:
        return model.layers * shape.tokens * model.hidden * train.compute_dtype_bytes
    return model.layers * layer_activation_bytes(model, train, shape)


def layer_activation_bytes(model: ModelSpec, train: TrainSpec, shape: RankShape) -> int:
    """Activations one layer saves for its backward pass on this rank.

    What autograd keeps for a Llama block with FlashAttention (no s² scores; Korthikanti et al.
    2022 §4.1 for the method). Sequence-sharded part, per token (BF16): the first norm's output
    (saved by the q/k/v matmul), the attention output (saved by the output projection), the
    residual sum and the second norm's output (hidden each), and the MLP's activations
    (`mlp_activation_bytes`). The layer input is the checkpoint itself; q/k/v in sequence form
    are freed after the all-to-all (RoPE saves only its tables). Head-sharded part: q, k, v and
    the output of this rank's heads over its group's whole segment, plus FP32 log-sum-exp.
    """
    per_token = 3 * model.hidden + model.heads * model.head_dim
    sequence_part = shape.tokens * per_token * train.compute_dtype_bytes
    heads, kv_heads = shape.heads, shape.kv_heads
    per_segment_token = (2 * heads + 2 * kv_heads) * model.head_dim * train.compute_dtype_bytes
    head_part = shape.segment * (per_segment_token + heads * FP32)
    return sequence_part + head_part + mlp_activation_bytes(model, train, shape.tokens)


def mlp_activation_bytes(model: ModelSpec, train: TrainSpec, tokens: int) -> int:
    """SwiGLU's saved activations: gate, up, silu(gate) and the product (4 x ffn per token)."""
    return tokens * 4 * model.ffn_hidden * train.compute_dtype_bytes


def mlp_backward_bytes(model: ModelSpec, train: TrainSpec, tokens: int) -> int:
    """Gradient transients at the MLP backward's peak: d(product), d(gate), d(up)."""
    return tokens * 3 * model.ffn_hidden * train.compute_dtype_bytes


def attention_backward_bytes(model: ModelSpec, train: TrainSpec, shape: RankShape) -> int:
    """dq/dk/dv of this rank's heads over its segment plus FlashAttention's FP32 dq
    accumulator (Dao 2023, §3.2). By then the MLP's activations are freed."""
    heads, kv_heads = shape.heads, shape.kv_heads
    per_token = (heads + 2 * kv_heads) * train.compute_dtype_bytes + heads * FP32
    return shape.segment * model.head_dim * per_token


def ring_buffer_bytes(model: ModelSpec, shape: RankShape) -> int:
    """Ring attention's in-flight blocks in the backward pass (the larger of the two passes).

    The K/V block in hand and the next one (BF16, double-buffered), each with its travelling
    FP32 dK/dV accumulators, sized for the largest block that visits (Liu et al. 2023, Ring
    Attention; ring-flash-attention keeps dK/dV in FP32 while they travel).
    """
    return 2 * shape.largest_block * 2 * shape.kv_heads * model.head_dim * (2 + FP32)


def logits_bytes(model: ModelSpec, tokens: int) -> int:
    """LM-head logits of this rank's tokens for the cross-entropy loss and its gradient."""
    return tokens * model.vocab * LOGITS_BYTES_PER_ELEMENT
