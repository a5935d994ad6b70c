"""torch.distributed executor of a `Plan`: asymmetric Ulysses (HP) + ring attention (CP).

`CPHPAttention(layout, group=None)(q, k, v, causal=True)` (docs/design.md §8) runs attention on a
sequence sharded by an `AttentionLayout` over a process group (default: the world); gloo
(CPU) and NCCL (GPU). Modules:

- `attention`     the public module: checks, then all-to-all -> ring -> all-to-all back
- `_all_to_all`   uneven all-to-all between sequence and head form (autograd Functions)
- `_ring`         ring forward, explicit ring backward (autograd Function)
- `_routes`       pure: who sends which K/V heads to whom (matches costmodel._traffic)
- `_tiles`        pure: a block's causal mask as mask-free full / causal-square tiles
- `_block`        one ring step: GQA expansion, tiles, online-softmax merge (fp32)
- `kernels`       SDPA kernels with log-sum-exp (CPU flash; CUDA cuDNN, falling back to flash,
                  then efficient; fp32 reference), chosen by `hexiseq.kernels.attention_kernel`;
                  the kernels run are recorded per step; the profiler makes the same calls
- `_p2p`          batched isend/irecv of K/V head runs
- `model`         Llama-style decoder over the sharded sequence (RoPE at global positions)
- `loss`          mean next-token loss over all ranks' tokens; gradient all-reduce (sum)
- `sharding`      model states sharded over the domain in the plan's fractions, even or not:
                  FP32 master shards, weights gathered in the compute dtype (ZeRO-3 style)
- `replicas`      data-parallel replicas over CP-HP meshes: each replica its own group, layout
                  and sequences per step; gradients summed over the world, token-weighted
- `devices`       the launcher's check of this machine's CUDA devices against the plan
- `train`         the torchrun train loop of a plan, measured into the store
- `_startup`      pure: is a rank torchrun started where the plan puts it (checked before any
                  communication: world size, node, local rank, GPU type)
- `hf`            a plan applied to a user's Hugging Face Llama/Qwen2 model (attention swapped)
- `_emulation`    emulated slower devices: compute phases padded by sleeping (and timed)
- `checkpoint`    distributed checkpoints of the sharded states (safetensors + JSON, no pickle),
                  resharded on load to any split; `_checkpoint_files` their manifest and checks
- `_drift`        pure: every rank's compute against the plan's prediction; who drifted

Communication of one attention layer (B batch, D head size, e bytes per element of the
compute dtype, e.g. 2 for bf16; T_i tokens and h_i query heads of rank i; c_i = its K/V heads
[h0 // r, ceil(h1 / r)), a head at a GQA boundary counted for both owners; S_b tokens of the
segment of group b; G groups; "keeper" of a K/V head in a group = its lowest-numbered holder):

Forward
1. All-to-all in each HP group (one `all_to_all_single`): rank i sends member j
   B·T_i·(h_j + 2·c_j)·D·e bytes (q of j's heads, k and v of j's K/V heads, i's tokens).
2. G-1 ring hops. Before step i (0 <= i < G-1) every rank posts the hop bringing the block of
   step i+1, owner b = g-i-1: each rank of group g receives, for each K/V head it needs,
   2·B·S_b·D·e bytes per head (k and v) from the head's keeper in group g-1, one message per
   (sender, receiver) pair. Same senders as `costmodel._traffic.ring_senders`.
3. All-to-all back: member j sends rank i B·T_i·h_j·D·e bytes (the output of i's tokens).

Backward
1. All-to-all of dO: as forward 3, the other way (rank i sends member j B·T_i·h_j·D·e).
2. The same G-1 K/V hops as forward 2 (blocks go round again; nothing is kept per block).
3. dK/dV (fp32). The owner group's own contribution to its block never leaves it; the
   accumulator of block b starts at zero on group b+1. After each step i >= 1:
   a. fold, inside the group: a holder of a boundary K/V head that is not its keeper sends
      the keeper 2·B·S_b·D·4 bytes per such head (its partial dK and dV);
   b. hop: each K/V head's accumulator, 2·B·S_b·D·4 bytes, goes from its keeper in g to its
      keeper in g+1. The hop after step G-1 brings every block home to its owner.
   So G-1 dK/dV hops, each head carried by one rank and received by one rank.
4. All-to-all of dq, dk, dv: member j sends rank i B·T_i·(h_j + 2·c_j)·D·e bytes; rank i sums
   the pieces of a boundary K/V head from its owners (in fp32). Only the keeper's piece holds
   the other groups' contributions, the other owners' pieces hold their own group's.

The simulator's traffic model (`costmodel._traffic`, summed per step by
`costmodel.traffic.step_traffic_bytes`) counts exactly these bytes, rank by rank:
`benchmarks/runtime.py` measures both.

This package may import the core and torch only, never search, costmodel or dashboard.
"""

from hexiseq.runtime.attention import CPHPAttention
from hexiseq.runtime.model import LlamaModel, LocalAttention, build_model

__all__ = ["CPHPAttention", "LlamaModel", "LocalAttention", "build_model"]
