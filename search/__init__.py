"""Plan search (DESIGN.md §7): greedy global grouping and ring order, an exact local MILP
for heads, segments, token shares and state shares, an Optuna layer over the global choices,
and the homogeneous baselines every plan is compared with under the same simulator.
"""

from hexiseq.search.api import SearchResult, Trial, plan_search
from hexiseq.search.baselines import all_baselines, ring_only, ulysses_only, uniform_usp

__all__ = [
    "SearchResult",
    "Trial",
    "all_baselines",
    "plan_search",
    "ring_only",
    "ulysses_only",
    "uniform_usp",
]
