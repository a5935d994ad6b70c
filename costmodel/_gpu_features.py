"""What the fitted op-time regressions of a GPU are linear in (the CPU's are in `_features`).

A GPU runs a kernel as a grid of thread blocks (CTAs) spread over its streaming
multiprocessors (SMs); a CTA occupies a slot of one SM until it ends, and the kernel ends when
its last CTA does. So the time follows the work of the busiest slot, not the total work: a
grid of 133 equal CTAs on 132 SMs takes two rounds ("wave quantization"), and a causal mask
makes the CTAs unequal. Features, per op family:
- gemm: FLOPs, bytes read + written, kernel calls, and the bytes beyond the roofline's ridge,
  max(0, bytes - FLOPs / ridge), ridge = datasheet peak FLOP/s / HBM bytes/s (Williams et al.,
  CACM 52(4), 2009): below the ridge a GEMM is bound by memory, and the bytes its compute time
  cannot hide add time. cuBLAS picks its tiles and schedules (persistent kernels on Hopper) by
  heuristics we cannot see, so no tile term is modelled for it.
- attention_fwd, attention_bwd (FlashAttention-2, the `flash` kernel, and cuDNN's, `cudnn`):
  the schedule of the kernel's own grid over the SMs, computed from its tile sizes
  (`flash_schedule`): the FLOPs of the tiles the critical slot (the one that ends last) runs
  while it shares a resource and while it runs alone (below), the (query, key) pairs of those
  tiles (softmax work that does not grow with head_dim), the CTAs it runs (each loads its Q /
  K-V block and writes its output once), the bytes of q, k, v, o (+ dO, dq, dk, dv backward;
  + the split-KV partial outputs) and the kernel calls.
- elementwise: bytes read + written, kernel calls, and the bytes of a call beyond a knee,
  max(0, bytes - knee). The knee is the L2 capacity (what the previous call left in the L2 is
  read from there, the rest streams from HBM) or, where the points put it lower, the size up
  to which the launch floor hides the kernel (`hexiseq.costmodel._regression.fit_knee`).
The calls term is the fixed cost of a launch, as on the CPU. A call timed by CUDA events
costs at least the host's issue time of the call (~15 us for an elementwise add, ~40 us for
cuDNN attention on an H200): the kernel's own time hides under it until it is longer, so time
= max(floor, launch + work / rate), which the knee of elementwise and the calls term of the
larger kernels stand for.

FlashAttention-2 as PyTorch ships it (aten/src/ATen/native/transformers/cuda/flash_attn,
from Dao, arXiv:2307.08691):
- forward, `flash_fwd_launch_template.h`: tiles (kBlockM x kBlockN) 128 x 128 for head_dim
  <= 64, 128 x 64 up to 128 (H100/A100; sm86/89 differ), 4 warps; grid (query blocks, batch,
  heads), query blocks fastest. A CTA runs the key blocks its query block sees: all, or under
  a causal mask up to the diagonal (blocks wholly above it are skipped; diagonal blocks are
  computed whole).
- forward split-KV, `flash_api.cpp` (`num_splits_heuristic`, `set_params_splitkv`): when
  heads x ceil(q_len / 64) < 0.8 x 2 x SMs, the keys are split over several CTAs (64 x 256 or
  64 x 128 tiles) and a combine kernel merges their fp32 partial outputs; the number of splits
  is the fewest whose waves over 2 x SMs reach 85 % of the best efficiency.
- backward, `flash_bwd_launch_template.h` (seqk-parallel): tiles 128 x 128 for head_dim <= 64,
  64 x 128 up to 128, 8 warps; grid (key blocks, batch, heads); a CTA runs every query block
  that sees its key block.
CTAs per SM: 2 for the 4-warp forward kernels (the split heuristic's own assumption, "we're
using 128 threads per block"; the kernels use up to 255 registers a thread, so a 64 K-register
SM holds two), 1 for the 8-warp backward kernels. The block scheduler fills every SM's first
slot before any second one, then gives each CTA, in launch order, to the first slot that is
free (greedy list scheduling, Graham, SIAM J. Appl. Math. 17(2), 1969); a CTA's time is taken
as proportional to its tiles. With two slots an SM, the critical slot's tiles are split into
those run while the SM's other slot is busy (shared) and alone.

cuDNN's fused attention on Hopper (`cudnn`; closed source, so its shape is taken from what
its timings show and from FlashAttention-3's Hopper design, arXiv:2407.08608, which it
resembles): 128 x 128 tiles for head_dim <= 128, one warp-specialized CTA per SM, the same
grids as FlashAttention-2 (forward over query blocks, backward over key blocks), and no
split-KV: a forward of few query blocks and many keys runs on a few SMs (on an H200, 512
queries x 32 K keys x 8 heads takes 2.7x the time of 32 K queries x 512 keys). With one slot
an SM, the shared tiles are the critical slot's share of the work while every SM is busy,
(all tiles) / SMs, and the alone ones the tail beyond it, when fewer SMs are left to share
the memory system and the power budget and a tile runs faster (on the H200 one CTA runs a
128-dim tile in ~1.6 us on a quarter-busy GPU, ~1.75 us on a full one).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hexiseq.costmodel.base import FloatOrArray
from hexiseq.flops import ATTENTION_BACKWARD_FACTOR

GPU_OP_FEATURES: dict[str, tuple[str, ...]] = {
    "gemm": ("flops", "bytes", "calls", "bytes_beyond_ridge"),
    "attention_fwd": (
        "critical_shared_flops",
        "critical_alone_flops",
        "critical_pairs",
        "critical_ctas",
        "bytes",
        "calls",
    ),
    "attention_bwd": (
        "critical_shared_flops",
        "critical_alone_flops",
        "critical_pairs",
        "critical_ctas",
        "bytes",
        "calls",
    ),
    "elementwise": ("bytes", "calls", "bytes_beyond_l2"),
}
"""Features of each compute op family on a GPU, in coefficient order (module docstring)."""

FLASH_KERNELS = ("flash", "cuda_flash")
"""Names of FlashAttention-2, whose tiles `flash_schedule` knows (`hexiseq.kernels`, and
the name profile rows written before it carry)."""
CUDNN_KERNELS = ("cudnn",)
"""Names of cuDNN's fused attention, whose grid `flash_schedule` models too (module docstring)."""
SCHEDULED_KERNELS = FLASH_KERNELS + CUDNN_KERNELS
"""Attention kernels that get the GPU features."""
CUDNN_TILE = (128, 128)
"""Query rows x key columns of a cuDNN attention CTA's tile, forward and backward."""

