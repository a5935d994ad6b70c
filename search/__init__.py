"""Plan search (docs/design.md §7): greedy global grouping and ring order (`greedy`), an exact
local stage for segments, token shares and state shares (`local_milp`), a screen that prices
candidates without simulating them (`screen`), the short list (`shortlist`), the Optuna study
loop (`optuna_layer`, `objective`, `sampling`, `studies`), the polish (`polish`), and the
baselines every plan is compared with under the same simulator (`baselines`). The default
search hands the baselines and half of its independent work to a helper process (`helper`,
`beside`). `plan_search` (`api`) takes its options as keywords or as one `SearchOptions`
(`options`).
"""

from hexiseq.search.api import SearchResult, Trial, plan_search
from hexiseq.search.baselines import (
    all_baselines,
    homogeneous_subset,
    ring_only,
    ulysses_only,
    uniform_usp,
)
from hexiseq.search.options import SearchOptions

__all__ = [
    "SearchOptions",
    "SearchResult",
    "Trial",
    "all_baselines",
    "homogeneous_subset",
    "plan_search",
    "ring_only",
    "ulysses_only",
    "uniform_usp",
]
