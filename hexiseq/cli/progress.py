"""Whether `hexiseq plan` shows a progress bar: on stderr, and only when stderr is a terminal,
so that a pipe or a log file stays clean, and only for a search that samples (a trial count,
or a time budget over a second). The bar itself is the search's (`plan_search(show_progress=
True)`): Optuna's with one worker, the same kind of tqdm bar with `--workers N`, whose trials
all finish in the searching process.
"""

from __future__ import annotations

import sys
from typing import TextIO


def shows_progress(
    *, n_trials: int | None, time_budget_s: float | None, stream: TextIO | None = None
) -> bool:
    """Whether the search shows its bar on `stream` (stderr)."""
    stream = sys.stderr if stream is None else stream
    long_search = n_trials is not None or (time_budget_s is not None and time_budget_s > 1)
    return long_search and stream.isatty()
