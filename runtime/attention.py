"""`CPHPAttention`: attention over a sequence sharded by an asymmetric CP–HP layout
(docs/design.md §8).

Sequence form in, sequence form out; inside, an uneven all-to-all per HP group (head form),
ring attention across the groups, and the all-to-all back. Every check that can refuse a
layout or an input runs before any communication, on every rank alike.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hexiseq.errors import InputError
from hexiseq.layout import AttentionLayout
from hexiseq.runtime._all_to_all import AllToAllPlan, HeadsToSequence, SequenceToHeads
from hexiseq.runtime._ring import RingAttention, RingContext
from hexiseq.runtime._routes import build_rank_routes


class CPHPAttention(torch.nn.Module):
    """Context- and head-parallel attention for one `AttentionLayout` (contract, docs/design.md §8)
    over the ranks of `group` (None: the default process group): layout rank i is the
    group's rank i.

    Construction is collective over the group: every rank of it builds it with the same
    layout. Over the default group every rank creates every HP group's process group in the
    same order; over another group each rank creates only its own HP group's (locally
    synchronized), so that several groups (data-parallel replicas) can each build their own
    layout at once. It holds no parameters, so one instance can serve every layer that shares
    the layout.

    Raises InputError (a ValueError) for a layout that is invalid or made for another group
    size, or a rank outside `group`; RuntimeError when torch.distributed is not initialized.
    """

    def __init__(self, layout: AttentionLayout, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        _check_layout(layout, group)
        rank = dist.get_rank(group)
        self.layout = layout
        self.rank = rank
        self.group = group
        routes = build_rank_routes(layout, rank)
        hp_group = _hp_group(layout, routes.group_index, group)
        self._all_to_all = AllToAllPlan(routes, hp_group, layout.num_heads, layout.num_kv_heads)
        self._ring = RingContext(routes, layout.gqa_ratio, group)
        self._warmed_up: set[torch.device] = set()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention output (B, T_local, H, D) for q (B, T_local, H, D), k and v
        (B, T_local, H_kv, D), T_local = this rank's tokens (its token ranges concatenated in
        order). causal=True masks by global token position (key <= query); scale defaults to
        1/sqrt(D). Raises InputError, before any communication, when shapes, dtypes or
        devices do not fit the layout."""
        _check_inputs(self.layout, self.rank, q, k, v)
        self._warm_up(q.device)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        q_heads, k_heads, v_heads = SequenceToHeads.apply(self._all_to_all, q, k, v)
        out_heads = RingAttention.apply(self._ring, q_heads, k_heads, v_heads, causal, scale)
        return HeadsToSequence.apply(self._all_to_all, out_heads)

    def _warm_up(self, device: torch.device) -> None:
        """NCCL: one collective on the group before the first batched send/receive, which
        would otherwise create the communicator with only some ranks taking part."""
        if device in self._warmed_up:
            return
        if dist.get_backend(self.group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        self._warmed_up.add(device)


def _hp_group(
    layout: AttentionLayout, group_index: int, group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The process group of this rank's HP group (None when it is the rank alone)."""
    if group is None:
        hp_groups = [dist.new_group(list(members)) for members in layout.groups]
        return hp_groups[group_index] if len(layout.groups[group_index]) > 1 else None
    members = layout.groups[group_index]
    if len(members) == 1:
        return None
    global_ranks = dist.get_process_group_ranks(group)  # in group-rank order
    return dist.new_group(  # group ranks in layout-rank order, as the all-to-all expects
        [global_ranks[member] for member in sorted(members)],
        use_local_synchronization=True,
        sort_ranks=False,
    )


def _check_layout(layout: AttentionLayout, group: dist.ProcessGroup | None) -> None:
    if not isinstance(layout, AttentionLayout):
        raise InputError(
            f"CPHPAttention: layout is a {type(layout).__name__}; need an AttentionLayout"
        )
    try:
        layout.validate()
    except InputError as error:
        raise InputError(f"CPHPAttention: invalid layout ({error})") from error
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "CPHPAttention: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise InputError(
            f"CPHPAttention: global rank {dist.get_rank()} is not in the given process group "
            f"(its ranks: {dist.get_process_group_ranks(group)}); build it only on the group's "
            "ranks"
        )
    world_size = dist.get_world_size(group)
    if layout.world_size != world_size:
        raise InputError(
            f"CPHPAttention: the layout is for {layout.world_size} ranks but the process group "
            f"has {world_size}; need a layout with one token-range entry per rank"
        )


def _check_inputs(
    layout: AttentionLayout, rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"CPHPAttention: {name} is {shape}; need a 4-d (B, T, heads, D)")
    tokens = layout.num_tokens(rank)
    batch, head_dim = q.shape[0], q.shape[3]
    expected = {
        "q": (batch, tokens, layout.num_heads, head_dim),
        "k": (batch, tokens, layout.num_kv_heads, head_dim),
        "v": (batch, tokens, layout.num_kv_heads, head_dim),
    }
    for name, x in (("q", q), ("k", k), ("v", v)):
        if tuple(x.shape) != expected[name]:
            raise InputError(
                f"CPHPAttention: rank {rank} {name} has shape {tuple(x.shape)}; the layout "
                f"needs {expected[name]} (B, T_local={tokens} tokens of this rank, "
                f"{'num_heads' if name == 'q' else 'num_kv_heads'}, D)"
            )
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(
            f"CPHPAttention: q, k, v dtypes are {q.dtype}, {k.dtype}, {v.dtype}; need one "
            "floating-point dtype"
        )
    if k.device != q.device or v.device != q.device:
        raise InputError(
            f"CPHPAttention: q, k, v are on {q.device}, {k.device}, {v.device}; need one device"
        )
