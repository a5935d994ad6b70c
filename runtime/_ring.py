"""Ring attention across HP groups, forward and explicit backward (torch.distributed).

At step i group g attends to the K/V block of group (g - i) mod G. Before computing step i a
rank posts the hop that brings the block of step i+1 (K/V in the compute dtype), so the
transfer overlaps the compute. In backward the K/V blocks go round again; a block's dK/dV
(fp32) start at zero on the group after its owner, pick up each group's contribution and go
home after the last step, while the owner's own contribution never leaves it. See the
`hexiseq.runtime` docstring for the bytes on every link.

Inside the ring, tokens are sorted by global position (queries and every block), so each
block's causal mask is a staircase of mask-free tiles (`_tiles`). Blocks travel sorted.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hexiseq.runtime._block import (
    HeadExpansion,
    OnlineSoftmax,
    RowSum,
    attend_block,
    block_gradients,
    expansion_index,
    head_expansion,
)
from hexiseq.runtime._emulation import compute_phase
from hexiseq.runtime._p2p import (
    DKV_TAG,
    FOLD_TAG,
    KV_TAG,
    Exchange,
    assemble_heads,
    head_slice,
    post_exchange,
    receive_buffers,
)
from hexiseq.runtime._routes import Range, RankRoutes, Transfer
from hexiseq.runtime._tiles import Tile, block_tiles, sorted_ranges


class RingContext:
    """What one rank needs to run the ring for a layout: routes, tiles, orders, GQA expansion."""

    def __init__(
        self, routes: RankRoutes, gqa_ratio: int, group: dist.ProcessGroup | None = None
    ) -> None:
        self.routes = routes
        self.group = group
        """The process group whose ranks the routes name (None: the default group)."""
        own_order = routes.segment_orders[routes.group_index]
        self._order = _sorting_order(own_order)  # None when already sorted
        self._expansion = expansion_index(routes.heads, routes.kv_heads, gqa_ratio)
        sorted_segments = [sorted_ranges(order) for order in routes.segment_orders]
        query_ranges = sorted_segments[routes.group_index]
        self._tiles = {
            causal: [block_tiles(query_ranges, keys, causal=causal) for keys in sorted_segments]
            for causal in (True, False)
        }
        self._indices: dict[torch.device, RingIndices] = {}

    @property
    def num_steps(self) -> int:
        return self.routes.num_groups

    def tiles(self, step: int, causal: bool) -> tuple[Tile, ...]:
        return self._tiles[causal][self.routes.block_owner(step)]

    def indices(self, device: torch.device) -> RingIndices:
        """The index tensors and head expansion on `device` (built once per device)."""
        if device not in self._indices:

            def index(values: list[int] | None) -> torch.Tensor | None:
                return None if values is None else torch.tensor(values, device=device)

            inverse = None if self._order is None else _inverse(self._order)
            expansion = head_expansion(self._expansion, device)
            self._indices[device] = RingIndices(index(self._order), index(inverse), expansion)
        return self._indices[device]


class RingIndices(NamedTuple):
    """Index tensors of one rank on one device; None where the index is the identity."""

    order: torch.Tensor | None  # member order -> sorted by position
    inverse: torch.Tensor | None  # sorted -> member order
    expansion: HeadExpansion  # the rank's K/V heads -> one per query head, and back


def ring_forward(
    ring: RingContext, q_BHLD: torch.Tensor, kv_2BHSD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the rank's queries over the whole sequence: (out in q's dtype, lse fp32)."""
    merged = OnlineSoftmax(q_BHLD)
    expansion = ring.indices(q_BHLD.device).expansion
    block = kv_2BHSD
    for step in range(ring.num_steps):
        exchange = _post_kv_hop(ring, block, step)
        with compute_phase():
            attend_block(merged, q_BHLD, block, ring.tiles(step, causal), expansion, scale)
        if exchange is not None:
            block = assemble_heads(exchange.wait())
    return merged.output(q_BHLD.dtype), merged.lse_BHL


