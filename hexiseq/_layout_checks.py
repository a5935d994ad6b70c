"""The rules every `AttentionLayout` must keep (docs/design.md §3), one check per rule.

Each check raises `InputError` (a `ValueError`) with one line naming the broken rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hexiseq.errors import InputError

if TYPE_CHECKING:
    from hexiseq.layout import AttentionLayout


def check_sizes(layout: AttentionLayout) -> None:
    for name in ("seq_len", "num_heads", "num_kv_heads"):
        value = getattr(layout, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InputError(f"layout: {name}={value!r} is not allowed; need a positive integer")
    if layout.num_heads % layout.num_kv_heads:
        raise InputError(
            f"layout: num_kv_heads={layout.num_kv_heads} does not divide "
            f"num_heads={layout.num_heads}"
        )
    if layout.world_size == 0:
        raise InputError("layout: token_ranges is empty; need one entry per rank")
    if len(layout.head_ranges) != layout.world_size:
        raise InputError(
            f"layout: {len(layout.head_ranges)} head ranges for {layout.world_size} token-range "
            "entries; need one of each per rank"
        )


def check_groups(groups: Sequence[Sequence[int]], world_size: int) -> None:
    if not groups:
        raise InputError("layout: groups is empty; need at least one HP group")
    seen: dict[int, int] = {}
    for group_index, members in enumerate(groups):
        if not members:
            raise InputError(f"layout: group {group_index} is empty; every group needs a rank")
        for rank in members:
            if not isinstance(rank, int) or not 0 <= rank < world_size:
                raise InputError(
                    f"layout: group {group_index} has unknown rank {rank!r}; "
                    f"ranks are 0..{world_size - 1}"
                )
            if rank in seen:
                raise InputError(
                    f"layout: rank {rank} appears in groups {seen[rank]} and {group_index}; "
                    "each rank must be in exactly one group"
                )
            seen[rank] = group_index
    for rank in range(world_size):
        if rank not in seen:
            raise InputError(f"layout: rank {rank} is in no group; every rank needs one")


def check_token_ranges(layout: AttentionLayout) -> None:
    spans: list[tuple[int, int, int]] = []
    for rank, ranges in enumerate(layout.token_ranges):
        if not ranges:
            raise InputError(f"layout: rank {rank} owns no tokens; every rank needs at least one")
        for start, end in ranges:
            if not 0 <= start < end <= layout.seq_len:
                raise InputError(
                    f"layout: rank {rank} token range ({start}, {end}) is not allowed; "
                    f"need 0 <= start < end <= seq_len={layout.seq_len}"
                )
        starts = [start for start, _ in ranges]
        if starts != sorted(set(starts)):
            raise InputError(f"layout: rank {rank} token ranges {list(ranges)} are not sorted")
        spans.extend((start, end, rank) for start, end in ranges)
    problem = _first_partition_problem(spans, layout.seq_len, "tokens", "rank")
    if problem:
        raise InputError(
            f"layout: {problem}; token ranges must partition [0, {layout.seq_len}) exactly"
        )


def check_head_ranges(layout: AttentionLayout) -> None:
    for rank, (start, end) in enumerate(layout.head_ranges):
        if not 0 <= start < end <= layout.num_heads:
            raise InputError(
                f"layout: rank {rank} head range ({start}, {end}) is not allowed; "
                f"need 0 <= start < end <= num_heads={layout.num_heads}"
            )
    for group_index, members in enumerate(layout.groups):
        spans = [(*layout.head_ranges[rank], rank) for rank in members]
        problem = _first_partition_problem(spans, layout.num_heads, "heads", "rank")
        if problem:
            raise InputError(
                f"layout: group {group_index} {problem}; within a group head ranges must "
                f"partition [0, {layout.num_heads}) exactly"
            )


def _first_partition_problem(
    spans: Sequence[tuple[int, int, int]], end: int, what: str, owner: str
) -> str | None:
    """First gap or overlap when (start, end, owner) spans should partition [0, end)."""
    cursor, last_owner = 0, None
    for start, stop, who in sorted(spans):
        if start > cursor:
            return f"{what} [{cursor}, {start}) are owned by no {owner}"
        if start < cursor:
            return (
                f"{what} [{start}, {min(stop, cursor)}) are owned by both {owner} {last_owner} "
                f"and {owner} {who}"
            )
        cursor, last_owner = stop, who
    if cursor < end:
        return f"{what} [{cursor}, {end}) are owned by no {owner}"
    return None
