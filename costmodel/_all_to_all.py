"""The all-to-alls inside the HP groups that switch attention between sequence and head form.

An all-to-all starts when the group's last member is ready and lasts as long as its slowest
member takes to send or to receive its shares; same-node and cross-node traffic use their own
links. Durations depend on the layout only, so they are computed once per plan for all groups
at once: groups are padded to the largest group's size with members that move nothing.
"""

from __future__ import annotations

import numpy as np

from hexiseq.costmodel._state import Ledger, SimContext
from hexiseq.costmodel._traffic import batched_all_to_all_bytes
from hexiseq.layout import AttentionLayout


def all_to_all(
    context: SimContext, ledger: Ledger, ready: np.ndarray, durations_s: np.ndarray
) -> np.ndarray:
    """Run one all-to-all in every group (`durations_s` per group); returns each rank's end."""
    sync = context.group_max(ready)[context.group_of]
    duration = durations_s[context.group_of]
    ledger.add("idle_s", sync - ready)
    ledger.add("all_to_all_s", duration)
    return sync + duration


def all_to_all_durations(context: SimContext) -> tuple[np.ndarray, np.ndarray]:
    """[group] durations of the all-to-all that moves the query-head and the K/V parts, and
    of the one that moves the query-head part only: the slowest member's send or receive
    time. The groups' padded members and links are worked out once for both."""
    fan = _Fan(context)
    return fan.durations(q_heads=True, kv=True), fan.durations(q_heads=True, kv=False)


class _Fan:
    """The groups padded to the largest group's size with members that move nothing, and
    which of their members share a node."""

    def __init__(self, context: SimContext) -> None:
        self.context = context
        members, real = context.structural("padded members", _padded_members)
        self.tokens = np.where(real, context.tokens[members], 0).astype(np.float64)
        self.heads = np.where(real, context.heads[members], 0).astype(np.float64)
        self.kv_heads = np.where(real, context.kv_heads[members], 0).astype(np.float64)
        self.nodes = nodes = context.node_of[members]
        self.same_node = nodes[:, :, None] == nodes[:, None, :]
        self.remote = ~self.same_node & real[:, None, :]
        self.any_remote = bool(self.remote.any())  # node-aligned groups never have one

    def durations(self, *, q_heads: bool, kv: bool) -> np.ndarray:
        context = self.context
        sent = batched_all_to_all_bytes(
            self.tokens,
            self.heads,
            self.kv_heads,
            context.model.head_dim,
            q_heads=q_heads,
            kv=kv,
            element_bytes=context.train.compute_dtype_bytes,
        )
        send_s = self._fan_times(sent)
        receive_s = self._fan_times(sent.transpose(0, 2, 1))
        return np.maximum(send_s, receive_s).max(axis=1)

    def _fan_times(self, bytes_by_member: np.ndarray) -> np.ndarray:
        """[group, member] time for each member to send (or receive) its shares to every
        other member: same-node bytes over the node's link, cross-node bytes through the
        slowest link to any member on another node."""
        context, nodes, remote = self.context, self.nodes, self.remote
        cost, bandwidth, latency = context.cost, context.bandwidth_GBps, context.latency_s
        local_s = cost.transfer_time_s(
            (bytes_by_member * self.same_node).sum(axis=2),
            bandwidth[nodes, nodes],
            latency[nodes, nodes],
        )
        if not self.any_remote:
            return local_s
        has_remote = remote.any(axis=2)
        link_GBps = bandwidth[nodes[:, :, None], nodes[:, None, :]]
        slowest_GBps = np.where(remote, link_GBps, np.inf).min(axis=2)
        first_remote = np.take_along_axis(nodes, remote.argmax(axis=2), axis=1)
        remote_s = cost.transfer_time_s(
            (bytes_by_member * remote).sum(axis=2),
            np.where(has_remote, slowest_GBps, 1.0),  # 1.0: no cross-node member, no bytes
            latency[nodes, first_remote],
        )
        return np.where(has_remote, np.maximum(local_s, remote_s), local_s)


def _padded_members(layout: AttentionLayout) -> tuple[np.ndarray, np.ndarray]:
    """[group, slot] member ranks (padding repeats the first member) and which are real (once
    per groups among the simulations that share their tables, `SimContext.structural`)."""
    groups = layout.groups
    width = max(len(members) for members in groups)
    padded = [list(members) + [members[0]] * (width - len(members)) for members in groups]
    real = np.arange(width)[None, :] < np.array([len(m) for m in groups])[:, None]
    members = np.array(padded, dtype=np.int64)
    for shared in (members, real):
        shared.setflags(write=False)
    return members, real
