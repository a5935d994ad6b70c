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
    """The groups padded to the largest group's size with members that move nothing, with
    the links their traffic takes (`_FanLinks`)."""

    def __init__(self, context: SimContext) -> None:
        self.context = context
        self.links = links = context.on_cluster("fan links", _FanLinks)
        self.tokens = np.where(links.real, context.tokens[links.members], 0).astype(np.float64)

    def durations(self, *, q_heads: bool, kv: bool) -> np.ndarray:
        context, links = self.context, self.links
        sent = batched_all_to_all_bytes(
            self.tokens,
            links.heads,
            links.kv_heads,
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
        cost, links = self.context.cost, self.links
        local_s = cost.transfer_time_s(
            (bytes_by_member * links.same_node).sum(axis=2), links.local_GBps, links.local_s
        )
        if not links.any_remote:
            return local_s
        remote_s = cost.transfer_time_s(
            (bytes_by_member * links.remote).sum(axis=2), links.remote_GBps, links.remote_s
        )
        return np.where(links.has_remote, np.maximum(local_s, remote_s), local_s)


class _FanLinks:
    """What the all-to-alls of a layout's groups take from its groups, heads and cluster
    alone, once per such structure (`SimContext.on_cluster`): each group's padded members
    ([group, slot], `_padded_members`), their heads, which share a node, and the links and
    latencies of their same-node and cross-node traffic."""

    def __init__(self, context: SimContext) -> None:
        self.members, self.real = members, real = _padded_members(context.layout)
        self.heads = np.where(real, context.heads[members], 0).astype(np.float64)
        self.kv_heads = np.where(real, context.kv_heads[members], 0).astype(np.float64)
        nodes = context.node_of[members]
        bandwidth, latency = context.bandwidth_GBps, context.latency_s
        self.same_node = nodes[:, :, None] == nodes[:, None, :]
        self.remote = ~self.same_node & real[:, None, :]
        self.any_remote = bool(self.remote.any())  # node-aligned groups never have one
        self.local_GBps, self.local_s = bandwidth[nodes, nodes], latency[nodes, nodes]
        self.has_remote = self.remote.any(axis=2)
        link_GBps = bandwidth[nodes[:, :, None], nodes[:, None, :]]
        slowest_GBps = np.where(self.remote, link_GBps, np.inf).min(axis=2)
        first_remote = np.take_along_axis(nodes, self.remote.argmax(axis=2), axis=1)
        # 1.0 GB/s where no member is on another node: no cross-node bytes to send
        self.remote_GBps = np.where(self.has_remote, slowest_GBps, 1.0)
        self.remote_s = latency[nodes, first_remote]


def _padded_members(layout: AttentionLayout) -> tuple[np.ndarray, np.ndarray]:
    """[group, slot] member ranks (padding repeats the first member) and which are real (once
    per groups and cluster among the simulations that share their tables, `_FanLinks`)."""
    groups = layout.groups
    width = max(len(members) for members in groups)
    padded = [list(members) + [members[0]] * (width - len(members)) for members in groups]
    real = np.arange(width)[None, :] < np.array([len(m) for m in groups])[:, None]
    members = np.array(padded, dtype=np.int64)
    for shared in (members, real):
        shared.setflags(write=False)
    return members, real
