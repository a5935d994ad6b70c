"""benchmarks/planner_pairs.py: a paired comparison of the random clusters' searches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import planner_pairs  # noqa: E402


def test_the_table_gives_each_trees_median_the_change_and_whether_plans_differ(monkeypatch):
    monkeypatch.setattr(planner_pairs, "CLUSTERS", 2)
    baseline = [[(0.2, 10.0), (0.4, 10.0), (0.3, 10.0)], [(1.0, 5.0), (1.0, 5.0), (1.0, 5.0)]]
    this_tree = [[(0.1, 10.0), (0.2, 10.0), (0.3, 10.0)], [(2.0, 5.0), (2.0, 6.0), (2.0, 5.0)]]
    lines = planner_pairs.format_table([baseline, this_tree], "CPU").splitlines()
    assert lines[0] == "| # | baseline CPU s | this tree CPU s | change | best plan |"
    assert lines[2] == "| 0 | 0.300 | 0.200 | -33.3 % | same |"
    assert lines[3] == "| 1 | 1.000 | 2.000 | +100.0 % | differs |"
    assert lines[4] == "| sum | 1.300 | 2.200 | +69.2 % | median ratio 1.333, 1 of 2 faster |"


@pytest.mark.parametrize(
    ("argv", "message"),
    [([], "--baseline is required"), (["--baseline", "HEAD", "--rounds", "0"], "at least 1")],
)
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        planner_pairs.parse_args(argv)
    assert message in capsys.readouterr().err