def ring_backward(
    ring: RingContext,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv_2BHSD: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ, dK/dV of the rank's own block fp32) from `saved` = (dout, q, out, lse); dQ is fp32,
    or the kernel's dtype where one tile gave all of it (`RowSum`)."""
    dq = RowSum(saved[1].shape, kv_2BHSD.device)
    expansion = ring.indices(kv_2BHSD.device).expansion
    block, home_dkv, travelling = kv_2BHSD, None, None
    for step in range(ring.num_steps):
        exchange = _post_kv_hop(ring, block, step)
        tiles = ring.tiles(step, causal)
        with compute_phase():
            partial = block_gradients(dq, saved, block, tiles, expansion, scale)
        if step == 0:
            home_dkv = partial  # the owner's own share stays home
        else:
            _fold_shared_heads(ring, partial)
            if travelling is not None:
                _add_runs(partial, travelling.wait(), ring.routes.kv_heads)
            travelling = _post_dkv_hop(ring, partial, step)
        if exchange is not None:
            block = assemble_heads(exchange.wait())
    if travelling is not None:  # this rank's block is back with everyone's contributions
        _add_runs(home_dkv, travelling.wait(), ring.routes.kv_heads)
    return dq.finish(), home_dkv


def _post_kv_hop(ring: RingContext, block_2BHSD: torch.Tensor, step: int) -> Exchange | None:
    """Send the block in hand to the next group; receive the block of step+1."""
    if step + 1 >= ring.num_steps:
        return None
    routes = ring.routes
    tokens = routes.segment_length(routes.block_owner(step + 1))
    sends = [(t, head_slice(block_2BHSD, t.kv_heads, routes.kv_heads[0])) for t in routes.kv_out]
    receives = receive_buffers(routes.kv_in, block_2BHSD, tokens, block_2BHSD.dtype)
    return post_exchange(sends, receives, KV_TAG, ring.group)


def _post_dkv_hop(ring: RingContext, partial_2BHSD: torch.Tensor, step: int) -> Exchange:
    """Send the kept heads' dK/dV of the block just done on; receive those of the next block
    (after the last step: this rank's own block coming home)."""
    routes = ring.routes
    tokens = routes.segment_length(routes.block_owner(step + 1))
    first = routes.kv_heads[0]
    sends = [(t, head_slice(partial_2BHSD, t.kv_heads, first)) for t in routes.dkv_out]
    receives = receive_buffers(routes.dkv_in, partial_2BHSD, tokens, partial_2BHSD.dtype)
    return post_exchange(sends, receives, DKV_TAG, ring.group)


def _fold_shared_heads(ring: RingContext, partial_2BHSD: torch.Tensor) -> None:
    """GQA boundary heads: non-keepers hand their partial dK/dV to the head's keeper, so the
    one accumulator that travels carries every member's contribution."""
    routes = ring.routes
    if not routes.fold_in and not routes.fold_out:
        return
    first = routes.kv_heads[0]
    sends = [(t, head_slice(partial_2BHSD, t.kv_heads, first)) for t in routes.fold_out]
    tokens = partial_2BHSD.shape[3]
    receives = receive_buffers(routes.fold_in, partial_2BHSD, tokens, partial_2BHSD.dtype)
    exchange = post_exchange(sends, receives, FOLD_TAG, ring.group)
    _add_runs(partial_2BHSD, exchange.wait(), routes.kv_heads)


def _add_runs(
    target_2BHSD: torch.Tensor,
    received: list[tuple[Transfer, torch.Tensor]],
    kv_heads: Range,
) -> None:
    for transfer, data in received:
        low, high = (h - kv_heads[0] for h in transfer.kv_heads)
        target_2BHSD[:, :, low:high] += data


def _sorting_order(member_order: tuple[Range, ...]) -> list[int] | None:
    """Indices that sort the member-order tokens by position; None if already sorted."""
    offsets, offset = [], 0
    for start, end in member_order:
        offsets.append(offset)
        offset += end - start
    by_position = sorted(range(len(member_order)), key=lambda i: member_order[i][0])
    if by_position == sorted(by_position):
        return None
    order: list[int] = []
    for i in by_position:
        start, end = member_order[i]
        order += range(offsets[i], offsets[i] + end - start)
    return order


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for sorted_index, member_index in enumerate(order):
        inverse[member_index] = sorted_index
    return inverse


class RingAttention(torch.autograd.Function):
    """Head-sharded attention over the ring: (B, S_g, H_local, D) q and (B, S_g, H_kv_local, D)
    k, v in member order -> output like q. Backward is the explicit ring backward."""

    @staticmethod
    def forward(
        ctx: Any,
        ring: RingContext,
        q_BLHD: torch.Tensor,
        k_BLHD: torch.Tensor,
        v_BLHD: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        indices = ring.indices(q_BLHD.device)
        q_BHLD = _to_sorted(q_BLHD, indices.order)
        kv_2BHSD = _to_sorted(torch.stack([k_BLHD, v_BLHD]), indices.order, dim=2)
        out_BHLD, lse_BHL = ring_forward(ring, q_BHLD, kv_2BHSD, causal, scale)
        ctx.save_for_backward(q_BHLD, kv_2BHSD, out_BHLD, lse_BHL)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return _from_sorted(out_BHLD, indices.inverse)

    @staticmethod
    def backward(ctx: Any, dout_BLHD: torch.Tensor) -> tuple[Any, ...]:
        q_BHLD, kv_2BHSD, out_BHLD, lse_BHL = ctx.saved_tensors
        indices = ctx.ring.indices(q_BHLD.device)
        dout_BHLD = _to_sorted(dout_BLHD.to(q_BHLD.dtype), indices.order)
        saved = (dout_BHLD, q_BHLD, out_BHLD, lse_BHL)
        dq, dkv = ring_backward(ctx.ring, saved, kv_2BHSD, ctx.causal, ctx.scale)
        dtype, inverse = q_BHLD.dtype, indices.inverse
        dk, dv = (_from_sorted(d.to(dtype), inverse) for d in dkv)
        return None, _from_sorted(dq.to(dtype), inverse), dk, dv, None, None


def _to_sorted(x_BLHD: torch.Tensor, order: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """(…, L, H, D) in member order -> (…, H, L, D) sorted by position, contiguous."""
    if order is not None:
        x_BLHD = x_BLHD.index_select(dim, order)
    return x_BLHD.transpose(dim, dim + 1).contiguous()


def _from_sorted(x_BHLD: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    """(B, H, L, D) sorted by position -> (B, L, H, D) in member order, contiguous."""
    x_BLHD = x_BHLD.transpose(1, 2)
    return x_BLHD.contiguous() if inverse is None else x_BLHD.index_select(1, inverse)