FORWARD_TILES = {
    32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4),
    160: (128, 32, 4), 192: (128, 64, 8), 224: (128, 64, 8), 256: (64, 64, 4),
}  # fmt: skip
"""head_dim -> (query rows, key columns, warps) of the forward kernel on sm80/sm90
(flash_fwd_launch_template.h, no dropout); a head_dim between runs the next larger one
(HEADDIM_SWITCH). Only 64 and 128 have been profiled here."""
BACKWARD_TILES = {
    32: (128, 128, 8), 64: (128, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8),
    160: (64, 64, 8), 192: (64, 64, 8), 224: (64, 64, 8), 256: (64, 64, 8),
}  # fmt: skip
"""The same for the backward kernel (flash_bwd_launch_template.h, >= 144 KB shared memory)."""
CTAS_PER_SM_BY_WARPS = {4: 2, 8: 1}
"""Resident CTAs per SM of a kernel of so many warps (module docstring)."""
SPLIT_ROWS = 64
"""Query rows of a split-KV CTA (and of the heuristic's block count)."""
SPLIT_FILL = 0.8
"""The heuristic splits only when the blocks fill less than this share of 2 x SMs."""
SPLIT_EFFICIENCY_SHARE = 0.85
"""... and then takes the fewest splits within this share of the best wave efficiency."""
MAX_SPLITS = 128


@dataclass(frozen=True)
class GpuTraits:
    """What the GPU features need of the device: its SM count (None: unknown, attention then
    keeps the generic features) and its roofline ridge, FLOPs per byte."""

    sm_count: int | None
    ridge_flops_per_byte: float


