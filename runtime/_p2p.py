"""Point-to-point exchanges of K/V head runs between ranks (torch.distributed).

An exchange posts all its sends and receives at once with `dist.batch_isend_irecv` and hands
back a handle; the caller computes, then waits. Every rank walks the same `Transfer` lists in
the same order, so sender and receiver post matching messages in matching order (what gloo
and NCCL both need).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hexiseq.runtime._routes import Range, Transfer

# Different message kinds get different tags (gloo matches on them; NCCL relies on order).
KV_TAG = 1
DKV_TAG = 2
FOLD_TAG = 3


class Exchange:
    """Posted sends and receives; `wait()` blocks until all are done and returns the received
    buffers, one per receive transfer, in the order they were given."""

    def __init__(
        self,
        works: list[dist.Work],
        received: list[tuple[Transfer, torch.Tensor]],
        sent: list[torch.Tensor],
    ) -> None:
        self._works = works
        self._received = received
        self._sent = sent  # kept alive until the sends are done

    def wait(self) -> list[tuple[Transfer, torch.Tensor]]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self._received


def post_exchange(
    sends: Sequence[tuple[Transfer, torch.Tensor]],
    receives: Sequence[tuple[Transfer, torch.Tensor]],
    tag: int,
    group: dist.ProcessGroup | None = None,
) -> Exchange:
    """Post `sends` (transfer, data) to their receivers and `receives` (transfer, empty buffer)
    from their senders, the transfers' ranks being ranks of `group` (None: the default
    group). Data must be contiguous."""
    ops = [
        dist.P2POp(dist.isend, data, group=group, group_peer=t.receiver, tag=tag)
        for t, data in sends
    ]
    ops += [
        dist.P2POp(dist.irecv, buffer, group=group, group_peer=t.sender, tag=tag)
        for t, buffer in receives
    ]
    works = dist.batch_isend_irecv(ops) if ops else []
    return Exchange(works, list(receives), [data for _, data in sends])


def head_slice(block_2BHSD: torch.Tensor, heads: Range, first_local_head: int) -> torch.Tensor:
    """Global K/V heads `heads` of a block holding heads from `first_local_head`, as a
    contiguous tensor ready to send."""
    low, high = heads[0] - first_local_head, heads[1] - first_local_head
    return block_2BHSD[:, :, low:high].contiguous()


def receive_buffers(
    transfers: Sequence[Transfer], like: torch.Tensor, tokens: int, dtype: torch.dtype
) -> list[tuple[Transfer, torch.Tensor]]:
    """Empty (2, B, heads, tokens, D) buffers for each transfer, on `like`'s device."""
    _, batch, _, _, head_dim = like.shape
    return [
        (t, torch.empty(2, batch, t.num_heads, tokens, head_dim, dtype=dtype, device=like.device))
        for t in transfers
    ]


def assemble_heads(received: Sequence[tuple[Transfer, torch.Tensor]]) -> torch.Tensor:
    """Received head runs -> one block with the heads in order (runs are disjoint and
    together cover the receiver's K/V heads)."""
    pieces = sorted(received, key=lambda item: item[0].kv_heads)
    return torch.cat([data for _, data in pieces], dim=2)
