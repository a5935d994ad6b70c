"""benchmarks/plan_quality.py --held-out keeps the exhaustive optima it finds, for the scoring
code that found them, and benchmarks/planner_scaling.py writes the grid and the random
clusters into sections of their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _results  # noqa: E402
import plan_quality  # noqa: E402
import planner_scaling  # noqa: E402
from plan_quality import Case, KeptOptima, held_out_case, held_out_cases  # noqa: E402

from hexiseq import Cluster  # noqa: E402

NODES = [{"name": "n0", "gpu": "H100-SXM", "count": 2}, {"name": "n1", "gpu": "L40S", "count": 1}]
TINY = Cluster.from_dict({"name": "tiny-mix", "nodes": NODES, "network": {"inter_node_GBps": 25}})
CASE = Case(0, TINY, "tiny-7h", 16384)


def test_an_optimum_found_is_kept_and_read_back_instead_of_searched_again(tmp_path):
    path = tmp_path / "optima.json"
    kept = KeptOptima.load(path)
    first = held_out_cases(7, [CASE], kept, processes=1, optuna=False)[0]
    assert first.exhaustive_tokens_per_s > 0 and first.default_tokens_per_s > 0
    assert first.winner.startswith("n")  # the winner's ring, e.g. "n0:H100-SXM[1+1] > ..."
    stored = json.loads(path.read_text())
    assert stored["fingerprint"] == plan_quality.scoring_fingerprint()
    assert stored["optima"]["7:0"]["tokens_per_s"] == first.exhaustive_tokens_per_s

    again = KeptOptima.load(path)
    entry = again.get("7:0", CASE)
    assert entry is not None
    marked = {**entry, "tokens_per_s": 2 * entry["tokens_per_s"]}  # not searched again
    result, fresh = held_out_case((CASE, marked, False))
    assert not fresh and result.exhaustive_tokens_per_s == 2 * first.exhaustive_tokens_per_s
    assert result.default_tokens_per_s == first.default_tokens_per_s


def test_optima_of_other_scoring_code_or_of_another_case_are_not_used(tmp_path):
    path = tmp_path / "optima.json"
    entry = {"case": plan_quality.describe_case(CASE), "tokens_per_s": 1.0, "winner": "w"}
    path.write_text(json.dumps({"fingerprint": "older code", "optima": {"7:0": entry}}))
    assert KeptOptima.load(path).get("7:0", CASE) is None

    path.write_text(
        json.dumps({"fingerprint": plan_quality.scoring_fingerprint(), "optima": {"7:0": entry}})
    )
    assert KeptOptima.load(path).get("7:0", CASE) == entry
    other = Case(0, TINY, "tiny-7h", 32768)  # the same key, drawn otherwise
    assert KeptOptima.load(path).get("7:0", other) is None

    path.write_text("{ not json")
    assert KeptOptima.load(path).optima == {}


def test_the_grid_and_the_random_clusters_each_keep_their_own_section(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(_results, "RESULTS", results)
    planner_scaling.update_results("| grid 1 |", "| random 1 |", ["- g"], ["- r"], 5, "all")
    planner_scaling.update_results("| grid 2 |", "", ["- g"], [], 5, "--no-random")
    text = results.read_text()
    assert "| grid 2 |" in text and "| grid 1 |" not in text
    random = text.split("<!-- planner_scaling_random:start -->")[1]
    assert "| random 1 |" in random.split("<!-- planner_scaling_random:end -->")[0]
    planner_scaling.update_results("", "| random 2 |", [], ["- r"], 5, "--random-only")
    text = results.read_text()
    assert text.count("planner_scaling_random:start") == 1
    assert "| random 2 |" in text and "| random 1 |" not in text and "| grid 2 |" in text


def test_a_malformed_or_unwritable_optima_file_costs_no_run(tmp_path, capsys):
    fingerprint = plan_quality.scoring_fingerprint()
    path = tmp_path / "optima.json"
    for optima in ([1, 2], {"7:0": "not an entry"}, {"7:0": {"case": "x", "tokens_per_s": "?"}}):
        path.write_text(json.dumps({"fingerprint": fingerprint, "optima": optima}))
        assert KeptOptima.load(path).get("7:0", CASE) is None
    blocked = tmp_path / "a file" / "optima.json"  # its folder cannot be made
    (tmp_path / "a file").write_text("")
    kept = KeptOptima.load(blocked)
    kept.put("7:0", CASE, 1.0, "w")
    assert kept.get("7:0", CASE)["tokens_per_s"] == 1.0  # kept for this run
    assert "cannot keep the optima" in capsys.readouterr().err
