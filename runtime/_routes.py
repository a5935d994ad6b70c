"""Who sends which K/V heads to whom: the runtime's communication plan, from the layout (pure).

Everything here is plain Python over an `AttentionLayout`, so it is the same on every rank and
can be checked without a process group. Three kinds of point-to-point transfer exist:

- **K/V ring hop** (group g-1 → group g, forward and backward): every rank of g receives each
  K/V head it needs from the *lowest rank of g-1 that holds that head* (exactly the simulator's
  `costmodel._traffic.ring_senders`).
- **dK/dV ring hop** (g-1 → g, backward): the FP32 gradient accumulator of a K/V head lives
  on one rank per group, the head's lowest holder ("keeper"); it goes keeper to keeper.
- **dK/dV fold** (inside a group, backward): a rank that holds a boundary K/V head but is not
  its keeper adds its partial gradient into the keeper's before the keeper sends it on.

A transfer moves one contiguous run of K/V heads; between two ranks there is at most one
transfer of each kind per hop, so the order of the messages never needs matching.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hexiseq.layout import AttentionLayout, kv_keepers

Range = tuple[int, int]


@dataclass(frozen=True)
class Transfer:
    """One message: K/V heads [kv_heads[0], kv_heads[1]) (global indices) from sender to
    receiver."""

    sender: int
    receiver: int
    kv_heads: Range

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


@dataclass(frozen=True)
class RankRoutes:
    """One rank's view of the plan: its group, the all-to-all shapes and its transfers.

    `kv_in`/`dkv_in` are the hops into this rank's group (this rank receives), `kv_out`/
    `dkv_out` the hops into the next group (this rank sends); `fold_in`/`fold_out` stay in the
    group. With one group there are no ring hops and no folds.
    """

    rank: int
    group_index: int
    num_groups: int
    members: tuple[int, ...]  # this rank's HP group, in layout order (the all-to-all order)
    member_tokens: tuple[int, ...]  # [member] tokens it owns outside attention
    member_heads: tuple[Range, ...]  # [member] query-head range inside attention
    member_kv_heads: tuple[Range, ...]  # [member] K/V-head range inside attention
    segment_orders: tuple[tuple[Range, ...], ...]  # [group] token ranges in member order
    kv_in: tuple[Transfer, ...]
    kv_out: tuple[Transfer, ...]
    dkv_in: tuple[Transfer, ...]
    dkv_out: tuple[Transfer, ...]
    fold_in: tuple[Transfer, ...]
    fold_out: tuple[Transfer, ...]

    @property
    def member_index(self) -> int:
        return self.members.index(self.rank)

    @property
    def heads(self) -> Range:
        return self.member_heads[self.member_index]

    @property
    def kv_heads(self) -> Range:
        return self.member_kv_heads[self.member_index]

    def block_owner(self, step: int) -> int:
        """Group whose K/V block this rank attends to at ring step `step`."""
        return (self.group_index - step) % self.num_groups

    def segment_length(self, group_index: int) -> int:
        return sum(end - start for start, end in self.segment_orders[group_index])


def build_rank_routes(layout: AttentionLayout, rank: int) -> RankRoutes:
    """The plan for `rank` of a validated `layout`."""
    group_index = layout.group_of(rank)
    count = len(layout.groups)
    members = layout.groups[group_index]
    hop_in = group_index
    hop_out = (group_index + 1) % count

    def mine(transfers: Iterable[Transfer], side: str) -> tuple[Transfer, ...]:
        return tuple(t for t in transfers if getattr(t, side) == rank) if count > 1 else ()

    return RankRoutes(
        rank=rank,
        group_index=group_index,
        num_groups=count,
        members=members,
        member_tokens=tuple(layout.num_tokens(m) for m in members),
        member_heads=tuple(layout.head_ranges[m] for m in members),
        member_kv_heads=tuple(layout.kv_head_range(m) for m in members),
        segment_orders=tuple(segment_in_member_order(layout, g) for g in range(count)),
        kv_in=mine(ring_kv_transfers(layout, hop_in), "receiver"),
        kv_out=mine(ring_kv_transfers(layout, hop_out), "sender"),
        dkv_in=mine(ring_dkv_transfers(layout, hop_in), "receiver"),
        dkv_out=mine(ring_dkv_transfers(layout, hop_out), "sender"),
        fold_in=mine(fold_transfers(layout, group_index), "receiver"),
        fold_out=mine(fold_transfers(layout, group_index), "sender"),
    )


def segment_in_member_order(layout: AttentionLayout, group_index: int) -> tuple[Range, ...]:
    """The group's token ranges in head-sharded order: member by member, each member's ranges
    in its own order (what the all-to-all delivers)."""
    return tuple(r for m in layout.groups[group_index] for r in layout.token_ranges[m])


def lowest_holders(layout: AttentionLayout, members: Iterable[int]) -> dict[int, int]:
    """K/V head -> its keeper among `members` (`hexiseq.layout.kv_keepers`)."""
    return kv_keepers(layout, members)


def ring_kv_transfers(layout: AttentionLayout, group_index: int) -> tuple[Transfer, ...]:
    """The K/V hop into `group_index` from the previous group: each receiving rank gets each
    K/V head it needs from that head's lowest holder in the previous group."""
    previous = layout.groups[(group_index - 1) % len(layout.groups)]
    holder = lowest_holders(layout, previous)
    transfers = []
    for receiver in layout.groups[group_index]:
        low, high = layout.kv_head_range(receiver)
        pairs = [(head, holder[head]) for head in range(low, high)]
        transfers += [Transfer(s, receiver, run) for s, run in _runs(pairs)]
    return _ordered(transfers)


def ring_dkv_transfers(layout: AttentionLayout, group_index: int) -> tuple[Transfer, ...]:
    """The dK/dV hop into `group_index`: each K/V head's accumulator goes from its keeper in
    the previous group to its keeper in this group."""
    previous = lowest_holders(layout, layout.groups[(group_index - 1) % len(layout.groups)])
    current = lowest_holders(layout, layout.groups[group_index])
    transfers = []
    for receiver in sorted(set(current.values())):
        pairs = [(h, previous[h]) for h in sorted(current) if current[h] == receiver]
        transfers += [Transfer(s, receiver, run) for s, run in _runs(pairs)]
    return _ordered(transfers)


def fold_transfers(layout: AttentionLayout, group_index: int) -> tuple[Transfer, ...]:
    """Inside a group: every holder of a K/V head that is not its keeper sends its partial
    dK/dV of that head to the keeper (only heads shared at GQA boundaries)."""
    members = layout.groups[group_index]
    keeper = lowest_holders(layout, members)
    transfers = []
    for sender in members:
        low, high = layout.kv_head_range(sender)
        pairs = [(h, keeper[h]) for h in range(low, high) if keeper[h] != sender]
        transfers += [Transfer(sender, r, run) for r, run in _runs(pairs)]
    return _ordered(transfers)


def _runs(head_peers: list[tuple[int, int]]) -> list[tuple[int, Range]]:
    """(head, peer) pairs in head order -> (peer, head run) for consecutive heads with one
    peer."""
    runs: list[tuple[int, Range]] = []
    for head, peer in head_peers:
        if runs and runs[-1][0] == peer and runs[-1][1][1] == head:
            runs[-1] = (peer, (runs[-1][1][0], head + 1))
        else:
            runs.append((peer, (head, head + 1)))
    return runs


def _ordered(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """One deterministic order on every rank (sender, receiver, first head)."""
    return tuple(sorted(transfers, key=lambda t: (t.sender, t.receiver, t.kv_heads)))
