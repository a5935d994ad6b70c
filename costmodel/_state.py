"""What the step simulator carries between events: per-plan constants and per-rank time books.

Everything the layer simulation reads per rank is gathered once into numpy arrays here, so the
events can be computed for all ranks at once instead of rank by rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TypeVar

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import CostModel
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec

T = TypeVar("T")

BREAKDOWN_KEYS = (
    "linear_s",
    "attention_s",
    "all_to_all_s",
    "ring_exposed_comm_s",
    "sharding_exposed_comm_s",
    "idle_s",
    "elementwise_s",
    "cast_s",
    "loss_s",
    "optimizer_s",
    "launch_s",
)
"""The `RankTime` parts, in its field order; they add up to the step time."""


@dataclass(frozen=True)
class SimContext:
    """Per-plan constants the layer simulation reads (arrays indexed by rank, group or node)."""

    cluster: Cluster
    model: ModelSpec
    train: TrainSpec
    layout: AttentionLayout
    cost: CostModel
    ranks_by_gpu: dict[str, np.ndarray]  # GPU model -> its ranks, models in order of appearance
    node_of: np.ndarray  # [rank] index into cluster.nodes
    bandwidth_GBps: np.ndarray  # [node, node] one-direction link bandwidth per GPU
    latency_s: np.ndarray  # [node, node] per-message link latency
    slowdown: np.ndarray  # [rank] emulation slowdown (1 on real GPUs)
    group_of: np.ndarray  # [rank] ring position of its HP group
    tokens: np.ndarray  # [rank] tokens owned outside attention (int64)
    heads: np.ndarray  # [rank] query heads inside attention (int64)
    kv_heads: np.ndarray  # [rank] K/V heads needed inside attention (int64)
    segment_lengths: np.ndarray  # [group] tokens of the group's segment (int64)
    rank_order: np.ndarray  # ranks sorted by group, for per-group reductions
    group_starts: np.ndarray  # [group] where the group's ranks begin in `rank_order`
    # Tables that depend only on the layout's groups and heads, kept by the caller across
    # simulations (`simulate_step(..., shared=)`); a fresh dict keeps nothing.
    shared: dict = field(default_factory=dict)

    def structural(self, name: str, compute: Callable[[AttentionLayout], T]) -> T:
        """`compute(layout)` of a table that depends on the layout's groups and heads only,
        once per such structure among the simulations sharing `shared`."""
        layout = self.layout
        key = (name, layout.groups, layout.head_ranges, layout.num_heads, layout.num_kv_heads)
        if key not in self.shared:
            self.shared[key] = compute(layout)
        return self.shared[key]

    def on_cluster(self, name: str, compute: Callable[[SimContext], T]) -> T:
        """`compute(self)` of a table that depends on the layout's groups and heads and on
        the cluster, model, step and cost model (their GPUs and links), not on the token
        split: once per such structure among the simulations sharing `shared`, which may
        simulate other clusters (the baselines')."""
        layout = self.layout
        pins = (self.cluster, self.model, self.train, self.cost)
        key = (layout.groups, layout.head_ranges)
        return pinned(self.shared, name, pins, lambda *_: compute(self), *key)

    def of_layout(self, name: str, compute: Callable[[SimContext], np.ndarray]) -> np.ndarray:
        """`compute(self)` of a table that depends on the whole layout (its token ranges
        too) and nothing else: once per layout among the simulations sharing `shared` where
        it keeps such tables (`LAYOUT_TABLES`), else each time."""
        tables = self.shared.get(LAYOUT_TABLES)
        if tables is None:
            return compute(self)
        key = (name, self.layout)
        if key not in tables:
            table = compute(self)
            table.setflags(write=False)
            tables[key] = table
        return tables[key]

    @cached_property
    def emulated(self) -> bool:
        """Whether some rank runs slowed down (an emulated cluster)."""
        return bool(np.any(self.slowdown != 1.0))

    @cached_property
    def rank_in_model_order(self) -> np.ndarray:
        """[rank] its column when the ranks are listed GPU model by model (`ranks_by_gpu`)."""
        order = np.concatenate(list(self.ranks_by_gpu.values()))
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        return position

    def group_max(self, values: np.ndarray) -> np.ndarray:
        """[group] largest of the [rank] `values` over each group's members."""
        return np.maximum.reduceat(values[self.rank_order], self.group_starts)


LAYOUT_TABLES = "layout tables"
"""The entry of a `shared` dict (`simulate_step`) that keeps tables by whole layout: worth it
where many simulations lay out the same layouts on other clusters (the baselines' uniform
grids on each GPU type's nodes), not in a search whose layouts all differ (a table of a ring
of G groups has G² entries)."""


def make_context(
    cluster: Cluster,
    model: ModelSpec,
    train: TrainSpec,
    layout: AttentionLayout,
    cost: CostModel,
    shared: dict | None = None,
) -> SimContext:
    """Gather the per-rank facts of `layout` on `cluster` once (O(N), no rank-by-rank lookups).

    The link matrices come from `cost.link_parameters` (a fitted model's measured links)."""
    shared = {} if shared is None else shared
    return SimContext(
        cluster=cluster,
        model=model,
        train=train,
        layout=layout,
        cost=cost,
        ranks_by_gpu=_ranks_by_gpu(cluster.rank_gpus),
        shared=shared,
        **pinned(shared, "cluster arrays", (cluster, cost), _cluster_arrays),
        **_layout_arrays(layout, shared),
    )


def pinned(shared: dict, name: str, pins: tuple, compute: Callable[..., T], *key) -> T:
    """`compute(*pins)` once per `name`, the identities of `pins` and `key` in `shared`
    (the entry keeps the pins alive, so their ids are not reused while it lives)."""
    full_key = (name, *key, *map(id, pins))
    found = shared.get(full_key)
    if found is None:
        found = shared[full_key] = (pins, compute(*pins))
    return found[1]


def _cluster_arrays(cluster: Cluster, cost: CostModel) -> dict[str, np.ndarray]:
    """The `SimContext` fields of the cluster and its links under `cost` (read-only)."""
    bandwidth_GBps, latency_s = cost.link_parameters(cluster)
    arrays = {
        "node_of": np.array(cluster.node_indices, dtype=np.int64),
        "bandwidth_GBps": np.array(bandwidth_GBps, dtype=np.float64),
        "latency_s": np.array(latency_s, dtype=np.float64),
        "slowdown": np.array(cluster.compute_slowdowns),
    }
    for array in arrays.values():
        array.setflags(write=False)
    return arrays


def _layout_arrays(layout: AttentionLayout, shared: dict | None = None) -> dict[str, np.ndarray]:
    """The `SimContext` fields that come from the layout alone, as int64 arrays: those of
    its groups and heads once per such structure among the simulations sharing `shared`."""
    if shared is None:
        arrays = _group_arrays(layout)
    else:
        key = ("group arrays", layout.groups, layout.head_ranges, layout.gqa_ratio)
        arrays = shared.get(key)
        if arrays is None:
            arrays = shared[key] = _group_arrays(layout)
    tokens = np.array(layout.token_counts, dtype=np.int64)
    # a valid layout's ranges are disjoint: a group's segment is its members' tokens
    segment_lengths = np.add.reduceat(tokens[arrays["rank_order"]], arrays["group_starts"])
    return {**arrays, "tokens": tokens, "segment_lengths": segment_lengths}


def _group_arrays(layout: AttentionLayout) -> dict[str, np.ndarray]:
    """The `SimContext` fields of the layout's groups and heads (read-only)."""
    group_count = len(layout.groups)
    group_of = np.empty(layout.world_size, dtype=np.int64)
    for group_index, members in enumerate(layout.groups):
        group_of[list(members)] = group_index
    starts, ends = np.array(layout.head_ranges, dtype=np.int64).T
    ratio = layout.gqa_ratio
    rank_order = np.argsort(group_of, kind="stable")
    arrays = {
        "group_of": group_of,
        "heads": ends - starts,
        "kv_heads": -(-ends // ratio) - starts // ratio,  # `layout.kv_head_range`
        "rank_order": rank_order,
        "group_starts": np.searchsorted(group_of[rank_order], np.arange(group_count)),
    }
    for array in arrays.values():
        array.setflags(write=False)
    return arrays


@lru_cache(maxsize=64)
def _ranks_by_gpu(gpus: tuple[str, ...]) -> dict[str, np.ndarray]:
    """GPU model -> its ranks (read-only arrays, shared by every simulation of a cluster)."""
    names = np.array(gpus)
    found = {gpu: np.flatnonzero(names == gpu) for gpu in dict.fromkeys(gpus)}
    for ranks in found.values():
        ranks.setflags(write=False)
    return found


def per_gpu_type(
    context: SimContext,
    seconds_of: Callable[[str, np.ndarray | slice], np.ndarray],
    trailing_shape: tuple[int, ...] = (),
) -> np.ndarray:
    """[rank, ...] times from `seconds_of(gpu, ranks)`, called once per GPU model with the
    ranks of that model (an index array, or `slice(None)` when all ranks share one model),
    scaled by each rank's emulation slowdown. The cost model broadcasts over arrays, so one
    call covers all ranks of a model; `trailing_shape` is what `seconds_of` returns after
    the rank axis."""
    slowdown = context.slowdown.reshape(-1, *(1,) * len(trailing_shape))
    emulated = context.emulated  # else every slowdown is 1: no products to take
    if len(context.ranks_by_gpu) == 1:
        (gpu,) = context.ranks_by_gpu
        seconds = seconds_of(gpu, slice(None))
        return seconds * slowdown if emulated else seconds
    seconds = np.empty((context.layout.world_size, *trailing_shape))
    for gpu, ranks in context.ranks_by_gpu.items():
        found = seconds_of(gpu, ranks)
        seconds[ranks] = found * slowdown[ranks] if emulated else found
    return seconds


def per_gpu_type_by_step(
    context: SimContext,
    seconds_of: Callable[[str, np.ndarray | slice], np.ndarray],
    steps: int,
) -> np.ndarray:
    """`per_gpu_type` of a [step, rank] table: `seconds_of(gpu, ranks)` returns [step,
    ranks of that model]. The models' blocks are laid side by side and put in rank order
    with one gather (writing them into the table column by column is several times slower)."""
    if len(context.ranks_by_gpu) == 1:
        (gpu,) = context.ranks_by_gpu
        return _slowed(context, seconds_of(gpu, slice(None)))
    by_model = np.empty((steps, context.layout.world_size))
    first = 0
    for gpu, ranks in context.ranks_by_gpu.items():
        by_model[:, first : first + len(ranks)] = seconds_of(gpu, ranks)
        first += len(ranks)
    return _slowed(context, np.take(by_model, context.rank_in_model_order, axis=1))


def _slowed(context: SimContext, seconds: np.ndarray) -> np.ndarray:
    """[step, rank] `seconds` times each rank's emulation slowdown (none on real GPUs)."""
    if context.emulated:
        return seconds * context.slowdown[None, :]
    return seconds


_ROW = {key: row for row, key in enumerate(BREAKDOWN_KEYS)}


class Ledger:
    """Per-rank accumulators of the breakdown categories: one [category, rank] table, so
    scaling, merging and totalling a ledger are one array operation each."""

    def __init__(self, world_size: int, table: np.ndarray | None = None) -> None:
        self.table = np.zeros((len(BREAKDOWN_KEYS), world_size)) if table is None else table

    @property
    def parts(self) -> dict[str, np.ndarray]:
        """Category -> [rank] seconds (views of the table)."""
        return dict(zip(BREAKDOWN_KEYS, self.table))

    def add(self, key: str, seconds: np.ndarray | float) -> None:
        row = self.table[_ROW[key]]
        row += seconds

    def scaled(self, factor: float) -> Ledger:
        return Ledger(self.table.shape[1], self.table * factor)

    def merge(self, other: Ledger) -> None:
        self.table += other.table

    def total(self) -> np.ndarray:
        """[rank] seconds of all categories, added in `BREAKDOWN_KEYS` order."""
        total = self.table[0].copy()
        for row in self.table[1:]:
            total += row
        return total