def gpu_traits(device_type: str) -> GpuTraits | None:
    """The traits of a catalog GPU (`sm_count`, dense peak / HBM bandwidth); None for the CPU
    and for device types the catalog does not know."""
    from hexiseq.catalog import gpu_catalog

    spec = gpu_catalog().get(device_type)
    if device_type == "cpu" or spec is None or spec.hbm_GBps <= 0:
        return None
    ridge = spec.peak_flops / (spec.hbm_GBps * 1e9)
    return GpuTraits(sm_count=getattr(spec, "sm_count", None), ridge_flops_per_byte=ridge)


def uses_gpu_features(op: str, traits: GpuTraits | None, kernel: str | None) -> bool:
    """Whether a family of `op` gets the GPU features: a catalog GPU, and for attention a
    kernel whose grid is known (`SCHEDULED_KERNELS`) on a GPU whose SM count is known."""
    if traits is None:
        return False
    if op.startswith("attention"):
        return kernel in SCHEDULED_KERNELS and traits.sm_count is not None
    return True


def gpu_gemm_features(
    flops: FloatOrArray,
    bytes_moved: FloatOrArray,
    calls: FloatOrArray,
    ridge_flops_per_byte: float,
) -> tuple[FloatOrArray, ...]:
    """GEMM features on a GPU (module docstring); every argument a total over `calls`."""
    beyond = np.maximum(np.subtract(bytes_moved, np.divide(flops, ridge_flops_per_byte)), 0.0)
    return (flops, bytes_moved, calls, _scalar_or_array(beyond))


def gpu_memory_bound_features(
    bytes_moved: FloatOrArray, calls: FloatOrArray, l2_bytes: float | None
) -> tuple[FloatOrArray, ...]:
    """Elementwise features on a GPU of `calls` equal calls moving `bytes_moved` in all; the
    L2 term is 0 when its capacity is unknown."""
    if l2_bytes is None:
        beyond = np.zeros_like(np.asarray(bytes_moved, dtype=np.float64))
    else:
        moved, many = np.broadcast_arrays(
            np.asarray(bytes_moved, dtype=np.float64), np.asarray(calls, dtype=np.float64)
        )
        # No calls (no casts in the sharded recipe): nothing beyond L2, not 0 / 0.
        per_call = np.divide(moved, many, out=np.zeros_like(moved), where=many > 0)
        beyond = np.multiply(calls, np.maximum(per_call - l2_bytes, 0.0))
    return (bytes_moved, calls, _scalar_or_array(beyond))


def flash_attention_features(
    q_tokens: FloatOrArray,
    kv_tokens: FloatOrArray,
    heads: FloatOrArray,
    head_dim: int,
    *,
    causal: FloatOrArray,
    backward: bool,
    calls: FloatOrArray,
    element_size: int,
    sm_count: int,
    kernel: str | None = None,
) -> tuple[FloatOrArray, ...]:
    """GPU attention features of `calls` blocks of `q_tokens` x `kv_tokens` each, `heads`
    heads, causal (top-left, as `hexiseq.profiles.attention_pairs`) where `causal` is true,
    on `kernel` (`SCHEDULED_KERNELS`; None: FlashAttention-2). Token and head counts are
    rounded to whole numbers (the kernel runs whole tokens)."""
    cudnn = kernel in CUDNN_KERNELS
    schedule = np.vectorize(_schedule_features, otypes=[np.float64] * 5)
    shared, alone, pairs, ctas, nbytes = schedule(
        np.maximum(np.rint(q_tokens), 1),
        np.maximum(np.rint(kv_tokens), 1),
        np.maximum(np.rint(heads), 0),
        head_dim,
        np.asarray(causal, dtype=bool),
        backward,
        element_size,
        sm_count,
        cudnn,
    )
    return tuple(
        _scalar_or_array(np.multiply(calls, feature))
        for feature in (shared, alone, pairs, ctas, nbytes)
    ) + (calls,)


