"""benchmarks/planner_ab.py: an interleaved comparison against an earlier revision, which
imports hexiseq from that revision's checkout."""

from __future__ import annotations

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
    rounds = {
        "baseline": {"16x2": [{"seconds": s, "tokens_per_s": 100.0} for s in (0.2, 0.4, 0.3)]},
        "this tree": {"16x2": [{"seconds": s, "tokens_per_s": 101.0} for s in (0.1, 0.15, 0.2)]},
    }
    row = format_table(rounds, ["16x2"]).splitlines()[-1]
    assert row == "| 16x2 | 0.300 | 0.150 | -50.0 % | +1.00 % |"


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
