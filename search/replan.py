"""Re-planning a running plan when its cluster changed: a device measured slower (or faster)
than the plan assumed, or a device lost.

The changed cluster is the plan's own with each measured factor folded into the device's
`measured_slowdown` (which the cost model multiplies its compute by) and the lost devices
removed (`Cluster.with_measured_slowdowns`, `Cluster.without_ranks`). The new plan is the
default search's on that cluster for the same model and step (sequence length, batch,
recompute, precision); the old plan is predicted again on it under the same cost model, so
the two step times compare, and their ratio is the gain the re-plan predicts. A plan that
lost a device cannot run as it was: its old step time is None and the re-plan is taken.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import CostModel
from hexiseq.errors import InfeasibleError
from hexiseq.plan import Plan
from hexiseq.search.api import plan_search
from hexiseq.search.predict import predict
from hexiseq.supervision import MIN_GAIN


@dataclass(frozen=True)
class Replanned:
    """The outcome of one re-plan."""

    plan: Plan
    """The new plan, on the changed cluster (its ranks numbered as `rank_map` says)."""
    rank_map: dict[int, int]
    """Old rank -> new rank of every device kept (lost ones have none)."""
    predicted_old_step_s: float | None
    """The old plan predicted on the changed cluster (None: it lost a device)."""
    predicted_new_step_s: float
    planning_s: float

    @property
    def predicted_gain(self) -> float | None:
        """How many times faster the new plan's step is predicted (None: the old cannot run)."""
        if self.predicted_old_step_s is None:
            return None
        return self.predicted_old_step_s / self.predicted_new_step_s

    def worth_it(self, min_gain: float = MIN_GAIN) -> bool:
        """Take the new plan: the old one lost a device, or the new is `min_gain` faster."""
        gain = self.predicted_gain
        return gain is None or gain >= min_gain


def replan(
    plan: Plan,
    cost_model: CostModel,
    *,
    slowdowns: Mapping[int, float] | None = None,
    lost: Iterable[int] = (),
    name: str | None = None,
) -> Replanned:
    """Plan `plan`'s model and step again on its cluster as measured: rank r `slowdowns[r]`
    times slower than the plan assumed, the `lost` ranks gone. InfeasibleError naming what
    is missing when nothing fits any more (the lost devices held memory the model needs);
    InputError for a rank the cluster does not have."""
    lost = sorted(set(lost))
    changed = plan.cluster.with_measured_slowdowns(dict(slowdowns or {}))
    old_step_s = None if lost else _predicted_step_s(plan, changed, cost_model)
    if lost:
        changed = changed.without_ranks(lost)
    began = time.perf_counter()
    try:
        result = plan_search(
            changed,
            plan.model,
            plan.train.seq_len,
            cost_model=cost_model,
            micro_batches=plan.train.micro_batches,
            activation_checkpointing=plan.train.activation_checkpointing,
            precision="fp32" if plan.train.compute_dtype_bytes == 4 else "bf16",
        )
    except InfeasibleError as error:
        message = f"re-plan of '{plan.name}' on what is left: {error}"
        raise InfeasibleError(message, error.missing_bytes) from None
    planning_s = time.perf_counter() - began
    new = dataclasses.replace(result.best, name=name or f"{plan.name}-replanned")
    kept = [r for r in range(plan.cluster.world_size) if r not in set(lost)]
    return Replanned(
        plan=new,
        rank_map={old: new_rank for new_rank, old in enumerate(kept)},
        predicted_old_step_s=old_step_s,
        predicted_new_step_s=new.predicted.step_time_s,
        planning_s=planning_s,
    )


def _predicted_step_s(plan: Plan, cluster: Cluster, cost_model: CostModel) -> float:
    """`plan` (layout, shares, replicas) simulated on `cluster`: the same devices, measured."""
    moved = dataclasses.replace(plan, cluster=cluster)
    return predict(moved, cost_model=cost_model).step_time_s
