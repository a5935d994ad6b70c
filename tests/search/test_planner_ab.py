"""benchmarks/planner_ab.py: an interleaved comparison against an earlier revision, which
imports hexiseq from that revision's checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from planner_ab import format_table, main  # noqa: E402


def test_a_round_measures_the_tree_it_is_given(tmp_path):
    """The worker process imports hexiseq from the tree named (a copy of search/ here, whose
    plan_search is marked), and reports each cell's time and best plan."""
    copy = tmp_path / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(copy), "HEAD"],
        check=True,
        capture_output=True,
    )
    try:
        marker = "plan_search.__module__  # marked by test_planner_ab\n"
        (copy / "search" / "api.py").write_text(
            (copy / "search" / "api.py").read_text() + f"\nPLANNER_AB_MARK = {marker}"
        )
        probe = (
            "import sys; sys.path.insert(0, 'benchmarks'); import planner_ab; "
            f"planner_ab.measure(planner_ab.Path({str(copy)!r}), [], 1); "
            "import hexiseq.search.api as api; print(api.PLANNER_AB_MARK)"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
        )
        assert done.stdout.strip() == "hexiseq.search.api"
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(copy)],
            check=True,
            capture_output=True,
        )


def test_the_table_gives_medians_over_rounds_and_whether_plans_changed():
    def rounds_of(seconds, scoring, tokens_per_s):
        return [
            {"seconds": s, "scoring_s": c, "tokens_per_s": tokens_per_s}
            for s, c in zip(seconds, scoring)
        ]

    rounds = {
        "baseline": {
            "16x2": rounds_of((0.2, 0.4, 0.3), (0.02, 0.04, 0.03), 100.0),
            "random3": rounds_of((0.5, 0.5, 0.5), (None, None, None), 7.0),
        },
        "this tree": {
            "16x2": rounds_of((0.1, 0.15, 0.2), (0.01, 0.01, 0.02), 101.0),
            "random3": rounds_of((0.4, 0.6, 0.5), (0.1, 0.2, 0.3), 7.0),
        },
    }
    rows = format_table(rounds, ["16x2", "random3"]).splitlines()
    assert rows[2] == "| 16x2 | 0.300 | 0.150 | -50.0 % | 30.0 -> 10.0 | +1.00 % |"
    assert rows[3] == "| random3 | 0.500 | 0.500 | +0.0 % | - -> 200.0 | same |"
    assert (
        rows[4] == "| sum of 1 grid cells | 0.300 | 0.150 | -50.0 % | 30.0 -> 10.0 (-66.7 %) | |"
    )
    assert rows[5] == "| sum of 1 random clusters | 0.500 | 0.500 | +0.0 % | 0.0 -> 200.0 (-) | |"


def test_a_measured_search_notes_when_its_short_list_is_scored():
    """`measure` (in a process of its own, as a round runs it): the part that scores the
    short list is timed, within the search's own time."""
    probe = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import planner_ab; "
        "print(json.dumps(planner_ab.measure(planner_ab.REPO, ['16x1'], 1)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.splitlines()[-1])["16x1"]
    assert 0 < found["scoring_s"] < found["seconds"] and found["tokens_per_s"] > 0


def test_bad_input_gets_one_line_naming_what_is_allowed(capsys):
    with pytest.raises(SystemExit) as cell:
        main(["--baseline", "HEAD", "16x"])
    assert cell.value.code == 2 and "GPUSxTYPES" in capsys.readouterr().err
    with pytest.raises(SystemExit) as random:
        main(["--baseline", "HEAD", "random20"])
    assert random.value.code == 2 and "randomN, N from 0 to 19" in capsys.readouterr().err
    with pytest.raises(SystemExit) as revision:
        main(["--baseline", "no-such-revision", "16x1"])
    assert "is not a revision of this repository" in str(revision.value.code)
