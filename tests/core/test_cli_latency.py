"""benchmarks/cli_latency.py: the README's first command timed phase by phase in a fresh
process, and the table of medians."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from cli_latency import PHASES, format_table  # noqa: E402


def test_a_run_times_each_phase_and_saves_the_plan(tmp_path):
    store = f"sqlite:///{tmp_path / 'bench.db'}"
    probe = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import cli_latency; "
        f"print(json.dumps(cli_latency.measure(cli_latency.REPO, {store!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    phases = json.loads(done.stdout.splitlines()[-1])
    assert set(phases) == set(PHASES)
    assert all(seconds > 0 for seconds in phases.values())
    from hexiseq.store import Store

    with Store.open(store) as saved:
        assert [plan.cluster_name for plan in saved.list_plans()][:1] == ["h100x8-a100x8"]


def test_the_table_gives_each_trees_medians():
    def run(command_s, import_s):
        return {"command_s": command_s, "import_s": import_s, "store_s": 0.1, "search_s": 0.5}

    results = {
        "baseline": [{**run(2.0, 0.6), "rest_s": 0.1}, {**run(3.0, 0.8), "rest_s": 0.3}],
        "this": [{**run(1.0, 0.5), "rest_s": 0.2}],
    }
    rows = format_table(results, {"baseline": "abc1234", "this": "this tree"}).splitlines()
    assert rows[2] == "| abc1234 | 2.500 | 0.700 | 0.100 | 0.500 | 0.200 |"
    assert rows[3] == "| this tree | 1.000 | 0.500 | 0.100 | 0.500 | 0.200 |"
