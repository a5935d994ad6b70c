"""Uneven all-to-all inside an HP group between sequence form and head form (torch.distributed).

Sequence form: a rank's own tokens (B, T_rank, heads, D), all heads. Head form: the group's
whole segment (B, S_g, heads_rank, D), the members' tokens concatenated in member order, only
the rank's heads (query heads [h0, h1), K/V heads [h0 // r, ceil(h1 / r))). One
`all_to_all_single` moves q, k and v (or dq, dk, dv) together in one flat buffer. A K/V head
shared at a GQA boundary goes to both owners; on the way back their two gradients are summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hexiseq.runtime._routes import Range, RankRoutes


@dataclass(frozen=True)
class AllToAllPlan:
    """The group's shapes; `group` is None for a one-member group (no communication)."""

    routes: RankRoutes
    group: dist.ProcessGroup | None
    num_heads: int
    num_kv_heads: int

    @property
    def member_index(self) -> int:
        return self.routes.member_index

    @property
    def alone(self) -> bool:
        """A one-member group: it holds every head of its own tokens, so both forms are the
        same tensors (no copy, no FP32 sum)."""
        return len(self.routes.members) == 1

    @property
    def by_group_rank(self) -> list[int]:
        """Member indices in process-group rank order (new_group numbers ranks sorted)."""
        members = self.routes.members
        return sorted(range(len(members)), key=lambda i: members[i])

    def token_offsets(self) -> list[int]:
        offsets, offset = [], 0
        for tokens in self.routes.member_tokens:
            offsets.append(offset)
            offset += tokens
        return offsets


def sequence_to_heads(
    plan: AllToAllPlan, tensors_BTHD: Sequence[torch.Tensor], ranges: Sequence[Sequence[Range]]
) -> list[torch.Tensor]:
    """Each tensor (B, T_me, H_t, D) -> (B, S_g, width of ranges[t][me], D); member j receives
    heads ranges[t][j] of every tensor t."""
    if plan.alone:
        return list(tensors_BTHD)
    me = plan.member_index
    sends = [
        [x[:, :, slice(*r[j])] for x, r in zip(tensors_BTHD, ranges)] for j in plan.by_group_rank
    ]
    batch, _, _, head_dim = tensors_BTHD[0].shape
    receive_shapes = [
        [(batch, plan.routes.member_tokens[i], _width(r[me]), head_dim) for r in ranges]
        for i in plan.by_group_rank
    ]
    received = _exchange(plan, sends, receive_shapes)
    member_pieces = dict(zip(plan.by_group_rank, received))
    return [
        torch.cat([member_pieces[i][t] for i in range(len(plan.routes.members))], dim=1)
        for t in range(len(tensors_BTHD))
    ]


def heads_to_sequence(
    plan: AllToAllPlan,
    tensors_BSHD: Sequence[torch.Tensor],
    ranges: Sequence[Sequence[Range]],
    total_heads: Sequence[int],
) -> list[torch.Tensor]:
    """Inverse of `sequence_to_heads`: each (B, S_g, width, D) -> (B, T_me, total_heads[t], D),
    summing pieces whose head ranges overlap (GQA boundary K/V heads), in fp32."""
    if plan.alone:
        return list(tensors_BSHD)
    me, offsets = plan.member_index, plan.token_offsets()
    tokens = plan.routes.member_tokens
    sends = [
        [x[:, offsets[j] : offsets[j] + tokens[j]] for x in tensors_BSHD]
        for j in plan.by_group_rank
    ]
    batch, _, _, head_dim = tensors_BSHD[0].shape
    receive_shapes = [
        [(batch, tokens[me], _width(r[i]), head_dim) for r in ranges] for i in plan.by_group_rank
    ]
    received = _exchange(plan, sends, receive_shapes)
    results = []
    for t, x in enumerate(tensors_BSHD):
        total = torch.zeros(batch, tokens[me], total_heads[t], head_dim, device=x.device)
        for i, pieces in zip(plan.by_group_rank, received):
            total[:, :, slice(*ranges[t][i])] += pieces[t]
        results.append(total.to(x.dtype))
    return results


def _exchange(
    plan: AllToAllPlan,
    sends: list[list[torch.Tensor]],
    receive_shapes: list[list[tuple[int, ...]]],
) -> list[list[torch.Tensor]]:
    """One all_to_all_single: sends[peer] (tensors) out, received[peer] (tensors) back, peers
    in group-rank order."""
    if plan.group is None:
        return [[x.contiguous() for x in pieces] for pieces in sends]
    like = sends[0][0]
    flat = torch.cat([x.reshape(-1) for pieces in sends for x in pieces])
    input_splits = [sum(x.numel() for x in pieces) for pieces in sends]
    sizes = [[_numel(shape) for shape in shapes] for shapes in receive_shapes]
    output = torch.empty(sum(map(sum, sizes)), dtype=like.dtype, device=like.device)
    output_splits = [sum(peer_sizes) for peer_sizes in sizes]
    dist.all_to_all_single(output, flat, output_splits, input_splits, group=plan.group)
    received, chunks = [], iter(output.split([n for peer in sizes for n in peer]))
    for shapes in receive_shapes:
        received.append([next(chunks).view(shape) for shape in shapes])
    return received


class SequenceToHeads(torch.autograd.Function):
    """q, k, v in sequence form -> head form; backward: the gradients the other way."""

    @staticmethod
    def forward(ctx: Any, plan: AllToAllPlan, q, k, v) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        return tuple(sequence_to_heads(plan, [q, k, v], _qkv_ranges(plan)))

    @staticmethod
    def backward(ctx: Any, dq, dk, dv) -> tuple[Any, ...]:
        plan = ctx.plan
        totals = [plan.num_heads, plan.num_kv_heads, plan.num_kv_heads]
        grads = heads_to_sequence(plan, [dq, dk, dv], _qkv_ranges(plan), totals)
        return (None, *grads)


class HeadsToSequence(torch.autograd.Function):
    """Attention output in head form -> sequence form; backward: dout the other way."""

    @staticmethod
    def forward(ctx: Any, plan: AllToAllPlan, out_BSHD: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        ranges = [plan.routes.member_heads]
        return heads_to_sequence(plan, [out_BSHD], ranges, [plan.num_heads])[0]

    @staticmethod
    def backward(ctx: Any, dout_BTHD: torch.Tensor) -> tuple[Any, ...]:
        ranges = [ctx.plan.routes.member_heads]
        return None, sequence_to_heads(ctx.plan, [dout_BTHD], ranges)[0]


def _qkv_ranges(plan: AllToAllPlan) -> list[tuple[Range, ...]]:
    routes = plan.routes
    return [routes.member_heads, routes.member_kv_heads, routes.member_kv_heads]


def _width(head_range: Range) -> int:
    return head_range[1] - head_range[0]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