@lru_cache(maxsize=65536)
def _schedule_features(
    q_len: float,
    kv_len: float,
    heads: float,
    head_dim: int,
    causal: bool,
    backward: bool,
    element_size: int,
    sm_count: int,
    cudnn: bool = False,
) -> tuple[float, float, float, float, float]:
    """One call's (shared FLOPs, alone FLOPs, pairs, CTAs, bytes) of the critical slot."""
    q_len, kv_len, heads = int(q_len), int(kv_len), int(heads)
    if heads == 0:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    schedule = flash_schedule(
        q_len, kv_len, heads, head_dim, bool(causal), backward, sm_count, cudnn=cudnn
    )
    padded_dim = _padded_head_dim(head_dim)
    tile_pairs = schedule.tile_rows * schedule.tile_cols
    tile_flops = 4.0 * tile_pairs * padded_dim  # hexiseq.flops: 4·D per pair forward
    if backward:
        tile_flops *= ATTENTION_BACKWARD_FACTOR
    nbytes = _attention_bytes(q_len, kv_len, heads, head_dim, element_size, backward)
    nbytes += 2 * 4 * schedule.splits * q_len * heads * head_dim if schedule.splits > 1 else 0
    tiles = schedule.shared_tiles + schedule.alone_tiles
    return (
        schedule.shared_tiles * tile_flops,
        schedule.alone_tiles * tile_flops,
        float(tiles * tile_pairs),
        float(schedule.critical_ctas),
        float(nbytes),
    )


def _attention_bytes(q_len, kv_len, heads, head_dim, element_size, backward) -> float:
    """q, k, v in and o out (forward); q, k, v, o, dO in and dq, dk, dv out (backward)."""
    per_token = 4.0 if backward else 2.0
    return element_size * head_dim * heads * per_token * (q_len + kv_len)


@dataclass(frozen=True)
class FlashSchedule:
    """The critical slot of one attention call: the tiles it runs shared (while its SM holds
    another CTA; one CTA an SM: its share of the work while every SM is busy) and alone, its
    CTAs, the tile shape (query rows x key columns) and the number of KV splits (1: none)."""

    shared_tiles: float
    alone_tiles: float
    critical_ctas: int
    tile_rows: int
    tile_cols: int
    splits: int


def flash_schedule(
    q_len: int,
    kv_len: int,
    heads: int,
    head_dim: int,
    causal: bool,
    backward: bool,
    sm_count: int,
    *,
    cudnn: bool = False,
) -> FlashSchedule:
    """The critical slot of FlashAttention-2's grid, or with `cudnn` cuDNN's, on `sm_count`
    SMs (module docstring), for a batch of one."""
    if cudnn:
        return _cudnn_schedule(q_len, kv_len, heads, causal, backward, sm_count)
    if backward:
        splits, (rows, cols, warps) = 1, BACKWARD_TILES[_padded_head_dim(head_dim)]
        ctas = _backward_tiles(q_len, kv_len, heads, rows, cols, causal)
    else:
        splits = forward_splits(q_len, kv_len, heads, head_dim, sm_count)
        rows, cols, warps = _forward_tile(head_dim, splits)
        ctas = _forward_tiles(q_len, kv_len, heads, rows, cols, splits, causal)
    shared, alone, count = critical_slot(ctas, sm_count, CTAS_PER_SM_BY_WARPS[warps])
    return FlashSchedule(shared, alone, count, rows, cols, splits)


def _cudnn_schedule(
    q_len: int, kv_len: int, heads: int, causal: bool, backward: bool, sm_count: int
) -> FlashSchedule:
    """cuDNN's grid (module docstring): one CTA an SM, so the critical slot's tiles split into
    the balanced share, (all tiles) / SMs, and the tail beyond it."""
    rows, cols = CUDNN_TILE
    if backward:
        ctas = _backward_tiles(q_len, kv_len, heads, rows, cols, causal)
    else:
        ctas = _forward_tiles(q_len, kv_len, heads, rows, cols, 1, causal)
    shared, alone, count = critical_slot(ctas, sm_count, 1)
    balanced = min(float(np.sum(ctas)) / sm_count, float(shared + alone))
    return FlashSchedule(balanced, shared + alone - balanced, count, rows, cols, 1)


