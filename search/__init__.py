"""Plan search: candidate layouts, the baselines they must beat, and `plan_search`.

This version is the proportional v0 planner (`proportional.py`); the greedy-global grouping,
the exact-local MILP and the Optuna layer of DESIGN.md §7 replace it in the search issue.
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
