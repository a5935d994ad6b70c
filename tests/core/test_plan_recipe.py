"""A run's plan names the recipe that ran it (`TrainSpec.runtime_recipe`); runs recorded
before it did are read with the recipe of their day."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hexiseq import Cluster, plan_search
from hexiseq.errors import InputError
from hexiseq.model import TrainSpec
from hexiseq.plan import Plan

OLD_PLAN = Path(__file__).parent / "data" / "plan_v1_llama3.2-3b_8k.json"


def test_an_old_one_rank_run_ran_the_autocast_recipe():
    text = OLD_PLAN.read_text()
    assert "runtime_recipe" not in json.loads(text)["train"]
    assert Plan.from_json_text(text).train.runtime_recipe == "sharded"  # a plan to run now
    assert Plan.from_run_json_text(text).train.runtime_recipe == "autocast"  # what ran then


def test_an_old_multi_rank_run_ran_sharded_and_a_recorded_recipe_is_kept():
    cluster = Cluster.from_dict({"name": "c", "nodes": [{"name": "n", "gpu": "cpu", "count": 2}]})
    plan = plan_search(cluster, "tiny", 256).best
    document = plan.to_dict()
    del document["train"]["runtime_recipe"]
    assert Plan.from_run_json_text(json.dumps(document)).train.runtime_recipe == "sharded"
    autocast = dataclasses.replace(plan.train, runtime_recipe="autocast")
    text = dataclasses.replace(plan, train=autocast).to_json_text()
    assert Plan.from_run_json_text(text).train.runtime_recipe == "autocast"


def test_an_unknown_recipe_is_refused():
    with pytest.raises(InputError, match="runtime_recipe must be one of sharded, autocast"):
        TrainSpec(seq_len=1024, runtime_recipe="fsdp3")
