"""Per-rank memory model of the runtime's training step, term by term (docs/design.md §6).

Every term is a buffer `hexiseq.runtime` really allocates, counted from its code (the shapes and
dtypes below) and checked against what it allocates (`tests/costmodel/test_memory_runtime.py`
runs the real step on CPU under `hexiseq.runtime.allocations.AllocationTracker`, which counts
every live storage). The peak is the largest of six moments of a steady step (step >= 1, when
the AdamW states exist):

- **forward end**: parameters, AdamW states, the residual stream (the embedding output and
  every block's output: the activation checkpoints), every layer's saved activations when not
  checkpointing, the final norm's saved tensors and its output (the hidden states the loss
  takes), and autocast's cache of compute-dtype weight copies (freed when the forward's
  autocast region ends);
- **loss**: the same without the cache, plus what `runtime/loss.py`'s chunked loss allocates
  while it runs the LM head and the cross-entropy forward and backward, one chunk of tokens
  at a time (`hexiseq.loss_chunks`): the hidden states' gradient and the weight's FP32
  gradient accumulator, a compute-dtype copy of an FP32 head weight, and one chunk's logits
  with their FP32 upcast and gradient (no logits of all tokens ever exist);
- **head backward** (the final norm's, first in the backward): the forward's tensors, the
  head weight's gradient the loss left and the norm's FP32 gradient temporaries;
- **first layer backward** (the last block, with every activation still held) and **last
  layer backward** (block 0, with every gradient): a layer's activations (recomputed under
  checkpointing) plus the larger of its MLP-phase and attention-phase transients;
- **optimizer**: parameters, gradients and AdamW states (fused AdamW makes no temporary; the
  former recipe's foreach AdamW one FP32 temporary the size of the parameters), while the
  step's hidden states are still referenced by the train loop.

Dtypes follow the runtime's recipe (`TrainSpec.runtime_recipe`): parameters, gradients and
AdamW states in FP32; `sharded` (what the runtime runs, on any number of ranks) gathers the
weights in the compute dtype, so the residual stream is in the compute dtype too; the former
`autocast` recipe kept FP32 weights, autocast cast each linear's weight at every use, and the
stream stayed FP32 (the embedding is not autocast).

On CUDA the peak is what `torch.cuda.max_memory_allocated` reports plus kernel workspaces the
CPU does not have; outside it, and still on the card, are the CUDA context, NCCL's buffers and
the caching allocator's fragmentation (`reserve`), which the 95 % cap must leave room for.

Where peaks were measured (`hexiseq run` records each rank's), a fitted cost model may carry a
`MemoryCalibration` per device type (reserve + scale x the model); `rank_memory` applies it term
by term, so the terms still add up and stay affine in the tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

from hexiseq.catalog import GiB, MiB
from hexiseq.cluster import Cluster
from hexiseq.costmodel._runtime_work import (
    MASTER_BYTES,
    RuntimeDtypes,
    head_weight_bytes,
    runtime_dtypes,
)
from hexiseq.layout import AttentionLayout
from hexiseq.loss_chunks import loss_chunk_tokens, weight_gradient_slab_rows
from hexiseq.model import ModelSpec, TrainSpec

MEMORY_LIMIT_FRACTION = 0.95
FP32 = 4
# CUDA kernels' workspaces inside `max_memory_allocated` that a CPU run does not allocate:
# cuBLAS/cuBLASLt workspaces (32 MiB each on Hopper, PyTorch `CublasHandlePool.cpp`) and the
# flash kernels' small buffers. Checked against the shared H100 run of `small` at 32K tokens
# (measured 2.386 GiB allocated, this model without the term 2.31 GiB).
CUDA_WORKSPACE_BYTES = 64 * MiB
# Outside `max_memory_allocated`, on the card: the CUDA context with cuBLAS/cuDNN loaded
# (~0.5-0.6 GiB on Hopper, torch 2.x) and NCCL's channel buffers (~0.3 GiB per communicator
# on NVLink at default NCCL_BUFFSIZE 4 MiB x channels): 1 GiB.
CUDA_CONTEXT_BYTES = GiB
# The caching allocator's reserved-but-unallocated memory. `hexiseq run` sets
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which maps segments as they grow instead
# of splitting fixed ones; the default allocator left 9 GiB unallocated at the shared H100
# run's OOM (16K tokens, llama3.2-3b) while expandable segments ran it at 89 % of the card.
CUDA_FRAGMENTATION_FRACTION = 0.03
# CPU: the interpreter, torch and gloo (resident, outside tensor allocations).
CPU_RESERVE_BYTES = GiB // 4


@dataclass(frozen=True, slots=True)
class MemoryCalibration:
    """Measured peak ≈ `reserve_bytes` + `scale` x (modelled peak - modelled reserve), for one
    device type: the framework's fixed footprint as measured, and how the measured growth
    with the work compares with the model's terms (allocator rounding, temporaries)."""

    reserve_bytes: int
    scale: float

    def term(self, modelled_bytes: int) -> int:
        return int(round(self.scale * modelled_bytes))


