"""`hexiseq fit`, the fitted_models table, `plan --cost-model` and plan_search labels."""

from __future__ import annotations

import re

import numpy as np
import pytest
from cli_runner import run_main
from fit_cases import TrueDevice, compute_rows, link_rows

from hexiseq import Cluster
from hexiseq.costmodel import DATASHEET_LABEL, FittedCostModel, fit_cost_model
from hexiseq.search import plan_search
from hexiseq.store import Store

PLAN_ARGS = ["plan", "--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", "8k"]


def assert_one_line_error(result: tuple[int, str, str], pattern: str) -> None:
    code, stdout, stderr = result
    assert code == 2
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert re.search(pattern, stderr), stderr


def write_profiles(url: str, rows) -> int:
    with Store.open(url) as store:
        run_id = store.save_profile_run(
            kind="compute", device_type="cpu", device_name="synthetic", torch_version="none",
            cuda_version=None, host="test", command="synthetic", grid_name="synthetic",
            quick=True,
        )  # fmt: skip
        for row in rows:
            store.add_profile_measurement(run_id, row)
    return run_id


@pytest.fixture
def profiled_store(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'profiles.db'}"
    rng = np.random.default_rng(0)
    write_profiles(
        url, compute_rows(TrueDevice("cpu"), rng) + link_rows("intra:cpu", 5e-5, 2, rng)
    )
    return url


def test_an_empty_store_has_no_fitted_model_and_fit_says_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    with Store.open(url) as store:
        assert store.latest_fitted_model() is None
        assert store.profile_measurements_by_run() == []
    assert_one_line_error(run_main(["fit", "--store", url]), r"holds no profile measurements")


def test_failed_points_only_is_nothing_to_fit(tmp_path):
    url = f"sqlite:///{tmp_path / 'failed.db'}"
    rows = [r for r in compute_rows(TrueDevice("cpu"), np.random.default_rng(1)) if r.op == "gemm"]
    write_profiles(url, rows[:3])
    assert_one_line_error(run_main(["fit", "--store", url]), r"nothing to fit \(3 ok .*at least")


def test_fit_saves_a_model_and_prints_the_held_out_table(profiled_store):
    code, stdout, _ = run_main(["fit", "--store", profiled_store])
    assert code == 0
    assert "extrap. MAPE" in stdout and "LODO MAPE" in stdout
    assert re.search(r"cpu\s+gemm\s+float32\s+1x\s+16\s+11/5", stdout)
    assert "n/a (one type profiled)" in stdout and "intra:cpu" in stdout
    with Store.open(profiled_store) as store:
        model = FittedCostModel.from_json(store.latest_fitted_model())
    assert model.covered_types == ("cpu",)
    assert re.fullmatch(r"fitted \(profile run 1, \d{4}-\d\d-\d\d\)", model.label("cpu"))
    assert [s.run_id for s in model.document.sources] == [1]


def test_plan_uses_the_fitted_model_and_says_so_per_type(profiled_store):
    assert run_main(["fit", "--store", profiled_store])[0] == 0
    code, stdout, _ = run_main([*PLAN_ARGS, "--store", profiled_store])
    assert code == 0
    assert re.search(r"cost model per device type: cpu: fitted \(profile run 1, ", stdout)
    code, datasheet_out, _ = run_main([*PLAN_ARGS, "--store", profiled_store, "--cost-model",
                                       "datasheet"])  # fmt: skip
    assert code == 0 and "cost model per device type" not in datasheet_out
    assert "measured CPU peak" in datasheet_out and "fitted (" not in datasheet_out


def test_plan_with_an_empty_store_is_the_datasheet_plan(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    auto = run_main([*PLAN_ARGS, "--store", url])
    datasheet = run_main([*PLAN_ARGS, "--no-store", "--cost-model", "datasheet"])
    assert auto[0] == datasheet[0] == 0
    assert auto[1].split("\nsaved to")[0] == datasheet[1].rstrip("\n")


def test_plan_cost_model_fitted_without_a_fitted_model_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    argv = [*PLAN_ARGS, "--store", url, "--cost-model", "fitted", "--no-store"]
    assert_one_line_error(run_main(argv), r"empty.db: no such SQLite file")
    assert not (tmp_path / "empty.db").exists()  # reading made no empty store
    Store.open(url).close()
    assert_one_line_error(run_main(argv), r"holds no fitted model; run `hexiseq fit --store")


def test_a_corrupt_stored_model_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'corrupt.db'}"
    with Store.open(url) as store:
        store.save_fitted_model('{"format": "hexiseq.fitted_cost_model", "ops": 3}')
    assert_one_line_error(
        run_main([*PLAN_ARGS, "--store", url]), r"latest fitted model: .*required field"
    )


def test_plan_search_labels_each_type_by_the_model_it_used():
    rng = np.random.default_rng(2)
    h100 = TrueDevice(
        "H100-SXM",
        gemm=(1 / 7e14, 1 / 3e12, 1e-5),
        attention_fwd=(1 / 5e14, 0.0, 1e-13, 1 / 3e12, 2e-5),
        attention_bwd=(1 / 4e14, 0.0, 2e-13, 1 / 3e12, 3e-5),
        elementwise=(1 / 3e12, 5e-6),
    )
    model = FittedCostModel(fit_cost_model(compute_rows(h100, rng, dtype="bfloat16")))
    cluster = Cluster.from_dict(
        {
            "name": "h100x2-a100x2",
            "nodes": [
                {"name": "h", "gpu": "H100-SXM", "count": 2},
                {"name": "a", "gpu": "A100-80G", "count": 2},
            ],
            "network": {"inter_node_GBps": 50},
        }
    )
    result = plan_search(cluster, "llama3.2-3b", "32k", cost_model=model)
    labels = result.best.predicted.cost_model
    assert labels["A100-80G"] == DATASHEET_LABEL
    assert labels["H100-SXM"].startswith("fitted (profiles fitted ")
    assert "H100-SXM: fitted" in result.best.cost_model_summary
