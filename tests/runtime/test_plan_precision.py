"""The runtime computes in the plan's precision (`plan_search(precision=...)`) unless `--dtype`
says otherwise, and records the plan as it ran: the dtype in the run's row and in its plan."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from distributed import free_port

from hexiseq import Cluster, ModelSpec
from hexiseq.runtime import train
from hexiseq.search import plan_search
from hexiseq.store import Store

ONE_CPU = {"name": "one-cpu", "nodes": [{"name": "n", "gpu": "cpu", "count": 1}]}


@pytest.fixture
def one_rank_world(monkeypatch):
    """torchrun's environment for a world of one rank (`train.init_rank` joins it)."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("precision", "dtype_flag", "ran", "ran_bytes"),
    [
        ("bf16", "auto", "bfloat16", 2),  # the plan's bf16, on a CPU
        ("auto", "auto", "float32", 4),  # an all-CPU cluster plans fp32
        ("bf16", "float32", "float32", 4),  # --dtype overrides, and the record says so
    ],
)
def test_the_run_computes_in_the_plans_precision(
    tmp_path, one_rank_world, precision, dtype_flag, ran, ran_bytes
):
    cluster = Cluster.from_dict(ONE_CPU)
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 64, precision=precision).best
    plan.to_json(tmp_path / "plan.json")
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    options = train.parse_args(["--plan", str(tmp_path / "plan.json"), "--steps", "1",
                                "--store", url, "--dtype", dtype_flag])  # fmt: skip
    assert train.train(plan, options, train.init_rank(plan, options)) == 0
    with Store.open(url) as store:
        (run,) = store.list_runtime_runs()
        ((_, run_plan_json, _),) = store.runtime_peaks()
    assert (run["dtype"], run["status"]) == (ran, "finished")
    assert json.loads(run_plan_json)["train"]["compute_dtype_bytes"] == ran_bytes