def forward_splits(q_len: int, kv_len: int, heads: int, head_dim: int, sm_count: int) -> int:
    """How many CTAs the forward splits the keys over (`num_splits_heuristic`, flash_api.cpp)."""
    padded = _padded_head_dim(head_dim)
    block_n = 256 if padded <= 64 else 128 if padded <= 128 else 64
    key_blocks = _ceil_div(kv_len, block_n)
    blocks = heads * _ceil_div(q_len, SPLIT_ROWS)
    slots = 2 * sm_count
    if blocks >= SPLIT_FILL * slots:
        return 1
    eligible = [
        splits
        for splits in range(1, min(MAX_SPLITS, slots, key_blocks) + 1)
        if splits == 1 or _ceil_div(key_blocks, splits) != _ceil_div(key_blocks, splits - 1)
    ]
    efficiency = {s: _wave_efficiency(blocks * s, slots) for s in eligible}
    best = max(efficiency.values())
    return next(s for s in eligible if efficiency[s] >= SPLIT_EFFICIENCY_SHARE * best)


def _wave_efficiency(ctas: int, slots: int) -> float:
    waves = ctas / slots
    return waves / np.ceil(waves)


def _forward_tile(head_dim: int, splits: int) -> tuple[int, int, int]:
    padded = _padded_head_dim(head_dim)
    if splits > 1:
        return SPLIT_ROWS, 256 if padded <= 64 else 128 if padded <= 128 else 64, 4
    return FORWARD_TILES[padded]


def _forward_tiles(q_len, kv_len, heads, rows, cols, splits, causal) -> np.ndarray:
    """Tiles of each forward CTA in launch order: query blocks fastest, then splits, heads."""
    starts = np.arange(0, q_len, rows)
    visible = np.minimum(starts + rows, kv_len) if causal else np.full(len(starts), kv_len)
    key_blocks = -(-visible // cols)  # blocks up to (and with) the diagonal
    per_split = _ceil_div(_ceil_div(kv_len, cols), splits)
    split_starts = np.arange(splits)[:, None] * per_split
    tiles = np.clip(key_blocks[None, :] - split_starts, 0, per_split)
    return np.tile(tiles.ravel(), heads)


def _backward_tiles(q_len, kv_len, heads, rows, cols, causal) -> np.ndarray:
    """Tiles of each backward CTA (one per key block) in launch order: the query blocks that
    see its keys, all of them without a mask."""
    query_blocks = _ceil_div(q_len, rows)
    key_starts = np.arange(0, kv_len, cols)
    first = key_starts // rows if causal else np.zeros(len(key_starts), dtype=np.int64)
    return np.tile(np.maximum(query_blocks - first, 0), heads)


def critical_slot(tiles: np.ndarray, sm_count: int, ctas_per_sm: int) -> tuple[int, int, int]:
    """(tiles run shared, tiles run alone, CTAs) of the slot that ends last when CTAs of
    `tiles` each are given in order to the first free of `ctas_per_sm` x `sm_count` slots
    (slot s on SM s mod sm_count, every first slot before any second: the greedy list
    schedule). Shared: while another slot of the same SM is still busy (greedy leaves no
    slot idle while CTAs wait, so a slot is busy from 0 until its last CTA ends)."""
    slots = ctas_per_sm * sm_count
    if len(tiles) and np.all(tiles == tiles[0]):
        ends, counts = _uniform_slots(len(tiles), int(tiles[0]), slots)
    else:
        ends, counts = _greedy_slots(tiles, slots)
    critical = int(np.argmax(ends))
    partners = [s for s in range(critical % sm_count, slots, sm_count) if s != critical]
    partner_end = max((ends[s] for s in partners), default=0)
    shared = min(ends[critical], partner_end)
    return int(shared), int(ends[critical] - shared), int(counts[critical])


def _uniform_slots(count: int, tiles: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Ends and CTA counts of every slot for `count` equal CTAs (closed form: round robin)."""
    rounds, rest = divmod(count, slots)
    counts = rounds + (np.arange(slots) < rest)
    return counts * tiles, counts


def _greedy_slots(tiles: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    heap = [(0, slot) for slot in range(slots)]
    ends, counts = np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.int64)
    for work in tiles.tolist():
        end, slot = heapq.heappop(heap)
        ends[slot], counts[slot] = end + work, counts[slot] + 1
        heapq.heappush(heap, (end + work, slot))
    return ends, counts


def _padded_head_dim(head_dim: int) -> int:
    return next((d for d in FORWARD_TILES if d >= head_dim), max(FORWARD_TILES))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scalar_or_array(value) -> FloatOrArray:
    return float(value) if np.ndim(value) == 0 else value
