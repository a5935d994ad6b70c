"""What `hexiseq run --replan` (the supervisor) and its ranks (`hexiseq.runtime.train`) tell each
other through the run's folder, one subfolder per launch (`launch_folder`: a step that runs
again after a lost device never meets an earlier launch's files). Files are written whole
(temporary file, then rename), so neither side ever reads half of one.

- `steps.jsonl`: rank 0 appends one line per step: step, loss, step time, plan name and, once
  the drift monitor has its baseline, every rank's relative drift.
- `drift-<step>.json`: rank 0, when some rank changed speed (`runtime._drift.Drift`).
- over several nodes, `ended-node<K>.json` (how node K's launch ended), `end.json` (node 0's
  decision then: relaunch with a plan, or stop) and `beat-node<K>.json` (node K's supervisor
  is alive: a count it raises every few seconds), `hexiseq.cli.supervise_nodes`.
- `decision-<step>.json`: the answer to that drift, created once (`claim_json`): by the
  supervisor, {"action": "replan", "plan": path} (the ranks checkpoint after that step and go
  on with the plan at `path`, in place: same world, work moved, states resharded from the
  checkpoint) or {"action": "keep"} (train on, the present speeds as the new start); or by
  rank 0 after `DECISION_TIMEOUT_S` without one, {"action": "keep"}. Whichever side created
  it first decided: the other reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hexiseq.errors import InputError

DEFAULT_DRIFT_THRESHOLD = 1.3
"""A rank drifted when its compute stays this many times its start (`runtime._drift`)."""
MIN_GAIN = 1.05
"""Default predicted speed-up below which a drift does not re-plan: the hand-over costs a
checkpoint, a model rebuilt and a warm-up step, more than a few per cent of a short run."""
DECISION_TIMEOUT_S = 60.0
STEP_LOG = "steps.jsonl"
REPLAN_ACTIONS = ("replan", "keep")


def launch_folder(run_folder: str | Path, launch: int) -> Path:
    """The folder of launch number `launch` (from 0) of a supervised run."""
    return Path(run_folder) / f"launch-{launch:03d}"


def launch_folders(run_folder: str | Path) -> list[Path]:
    """Every launch's folder of a run, in launch order."""
    return sorted(Path(run_folder).glob("launch-[0-9][0-9][0-9]"))


def drift_path(folder: str | Path, step: int) -> Path:
    """Rank 0's report of a drift seen after `step`."""
    return Path(folder) / f"drift-{step:08d}.json"


def decision_path(folder: str | Path, step: int) -> Path:
    """The answer to the drift report of `step`."""
    return Path(folder) / f"decision-{step:08d}.json"


def ended_path(folder: str | Path, node: int) -> Path:
    """Over several nodes: how node `node`'s launch ended (exit code, lost ranks)."""
    return Path(folder) / f"ended-node{node:03d}.json"


def beat_path(folder: str | Path, node: int) -> Path:
    """Over several nodes: node `node`'s supervisor's beat while its launch runs."""
    return Path(folder) / f"beat-node{node:03d}.json"


def end_path(folder: str | Path) -> Path:
    """Over several nodes: node 0's decision after a launch ended in error (relaunch with a
    plan, or stop)."""
    return Path(folder) / "end.json"


def claim_json(path: str | Path, document: Any) -> bool:
    """Create `path` holding `document`, whole, unless it exists already (then False and
    nothing written): the first of two writers decides."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.claim")
    temporary.write_text(json.dumps(document, indent=1))
    try:
        os.link(temporary, path)  # atomic, and fails where the name is taken
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)
    return True


def read_decision(path: str | Path) -> dict[str, str] | None:
    """The decision at `path`, or None while there is none; InputError for one that is not
    {"action": "keep"} or {"action": "replan", "plan": "<path>"}."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"decision file {path}: not JSON ({error})") from None
    action = document.get("action") if isinstance(document, dict) else None
    if action == "keep":
        return {"action": "keep"}
    if action == "replan" and isinstance(document.get("plan"), str) and document["plan"]:
        return {"action": "replan", "plan": document["plan"]}
    raise InputError(
        f'decision file {path}: expected {{"action": "keep"}} or {{"action": '
        f'"replan", "plan": "<path>"}}, got {str(document)[:200]}'
    )


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
    """Every whole line of the step logs so far, launch after launch (a torn last line is
    left out): `folder` is a launch's folder or a run's (then all its launches')."""
    folder = Path(folder)
    logs = [folder / STEP_LOG] if (folder / STEP_LOG).exists() else []
    logs += [launch / STEP_LOG for launch in launch_folders(folder)]
    entries = []
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries
