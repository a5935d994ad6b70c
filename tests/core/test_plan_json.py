"""Tests of hexiseq.plan: JSON round trips, the layout a plan carries, and bad plan files."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

import hexiseq
from hexiseq import AttentionLayout, InfeasiblePlan, InputError, Plan
from hexiseq.plan import PLAN_SCHEMA_VERSION

# The plan JSON `hexiseq run` recorded for run 3 of the shared one-H100 store (llama3.2-3b, 8K
# tokens), as written by hexiseq 490c15d: plan schema_version 1.
V1_PLAN = Path(__file__).parent / "data" / "plan_v1_llama3.2-3b_8k.json"


@pytest.fixture(scope="module")
def big_result():
    """The HexiSeq paper's case: 30B model, 256K tokens, 8 H100 + 8 A100 (about 0.6 s)."""
    # 256K: at 512K today's runtime fills the cards (FP32 loss) and the best plan is uniform.
    return hexiseq.plan_search("h100x8-a100x8", "llama-30b", "256k")


@pytest.fixture(scope="module")
def small_result():
    return hexiseq.plan_search("cpu-emulated-2type", "tiny", 4096)


@pytest.fixture(scope="module", params=["big_result", "small_result"])
def result(request):
    """Each search once per module, shared by every test that takes `result`."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def small_document(small_result, tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("plan") / "small.json"
    small_result.best.to_json(path)
    return json.loads(path.read_text(encoding="utf-8"))


def _all_plans(result) -> list[Plan]:
    return [result.best, *(p for p in result.baselines.values() if isinstance(p, Plan))]


# --- round trip ---------------------------------------------------------------------------------


def test_to_json_from_json_round_trips_exactly(result, tmp_path):
    for index, plan in enumerate(_all_plans(result)):
        path = tmp_path / f"plan{index}.json"
        plan.to_json(path)
        loaded = Plan.from_json(path)
        assert loaded == plan, plan.name
        # Floats come back bit for bit, not merely close.
        assert loaded.predicted.tokens_per_s == plan.predicted.tokens_per_s
        assert loaded.predicted.step_time_s == plan.predicted.step_time_s
        for mine, theirs in zip(loaded.predicted.ranks, plan.predicted.ranks):
            assert mine.attention_s == theirs.attention_s
            assert mine.memory_fraction == theirs.memory_fraction
        assert [a.state_fraction for a in loaded.assignments] == [
            a.state_fraction for a in plan.assignments
        ]
        # Writing the loaded plan again gives the same document (see the xfail in
        # test_cluster.py for why not the same bytes: 450 comes back as 450.0).
        again = tmp_path / f"again{index}.json"
        loaded.to_json(again)
        assert json.loads(again.read_text(encoding="utf-8")) == json.loads(
            path.read_text(encoding="utf-8")
        )


def test_json_document_carries_schema_version_and_all_parts(result, tmp_path):
    path = tmp_path / "plan.json"
    result.best.to_json(path)
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["schema_version"] == PLAN_SCHEMA_VERSION == 3
    assert set(document) == {
        "schema_version",
        "name",
        "cluster",
        "model",
        "train",
        "layout",
        "assignments",
        "knobs",
        "predicted",
    }
    assert document["cluster"]["name"] == result.best.cluster.name
    assert len(document["assignments"]) == result.best.cluster.world_size
    assert len(document["predicted"]["ranks"]) == result.best.cluster.world_size
    assert Plan.from_json_text(result.best.to_json_text()) == result.best


def test_layout_validates_and_matches_the_assignments(result):
    for plan in _all_plans(result):
        layout = plan.layout()
        assert isinstance(layout, AttentionLayout)
        layout.validate()  # raises on any broken rule of docs/design.md §3
        assert layout.seq_len == plan.train.seq_len
        assert layout.num_heads == plan.model.heads
        assert layout.num_kv_heads == plan.model.kv_heads
        assert layout.world_size == plan.cluster.world_size == len(plan.assignments)
        assert sum(a.tokens for a in plan.assignments) == plan.train.seq_len
        for assignment in plan.assignments:
            rank = assignment.rank
            assert assignment.tokens == layout.num_tokens(rank)
            assert assignment.head_range == layout.head_ranges[rank]
            assert assignment.group == layout.group_of(rank)
            assert assignment.gpu == plan.cluster.devices[rank].gpu


def test_best_plan_fits_in_memory_and_beats_feasible_baselines(result):
    best = result.best
    assert len(best.predicted.ranks) == best.cluster.world_size
    assert best.predicted.max_memory_fraction <= 0.95
    assert all(rank.memory_fraction <= 0.95 for rank in best.predicted.ranks)
    assert best.predicted.tokens_per_s == pytest.approx(
        best.train.tokens_per_step / best.predicted.step_time_s
    )
    for name, baseline in result.baselines.items():
        if isinstance(baseline, Plan):
            assert best.predicted.tokens_per_s >= baseline.predicted.tokens_per_s, name
    assert best.name in {trial.name for trial in result.trials}


def test_h100_a100_paper_case(big_result):
    result = big_result
    assert result.best.cluster.world_size == 16
    assert set(result.baselines) == {
        "uniform-usp",
        "ring-only",
        "ulysses-only",
        "homogeneous-subset",
    }
    # 52 heads cannot be split evenly over 16 ranks: reported as infeasible, not dropped.
    ulysses = result.baselines["ulysses-only"]
    assert isinstance(ulysses, InfeasiblePlan)
    assert "52 heads" in ulysses.reason
    # The asymmetric plan gives the faster H100s more tokens than the A100s.
    tokens = {a.gpu: a.tokens for a in result.best.assignments}
    assert tokens["H100-SXM"] > tokens["A100-80G"]
    assert result.speedup_over("uniform-usp") > 1.0
    assert result.speedup_over("ulysses-only") is None


# --- bad plan files -----------------------------------------------------------------------------


def _write_json(tmp_path: Path, document: Any) -> Path:
    path = tmp_path / "bad-plan.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def _one_line_error(path: Path, pattern: str) -> str:
    with pytest.raises(InputError, match=pattern) as info:
        Plan.from_json(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_plan_file(tmp_path):
    path = tmp_path / "nowhere" / "plan.json"
    _one_line_error(path, re.escape(f"plan file {path}: cannot be read (No such file"))


@pytest.mark.parametrize(
    ("text", "line"), [("{not json", 1), ("", 1), ('{"schema_version": 1,\n "name": }', 2)]
)
def test_invalid_json(tmp_path, text, line):
    path = tmp_path / "bad-plan.json"
    path.write_text(text, encoding="utf-8")
    _one_line_error(path, re.escape(f"plan file {path}: not valid JSON (line {line}: "))


def test_json_that_is_not_an_object(tmp_path):
    path = _write_json(tmp_path, [1, 2])
    _one_line_error(path, r"not a hexiseq plan \(expected a JSON object\)$")


@pytest.mark.parametrize("version", [4, 0, "1", None])
def test_wrong_schema_version(tmp_path, small_document, version):
    document = copy.deepcopy(small_document)
    document["schema_version"] = version
    path = _write_json(tmp_path, document)
    _one_line_error(
        path,
        re.escape(f"plan file {path}: schema_version {version!r} is not supported; ")
        + r"this hexiseq reads versions 1, 2 and 3$",
    )


def test_a_version_1_plan_loads_and_is_written_as_the_current_version(tmp_path):
    """Run 3 of the shared one-H100 store (hexiseq 490c15d): its ranks lack the time parts
    version 2 added, which read as 0.0 s; writing it again writes the current version."""
    document = json.loads(V1_PLAN.read_text(encoding="utf-8"))
    assert document["schema_version"] == 1
    plan = Plan.from_json(V1_PLAN)
    stored = document["predicted"]["ranks"][0]
    loaded = plan.predicted.ranks[0]
    for part, seconds in loaded.to_dict().items():
        assert seconds == stored.get(part, 0.0), part
    assert plan.predicted.step_time_s == document["predicted"]["step_time_s"]
    assert plan.assignments[0].state_fraction == 1.0 and plan.train.activation_checkpointing
    path = tmp_path / "again.json"
    plan.to_json(path)
    again = json.loads(path.read_text(encoding="utf-8"))
    assert again["schema_version"] == PLAN_SCHEMA_VERSION == 3
    assert Plan.from_json(path) == plan


def test_missing_schema_version(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    del document["schema_version"]
    _one_line_error(_write_json(tmp_path, document), r"schema_version None is not supported")


@pytest.mark.parametrize(
    "key", ["name", "cluster", "model", "train", "layout", "assignments", "knobs", "predicted"]
)
def test_missing_top_level_field(tmp_path, small_document, key):
    document = copy.deepcopy(small_document)
    del document[key]
    path = _write_json(tmp_path, document)
    _one_line_error(
        path, re.escape(f"plan file {path}: not a hexiseq plan: missing field '{key}'") + "$"
    )


@pytest.mark.parametrize(
    ("where", "key"),
    [
        (("predicted",), "tokens_per_s"),
        (("assignments", 0), "tokens"),
        (("predicted", "ranks", 1), "memory_bytes"),
        (("model",), "heads"),
        (("train",), "seq_len"),
    ],
)
def test_missing_nested_field_is_named(tmp_path, small_document, where, key):
    document = copy.deepcopy(small_document)
    owner = document
    for step in where:
        owner = owner[step]
    del owner[key]
    path = _write_json(tmp_path, document)
    _one_line_error(path, rf"^plan file {re.escape(str(path))}: .*\b{key}\b")


def test_missing_cluster_field_names_plan_file_and_field(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    del document["cluster"]["nodes"][0]["gpu"]
    path = _write_json(tmp_path, document)
    _one_line_error(
        path,
        re.escape(f"plan file {path}: cluster: nodes[0].gpu: required field is missing") + "$",
    )


def _overlapping_tokens(document: dict[str, Any]) -> dict[str, Any]:
    """Rank 1's first token range starts 10 tokens early, inside rank 0's first range."""
    document = copy.deepcopy(document)
    ranges = document["layout"]["token_ranges"]
    assert ranges[0][0][1] == ranges[1][0][0]  # the zigzag puts rank 1's front chunk next
    ranges[1][0][0] -= 10
    return document


def test_overlapping_token_ranges_are_rejected(tmp_path, small_document):
    path = _write_json(tmp_path, _overlapping_tokens(small_document))
    end = small_document["layout"]["token_ranges"][0][0][1]
    _one_line_error(
        path,
        re.escape(f"tokens [{end - 10}, {end}) are owned by both rank 0 and rank 1; ")
        + r"token ranges must partition \[0, 4096\) exactly$",
    )


def test_head_ranges_with_a_gap_are_rejected(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    low, high = document["layout"]["head_ranges"][0]  # rank 0's, in group 0
    assert high - low >= 2, "the plan's rank 0 needs two heads to cut one off"
    document["layout"]["head_ranges"][0] = [low, high - 1]
    _one_line_error(
        _write_json(tmp_path, document),
        rf"group 0 heads \[{high - 1}, {high}\) are owned by no rank",
    )


def test_malformed_layout_range_is_rejected(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    document["layout"]["token_ranges"][0] = [[0]]
    _one_line_error(_write_json(tmp_path, document), r"range \[0\] must be a pair")


# --- known library bugs (strict xfail: these start passing when the bug is fixed) ---------------


def test_corrupted_layout_error_names_the_plan_file(tmp_path, small_document):
    path = _write_json(tmp_path, _overlapping_tokens(small_document))
    _one_line_error(path, re.escape(f"plan file {path}: ") + r".*owned by both")


def test_plan_whose_train_seq_len_disagrees_with_layout_is_rejected(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    document["train"]["seq_len"] = 8192  # the layout still partitions [0, 4096)
    _one_line_error(_write_json(tmp_path, document), r"seq_len")


def test_plan_with_fewer_assignments_than_ranks_is_rejected(tmp_path, small_document):
    document = copy.deepcopy(small_document)
    document["assignments"] = document["assignments"][:2]  # the cluster has 4 ranks
    _one_line_error(_write_json(tmp_path, document), r"assignments")