PHASES = (
    "forward_end",
    "loss",
    "head_backward",
    "first_layer_backward:mlp",
    "first_layer_backward:attention",
    "last_layer_backward:mlp",
    "last_layer_backward:attention",
    "optimizer",
)
"""The moments of a step whose allocations the model adds up; each is affine in the tokens."""


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """One rank's memory by term, in bytes; `phase_bytes` adds them up per moment of the step.

    States (this rank's shard): `parameters`, `gradients`, `optimizer_states`;
    `gathered_parameters`: the root unit gathered in the compute dtype (forward and
    backward); `sharding_backward_buffers`: a block's gathered weights and its gradients'
    reduce-scatter buffers (backward only).
    Activations: `embedding_output` (the stream's first tensor and RoPE's tables),
    `checkpoints` (every block's output; `block_output` is one of them),
    `saved_activations` (every layer's, without checkpointing), `layer_activations` (one
    layer's, recomputed under checkpointing; `mlp_activations` is its part freed before the
    attention backward), `weight_cache` (autocast's copies of every weight, forward only),
    `head_activations` (the final norm's saved tensors), `logits` (the hidden states the
    loss takes: the train loop holds them to the step's end; no logits outlive the loss).
    Transients: `loss_transients` (the chunked loss's peak), `head_gradients` (the head
    weight's gradient the loss leaves for the backward), `head_backward_transients` (the
    final norm's backward), `mlp_backward_transients`,
    `attention_backward_transients`, `ring_buffers`, `optimizer_transients`;
    `pending_gradients`: the gradients not yet made when block 0's MLP backward peaks.
    Device: `kernel_workspaces` (allocated); `reserve` (context, not allocated) and
    `fragmentation` (the allocator's reserved-but-unallocated share of each phase)."""

    parameters: int
    gradients: int
    optimizer_states: int
    gathered_parameters: int
    sharding_backward_buffers: int
    embedding_output: int
    checkpoints: int
    block_output: int
    saved_activations: int
    layer_activations: int
    mlp_activations: int
    weight_cache: int
    head_activations: int
    logits: int
    loss_transients: int
    head_gradients: int
    head_backward_transients: int
    mlp_backward_transients: int
    attention_backward_transients: int
    ring_buffers: int
    pending_gradients: int
    optimizer_transients: int
    kernel_workspaces: int
    reserve: int
    fragmentation: float = 0.0

    @property
    def model_states(self) -> int:
        """Parameters, gradients and AdamW states of this rank's shard."""
        return self.parameters + self.gradients + self.optimizer_states

    def phase_bytes(self) -> dict[str, int]:
        """Bytes allocated at each moment of the step (`PHASES`): what CUDA's
        `max_memory_allocated` counts, without the reserve and fragmentation."""
        return dict(zip(PHASES, self.allocated_by_phase()))

    def allocated_by_phase(self) -> tuple[int, ...]:
        """`phase_bytes`' values, in `PHASES` order (the planner asks for them by the
        thousand: no dict)."""
        states = self.parameters + self.optimizer_states + self.kernel_workspaces
        held = states + self.gathered_parameters
        backward = held + self.sharding_backward_buffers
        stream = self.embedding_output + self.checkpoints
        forward = held + stream + self.saved_activations + self.head_activations + self.logits
        # In the backward the layer at work holds its activations (recomputed, or still saved:
        # `saved_activations` already holds them then) and one phase's transients. The last
        # block's output went with the final norm's backward; block 0 runs with every
        # gradient made but its own and the embedding's.
        first = backward + stream - self.block_output
        first += max(self.saved_activations, self.layer_activations)
        first += self.logits + self.head_gradients
        last = backward + self.gradients - self.pending_gradients + self.embedding_output
        last += self.layer_activations + self.logits
        mlp = self.mlp_backward_transients
        attention = self.attention_backward_transients + self.ring_buffers - self.mlp_activations
        return (  # in PHASES order
            forward + self.weight_cache,
            forward + self.loss_transients,
            forward + self.head_gradients + self.head_backward_transients,
            first + mlp,
            first + attention,
            last + mlp,
            last + attention,
            states + self.gradients + self.logits + self.optimizer_transients,
        )

    def phase_peaks(self) -> dict[str, int]:
        """What each moment needs of the device: allocated bytes, the allocator's
        fragmentation around them, and the reserve."""
        return dict(zip(PHASES, self.peaks_by_phase()))

    def peaks_by_phase(self) -> list[int]:
        """`phase_peaks`' values, in `PHASES` order."""
        factor, reserve = 1.0 + self.fragmentation, self.reserve
        return [int(allocated * factor) + reserve for allocated in self.allocated_by_phase()]

    @property
    def peak_phase(self) -> str:
        phases = self.phase_bytes()
        return max(phases, key=phases.__getitem__)

    @property
    def allocated_bytes(self) -> int:
        """The largest phase: the peak of allocated memory (CUDA `max_memory_allocated`)."""
        return max(self.allocated_by_phase())

    @property
    def peak_bytes(self) -> int:
        """What the device must hold at the worst moment: allocated, fragmentation, reserve
        (the largest phase's: the fragmentation's product and its rounding down are
        monotone)."""
        return int(self.allocated_bytes * (1.0 + self.fragmentation)) + self.reserve

    def terms(self) -> dict[str, int]:
        """The peak phase split into the terms a person reads; they add up to `peak_bytes`."""
        phase = self.peak_phase
        states = self.parameters + self.optimizer_states
        sharding = self.gathered_parameters
        if phase == "optimizer":
            states, sharding, activations = states + self.gradients, 0, 0
        elif phase.startswith("last_layer"):
            states += self.gradients - self.pending_gradients
            sharding += self.sharding_backward_buffers
            activations = self.embedding_output + self.layer_activations
        else:
            activations = self.embedding_output + self.checkpoints + self.saved_activations
            if phase.startswith("first_layer"):
                sharding += self.sharding_backward_buffers
                activations += max(self.layer_activations - self.saved_activations, 0)
                activations -= self.block_output
        allocated = self.allocated_bytes
        return {
            "model_states": states,
            "sharding_buffers": sharding,
            "activations": activations,
            "working_set": allocated - states - sharding - activations - self.kernel_workspaces,
            "workspaces": self.kernel_workspaces,
            "reserve": self.peak_bytes - allocated,
        }

    def to_dict(self) -> dict[str, int | float]:
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
    heads, the largest ring block that visits it (0 with one group) and whether it is a
    CPU. (How the weights are held is the train spec's `runtime_recipe`.)"""

    tokens: int
    segment: int
    heads: int
    kv_heads: int
    largest_block: int
    is_cpu: bool = False
    ring_groups: int = 3  # groups in the ring; 2 holds fewer blocks in flight (ring buffers)


def _shape_keys(cluster: Cluster, layout: AttentionLayout) -> list[tuple]:
    """Every rank's `RankShape` fields, in field order, as a tuple: one pass over the groups
    and the ranks (`layout.group_of(rank)` per rank would be O(N²) on 1024 ranks)."""
    group_count = len(layout.groups)
    lengths = layout.segment_lengths
    largest = max(lengths) if group_count > 1 else 0
    segment = [0] * layout.world_size
    for g, members in enumerate(layout.groups):
        for rank in members:
            segment[rank] = lengths[g]
    ratio = layout.gqa_ratio
    return [
        (tokens, length, end - start, -(-end // ratio) - start // ratio, largest, cpu, group_count)
        for tokens, length, (start, end), cpu in zip(
            layout.token_counts,
            segment,
            layout.head_ranges,
            [device.gpu == "cpu" for device in cluster.devices],
            strict=True,
        )
    ]


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
    `MemoryBreakdown` per rank (ranks of one shape, share and GPU type share one)."""
    fractions = state_fractions or even_state_fractions(layout.world_size)
    calibrations = calibrations or {}
    found: dict[tuple, MemoryBreakdown] = {}
    breakdowns = []
    gpus = [device.gpu for device in cluster.devices]
    for key in zip(_shape_keys(cluster, layout), fractions, gpus):
        breakdown = found.get(key)
        if breakdown is None:
            fields, fraction, gpu = key
            breakdown = rank_memory(
                model, train, RankShape(*fields), fraction, calibrations.get(gpu)
            )
            found[key] = breakdown
        breakdowns.append(breakdown)
    return breakdowns


def rank_memory(
    model: ModelSpec,
    train: TrainSpec,
    shape: RankShape,
    state_fraction: float,
    calibration: MemoryCalibration | None = None,
) -> MemoryBreakdown:
    """Memory of one rank of the given shape, by term. Every term is affine in the shape's
    token counts and in `state_fraction`, so every phase is (the planner's MILP relies on
    it), with a `calibration` too."""
    modelled = _modelled_memory(model, train, shape, state_fraction)
    if calibration is None:
        return modelled
    terms = {
        name: calibration.term(value)
        for name, value in asdict(modelled).items()
        if name not in ("reserve", "fragmentation")
    }
    return MemoryBreakdown(
        **terms, reserve=calibration.reserve_bytes, fragmentation=modelled.fragmentation
    )


@lru_cache(maxsize=1 << 16)
def _modelled_memory(
    model: ModelSpec, train: TrainSpec, shape: RankShape, state_fraction: float
) -> MemoryBreakdown:
    dtypes = runtime_dtypes(train)
    layer = layer_activation_bytes(model, dtypes, shape)
    cuda = not shape.is_cpu
    return MemoryBreakdown(
        parameters=int(model.params * MASTER_BYTES * state_fraction),
        gradients=int(model.params * MASTER_BYTES * state_fraction),
        optimizer_states=int(
            model.params * (train.bytes_per_param_state - 2 * MASTER_BYTES) * state_fraction
        ),
        gathered_parameters=gathered_parameter_bytes(model, dtypes, shape),
        sharding_backward_buffers=sharding_backward_bytes(model, dtypes, shape),
        embedding_output=embedding_output_bytes(model, dtypes, shape.tokens),
        checkpoints=model.layers * shape.tokens * model.hidden * dtypes.stream,
        block_output=shape.tokens * model.hidden * dtypes.stream,
        saved_activations=0 if train.activation_checkpointing else model.layers * layer,
        layer_activations=layer,
        mlp_activations=mlp_activation_bytes(model, dtypes, shape.tokens),
        weight_cache=weight_cache_bytes(model, dtypes, train.activation_checkpointing),
        **_head_and_loss_terms(model, train, dtypes, shape.tokens),
        head_backward_transients=head_backward_bytes(model, dtypes, shape.tokens),
        mlp_backward_transients=mlp_backward_bytes(model, dtypes, shape.tokens),
        attention_backward_transients=attention_backward_bytes(model, dtypes, shape, cuda),
        ring_buffers=ring_buffer_bytes(model, dtypes, shape),
        pending_gradients=int(pending_gradient_params(model) * MASTER_BYTES * state_fraction),
        optimizer_transients=optimizer_transient_bytes(model, dtypes, state_fraction),
        kernel_workspaces=CUDA_WORKSPACE_BYTES if cuda else 0,
        reserve=CUDA_CONTEXT_BYTES if cuda else CPU_RESERVE_BYTES,
        fragmentation=CUDA_FRAGMENTATION_FRACTION if cuda else 0.0,
    )


def _linear_params_per_layer(model: ModelSpec) -> int:
    return model.params_per_layer - 2 * model.hidden  # without the two RMSNorm weights


def pending_gradient_params(model: ModelSpec) -> int:
    """Parameters whose gradients do not exist yet at block 0's MLP-backward peak: block 0's
    own but the down projection's (done first), and an untied embedding's (made last)."""
    embedding = 0 if model.tied_embeddings else model.embedding_params
    return model.params_per_layer - model.hidden * model.ffn_hidden + embedding


def optimizer_transient_bytes(
    model: ModelSpec, dtypes: RuntimeDtypes, state_fraction: float
) -> int:
    """AdamW's temporaries: none for the fused kernel the runtime runs; the former recipe's
    foreach AdamW made one FP32 parameter-sized temporary (sqrt of the second moment)."""
    if dtypes.sharded:
        return 0
    return int(model.params * MASTER_BYTES * state_fraction)


def gathered_parameter_bytes(model: ModelSpec, dtypes: RuntimeDtypes, shape: RankShape) -> int:
    """The root unit (embedding, final norm, LM head) gathered in the compute dtype
    (`runtime/sharding.py`): it stays gathered from the forward until its backward, the
    last. Nothing in the former one-rank recipe (whole FP32 weights)."""
    if not dtypes.sharded:
        return 0
    return (model.embedding_params + model.head_params) * dtypes.compute


def sharding_backward_bytes(model: ModelSpec, dtypes: RuntimeDtypes, shape: RankShape) -> int:
    """The sharding's buffers while a block's backward runs (`runtime/sharding.py`): the
    block's weights gathered again in the compute dtype and their gradients, in it, as the
    layer makes them. (The block's FP32 gradient buffer and reduce-scatter output come
    after its activations are gone, and are smaller than them.) A block's forward gathers
    its weights only while it runs."""
    if not dtypes.sharded:
        return 0
    return int(model.params_per_layer * 2 * dtypes.compute)


def embedding_output_bytes(model: ModelSpec, dtypes: RuntimeDtypes, tokens: int) -> int:
    """The embedding's output (block 0's input) and RoPE's cos and sin tables (T x D each),
    in the stream's dtype (`runtime/model.py` `rope_tables`)."""
    return tokens * (model.hidden + 2 * model.head_dim) * dtypes.stream


def _norm_saved_bytes(
    model: ModelSpec, dtypes: RuntimeDtypes, tokens: int, fresh_input: bool = True
) -> int:
    """An RMSNorm's saved tensors. The runtime's (`runtime/_elementwise.py`, the `sharded`
    recipe): its input, which costs nothing when another term already holds it (a block's
    input is the previous block's output: `fresh_input` False), and the FP32 reciprocal RMS
    per token. The former `autocast` recipe's autograd norm: the FP32 normalized input, the
    reciprocal RMS, and an FP32 copy of the input when the stream is not FP32; an FP32 input
    is the stream tensor itself."""
    if dtypes.sharded:
        return tokens * (FP32 + (model.hidden * dtypes.stream if fresh_input else 0))
    upcast = model.hidden * FP32 if dtypes.stream != FP32 else 0
    return tokens * (model.hidden * FP32 + FP32 + upcast)


def _input_copies(dtypes: RuntimeDtypes, consumers: int) -> int:
    """Copies of a norm's output the projections save: autocast casts it for each consumer
    when its dtype differs from the compute dtype; otherwise all share one tensor."""
    return consumers if dtypes.stream != dtypes.compute else 1


def layer_activation_bytes(model: ModelSpec, dtypes: RuntimeDtypes, shape: RankShape) -> int:
    """What one decoder block saves for its backward on this rank, its output excluded (the
    output is the next block's checkpoint). From `runtime/model.py` and `runtime/_ring.py`:

    - attention norm (`_norm_saved_bytes`); its output for q, k and v (`_input_copies`);
    - head form over the group's segment (`RingAttention.forward`): q, K and V (sorted
      contiguous copies), the output in the compute dtype and the FP32 log-sum-exp;
    - the attention output in sequence form, saved by the output projection;
    - the MLP part (`mlp_activation_bytes`);
    - with autocast over FP32 weights, every linear's compute-dtype weight copy.
    """
    c, tokens, segment = dtypes.compute, shape.tokens, shape.segment
    q_width = model.heads * model.head_dim
    norm = _norm_saved_bytes(model, dtypes, tokens, fresh_input=False)
    qkv_inputs = _input_copies(dtypes, 3) * tokens * model.hidden * c
    rank_q, rank_kv = shape.heads * model.head_dim, shape.kv_heads * model.head_dim
    head_form = segment * ((2 * rank_q + 2 * rank_kv) * c + shape.heads * FP32)
    output_projection = tokens * q_width * c
    attention_weights = _attention_weight_copies(model, dtypes)
    mlp = mlp_activation_bytes(model, dtypes, tokens)
    return norm + qkv_inputs + head_form + output_projection + attention_weights + mlp


def _attention_weight_copies(model: ModelSpec, dtypes: RuntimeDtypes) -> int:
    if not dtypes.casts_weights:
        return 0
    return (_linear_params_per_layer(model) - 3 * model.hidden * model.ffn_hidden) * dtypes.compute


def mlp_activation_bytes(model: ModelSpec, dtypes: RuntimeDtypes, tokens: int) -> int:
    """The block's part freed before its attention backward: the MLP norm's saved tensors
    (its input, the residual sum, is a fresh tensor), its output for gate and up, SwiGLU's
    saved tensors and the product (saved by the down projection), and the MLP weights'
    compute-dtype copies under autocast. SwiGLU saves gate and up (`runtime/_elementwise.py`;
    3 x ffn per token with the product); the former recipe's autograd SwiGLU also kept
    silu(gate) (4 x ffn)."""
    c = dtypes.compute
    norm = _norm_saved_bytes(model, dtypes, tokens)
    if not dtypes.sharded and dtypes.stream == FP32:
        norm += tokens * model.hidden * FP32  # the residual sum itself is the FP32 input
    inputs = _input_copies(dtypes, 2) * tokens * model.hidden * c
    swiglu = (3 if dtypes.sharded else 4) * tokens * model.ffn_hidden * c
    weights = 3 * model.hidden * model.ffn_hidden * c if dtypes.casts_weights else 0
    return norm + inputs + swiglu + weights


def weight_cache_bytes(model: ModelSpec, dtypes: RuntimeDtypes, checkpointing: bool) -> int:
    """Autocast's cache of compute-dtype weight copies, held until the forward's autocast
    region ends. Without checkpointing every copy is saved by its matmul anyway
    (`layer_activation_bytes`); with it the cache alone holds them."""
    if not (dtypes.casts_weights and checkpointing):
        return 0
    return model.layers * _linear_params_per_layer(model) * dtypes.compute


LEGACY_LOSS_BYTES_PER_LOGIT = 12
"""The `autocast` recipe's loss over full logits: the FP32 log-softmax output (saved), its
gradient and the logits' gradient."""


def _head_and_loss_terms(
    model: ModelSpec, train: TrainSpec, dtypes: RuntimeDtypes, tokens: int
) -> dict[str, int]:
    """The head's and the loss's terms. The runtime's chunked loss: the hidden states the
    train loop holds (`logits`), the loss's chunk transients. The former `autocast` recipe
    made every logit in the compute dtype, kept them, and upcast them all to FP32."""
    if not dtypes.sharded:
        norm = _norm_saved_bytes(model, dtypes, tokens)
        output = tokens * model.hidden * dtypes.compute  # the norm's output, saved by the head
        weight_copy = model.vocab * model.hidden * dtypes.compute if dtypes.casts_weights else 0
        return {
            "head_activations": norm + output + weight_copy,
            "logits": tokens * model.vocab * dtypes.compute,
            "loss_transients": tokens * model.vocab * LEGACY_LOSS_BYTES_PER_LOGIT,
            "head_gradients": model.vocab * model.hidden * MASTER_BYTES,
        }
    return {
        "head_activations": head_activation_bytes(model, dtypes, tokens),
        "logits": tokens * model.hidden * dtypes.stream,
        "loss_transients": loss_transient_bytes(model, train, dtypes, tokens),
        "head_gradients": model.vocab * model.hidden * head_weight_bytes(dtypes),
    }


def head_activation_bytes(model: ModelSpec, dtypes: RuntimeDtypes, tokens: int) -> int:
    """The final norm's saved tensors. The runtime's norm saves its input, the last block's
    output (`checkpoints` counts it), and the reciprocal RMS. The former recipe's norm saved
    its FP32 upcast instead, so where the stream is narrower than FP32 nothing kept the
    output. The norm's output (the hidden states) is the `logits` term: the chunked loss saves
    nothing of it, the train loop holds it."""
    if dtypes.sharded:
        return _norm_saved_bytes(model, dtypes, tokens, fresh_input=False)
    freed = tokens * model.hidden * dtypes.stream if dtypes.stream != FP32 else 0
    return _norm_saved_bytes(model, dtypes, tokens) - freed


def head_backward_bytes(model: ModelSpec, dtypes: RuntimeDtypes, tokens: int) -> int:
    """The final norm's backward at its peak, above its saved tensors. The runtime's
    (`runtime/_elementwise.py` `rms_norm_backward`): three FP32 T x E tensors (the normalized
    input, the FP32 output gradient, their product or dy x weight) and the input gradient
    in the stream dtype. The former recipe's autograd norm: five FP32 T x E gradients and
    temporaries (input gradient by the scale path, the mean's expanded gradient, x, 2x, their
    product), its FP32 normalized input freed by then."""
    if dtypes.sharded:
        return tokens * model.hidden * (3 * FP32 + dtypes.stream)
    return 4 * tokens * model.hidden * FP32


def modelled_loss_chunk_tokens(model: ModelSpec, train: TrainSpec, tokens: int) -> int:
    """Tokens of the loss's largest chunk on a rank of `tokens` tokens, kept affine in
    `tokens` (the planner's MILP needs it): a sequence no longer than one chunk
    (`hexiseq.loss_chunks.loss_chunk_tokens`) is one chunk on every rank, exactly; a longer
    one is counted a full chunk on every rank (exact where a rank holds a chunk or more, an
    upper bound of at most one chunk where it holds less)."""
    chunk = loss_chunk_tokens(model.vocab)
    return tokens if train.seq_len <= chunk else chunk


def loss_chunk_bytes(model: ModelSpec, dtypes: RuntimeDtypes, chunk_tokens: int) -> int:
    """One chunk's peak in the chunked loss (`runtime/loss.py` `_ChunkedHeadLoss`). FP32
    compute: its logits, then softmax and gradient made in place. Narrower: the logits and
    their FP32 upcast, then the upcast and the gradient cast back; then the gradient with the
    hidden gradient's compute-dtype rows (when the stream is wider) or a weight-gradient slab
    (`hexiseq.loss_chunks.weight_gradient_slab_rows`); throughout, the chunk's hidden states
    cast to the compute dtype when the stream is wider."""
    c, e, v = dtypes.compute, model.hidden, model.vocab
    if c >= FP32:
        return chunk_tokens * v * c
    upcast = chunk_tokens * v * (c + FP32)
    wider_stream = dtypes.stream != c
    hidden_rows = chunk_tokens * e * c if wider_stream else 0
    slab = weight_gradient_slab_rows(v, e, c) * e * c
    return hidden_rows + max(upcast, chunk_tokens * v * c + max(hidden_rows, slab))


def loss_transient_bytes(
    model: ModelSpec, train: TrainSpec, dtypes: RuntimeDtypes, tokens: int
) -> int:
    """The chunked loss's peak above what the forward left: the hidden states' gradient
    (stream dtype) and the head weight's FP32 gradient accumulator throughout; during the
    chunks a compute-dtype copy of an FP32 head weight and one chunk (`loss_chunk_bytes`);
    at the end, when the weight is narrower than FP32, the gradient cast to its dtype."""
    e, v = model.hidden, model.vocab
    held = tokens * e * dtypes.stream + v * e * FP32
    weight_copy = v * e * dtypes.compute if dtypes.casts_weights else 0
    chunk_tokens = modelled_loss_chunk_tokens(model, train, tokens)
    chunks = weight_copy + loss_chunk_bytes(model, dtypes, chunk_tokens)
    weight_bytes = head_weight_bytes(dtypes)
    cast = v * e * weight_bytes if weight_bytes != FP32 else 0
    return held + max(chunks, cast)


def mlp_backward_bytes(model: ModelSpec, dtypes: RuntimeDtypes, tokens: int) -> int:
    """The MLP backward's peak, above the block's activations: the SwiGLU product's gradient
    and two more of its size (autograd's: the gradients of silu(gate) and of up; the
    runtime's `swiglu_backward`: dP x up, then d_gate and d_up), the product itself freed:
    net 2 x ffn per token, and
    the residual stream's gradient; the down projection's weight copy is freed by then."""
    per_token = 2 * model.ffn_hidden * dtypes.compute + model.hidden * dtypes.stream
    down_copy = model.hidden * model.ffn_hidden * dtypes.compute if dtypes.casts_weights else 0
    return tokens * per_token - down_copy


def attention_backward_bytes(
    model: ModelSpec, dtypes: RuntimeDtypes, shape: RankShape, cuda: bool
) -> int:
    """The attention backward's peak above the block's activations (`runtime/_ring.py`,
    `runtime/_block.py`): the sorted dO copy and the kernel's dq over the segment, and with
    more than one ring group the FP32 dQ sum they are added into (one group: the kernel's dq
    is the sum, `RowSum`); a block's K/V expanded to the query heads (GQA), the kernel's dk,
    dv of a tile, the block's FP32 dK/dV partial and one of them reduced to the K/V heads
    (FP32) on its way in; the residual stream's gradient and the attention output's gradient
    in sequence form. FlashAttention-2's CUDA backward adds its own FP32 dQ accumulator (Dao
    2023, Algorithm 2)."""
    c, segment = dtypes.compute, shape.segment
    block = max(shape.segment, shape.largest_block)
    rank_q, rank_kv = shape.heads * model.head_dim, shape.kv_heads * model.head_dim
    dq_sum = FP32 if shape.ring_groups > 1 else 0
    query_side = segment * rank_q * (dq_sum + c + c + (FP32 if cuda else 0))
    key_side = block * (2 * rank_q * (c + c) + 3 * rank_kv * FP32)
    sequence = shape.tokens * (model.hidden * dtypes.stream + model.heads * model.head_dim * c)
    return query_side + key_side + sequence


def ring_buffer_bytes(model: ModelSpec, dtypes: RuntimeDtypes, shape: RankShape) -> int:
    """Ring attention's in-flight blocks in the backward pass, sized for the largest block
    that visits (Liu et al. 2023, Ring Attention; `runtime/_ring.py` `ring_backward`); the
    rank's own block's FP32 dK/dV held home is `attention_backward_bytes`' reduced dK/dV
    (the step's own partial is not yet made at the kernel's peak). With
    three groups or more, a middle step holds the K/V block in hand and the next one
    (compute dtype), the partial dK/dV just sent and the travelling one received (FP32).
    With two, the backward peaks in its last step, where only the block in hand is left
    (the next K/V block was the last to come, the dK/dV hop follows the step)."""
    if shape.ring_groups == 2:
        return shape.largest_block * 2 * shape.kv_heads * model.head_dim * dtypes.compute
    per_block = 2 * shape.kv_heads * model.head_dim * (dtypes.compute + FP32)
    return 2 * shape.largest_block * per_block
