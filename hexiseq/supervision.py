"""What `hexiseq run --replan` (the supervisor) and its ranks (`hexiseq.runtime.train`) tell each
other through the run's folder: files written whole (temporary file, then rename), so neither
side ever reads half of one.

- `steps.jsonl`: rank 0 appends one line per step: step, loss, step time, plan name.
- `drift-<step>.json`: rank 0, when some rank changed speed (`runtime._drift.Drift`).
- `decision-<step>.json`: the supervisor's answer to that drift: {"action": "replan",
  "plan": path} (the ranks checkpoint after that step and go on with the plan at `path`, in
  place: same world, work moved, states resharded from the checkpoint) or {"action": "keep"}
  (train on, the present speeds as the new start). Rank 0 waits for it up to
  `DECISION_TIMEOUT_S`, then keeps the plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_DRIFT_THRESHOLD = 1.3
"""A rank drifted when its compute stays this many times its start (`runtime._drift`)."""
MIN_GAIN = 1.05
"""Default predicted speed-up below which a drift does not re-plan: a restart costs a
checkpoint, a relaunch and a warm-up step, more than a few per cent of a short run."""
DECISION_TIMEOUT_S = 60.0
STEP_LOG = "steps.jsonl"
REPLAN_ACTIONS = ("replan", "keep")


def drift_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"drift-{step:08d}.json"


def decision_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"decision-{step:08d}.json"


def write_json(path: str | Path, document: Any) -> None:
    """`document` as JSON at `path`, whole or not at all (a rename)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document, indent=1))
    os.replace(temporary, path)


def read_json(path: str | Path) -> Any | None:
    """The JSON document at `path`, or None while it is not there."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def append_step(folder: str | Path, entry: dict[str, Any]) -> None:
    """One line of `steps.jsonl` (a single small write: whole lines even if a rank dies)."""
    with open(Path(folder) / STEP_LOG, "a") as log:
        log.write(json.dumps(entry) + "\n")


def read_steps(folder: str | Path) -> list[dict[str, Any]]:
    """Every whole line of `steps.jsonl` so far (a torn last line is left out)."""
    path = Path(folder) / STEP_LOG
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries
