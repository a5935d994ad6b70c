"""hexiseq.predict: a searched plan predicted again gives its stored prediction; the cost model
comes from the store as `hexiseq plan` takes it; plans of earlier versions still predict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hexiseq
from hexiseq import Cluster, InputError, Plan
from hexiseq.costmodel import DATASHEET_LABEL, FittedCostModel
from hexiseq.plan import Prediction
from hexiseq.search import plan_search
from hexiseq.store import Store

DATA = Path(__file__).parent / "data"
# Run 3 of the shared one-H100 store (llama3.2-3b, 8K tokens, checkpointing on): the plan JSON
# `hexiseq run` recorded, written by hexiseq 490c15d (plan schema_version 1).
V1_PLAN = Path(__file__).parents[1] / "core" / "data" / "plan_v1_llama3.2-3b_8k.json"
# `hexiseq fit` of that store: 358 bf16 H100-SXM profile points, memory calibrated by its runs.
H100_FIT = DATA / "h100_fitted_model.json"


@pytest.fixture(scope="module")
def h100_fit() -> FittedCostModel:
    return FittedCostModel.from_json(H100_FIT.read_text(encoding="utf-8"))


@pytest.fixture
def fitted_store(tmp_path, h100_fit) -> str:
    url = f"sqlite:///{tmp_path / 'fitted.db'}"
    with Store.open(url) as store:
        store.save_fitted_model(h100_fit.to_json())
    return url


@pytest.fixture(scope="module")
def mixed_cluster() -> Cluster:
    return Cluster.from_dict(
        {
            "name": "h100x2-a100x2",
            "nodes": [
                {"name": "h", "gpu": "H100-SXM", "count": 2},
                {"name": "a", "gpu": "A100-80G", "count": 2},
            ],
            "network": {"inter_node_GBps": 50},
        }
    )


@pytest.fixture(scope="module")
def fitted_plan(mixed_cluster, h100_fit) -> Plan:
    return plan_search(mixed_cluster, "llama3.2-3b", "32k", cost_model=h100_fit).best


@pytest.fixture(scope="module")
def datasheet_plan() -> Plan:
    return plan_search("cpu-emulated-2type", "tiny", "8k").best


def test_predict_is_public_and_lazy():
    assert hexiseq.predict.__module__ == "hexiseq.search.predict"
    assert "predict" in hexiseq.__all__


def test_a_searched_plan_predicts_its_stored_prediction_exactly(datasheet_plan):
    again = hexiseq.predict(datasheet_plan, cost_model="datasheet")
    assert isinstance(again, Prediction)
    assert again == datasheet_plan.predicted


def test_uneven_state_fractions_are_predicted_as_planned(datasheet_plan):
    """The plan's per-rank state shares are simulated, not the even default."""
    fractions = [0.7] + [0.3 / (len(datasheet_plan.assignments) - 1)] * (
        len(datasheet_plan.assignments) - 1
    )
    document = datasheet_plan.to_dict()
    for assignment, fraction in zip(document["assignments"], fractions):
        assignment["state_fraction"] = fraction
    uneven = Plan.from_dict(document)
    memory = [r.memory_bytes for r in hexiseq.predict(uneven, cost_model="datasheet").ranks]
    even = [r.memory_bytes for r in datasheet_plan.predicted.ranks]
    assert memory[0] > even[0] and memory[1] < even[1]


def test_a_plan_searched_with_a_fit_predicts_the_same_from_the_store(fitted_plan, fitted_store):
    assert hexiseq.predict(fitted_plan, store=fitted_store) == fitted_plan.predicted
    with Store.open(fitted_store) as store:  # a Store object, left open for the caller
        assert hexiseq.predict(fitted_plan, store=store) == fitted_plan.predicted
        assert store.latest_fitted_model() is not None


def test_auto_is_the_stores_newest_fit_where_it_has_one_and_datasheet_elsewhere(
    fitted_plan, fitted_store, h100_fit
):
    auto = hexiseq.predict(fitted_plan, store=fitted_store, cost_model="auto")
    assert auto == hexiseq.predict(fitted_plan, cost_model=h100_fit)
    # The fit calibrates H100 memory by the measured peaks (whichever op fits auto then uses).
    assert "memory calibrated by measured peaks" in auto.cost_model["H100-SXM"]
    assert auto.cost_model["A100-80G"] == DATASHEET_LABEL
    datasheet = hexiseq.predict(fitted_plan, store=fitted_store, cost_model="datasheet")
    assert set(datasheet.cost_model.values()) == {DATASHEET_LABEL}
    h100 = [r for r, a in enumerate(fitted_plan.assignments) if a.gpu == "H100-SXM"]
    assert all(auto.ranks[r].memory_bytes != datasheet.ranks[r].memory_bytes for r in h100)


def test_no_store_means_the_datasheet_and_the_environment_names_one(
    fitted_plan, fitted_store, monkeypatch
):
    monkeypatch.delenv("HEXISEQ_STORE_URL", raising=False)
    assert set(hexiseq.predict(fitted_plan).cost_model.values()) == {DATASHEET_LABEL}
    monkeypatch.setenv("HEXISEQ_STORE_URL", fitted_store)
    assert hexiseq.predict(fitted_plan) == fitted_plan.predicted


def test_fitted_requires_a_fit_for_every_gpu_type(fitted_plan, fitted_store, tmp_path):
    with pytest.raises(InputError, match=r"covers H100-SXM, not A100-80G"):
        hexiseq.predict(fitted_plan, store=fitted_store, cost_model="fitted")
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    Store.open(empty).close()
    with pytest.raises(InputError, match=r"holds no fitted model"):
        hexiseq.predict(fitted_plan, store=empty, cost_model="fitted")


def test_fitted_without_a_store_says_how_to_give_one(fitted_plan, monkeypatch):
    monkeypatch.delenv("HEXISEQ_STORE_URL", raising=False)
    with pytest.raises(InputError, match=r"needs a store .*HEXISEQ_STORE_URL"):
        hexiseq.predict(fitted_plan, cost_model="fitted")


def test_a_cost_model_object_is_used_as_given(fitted_plan, h100_fit):
    assert hexiseq.predict(fitted_plan, cost_model=h100_fit) == fitted_plan.predicted


@pytest.mark.parametrize(
    ("cost_model", "message"),
    [("measured", r"'measured' is not one of auto, datasheet, fitted"), (3, r"int is not a Cost")],
)
def test_a_bad_cost_model_is_input_error(datasheet_plan, cost_model, message):
    with pytest.raises(InputError, match=message):
        hexiseq.predict(datasheet_plan, cost_model=cost_model)


def test_a_missing_sqlite_store_is_not_created(datasheet_plan, tmp_path):
    missing = tmp_path / "typo.db"
    with pytest.raises(InputError, match=r"no such SQLite file"):
        hexiseq.predict(datasheet_plan, store=f"sqlite:///{missing}")
    assert not missing.exists()


def test_not_a_plan_is_input_error():
    with pytest.raises(InputError, match=r"expected a hexiseq Plan, got dict"):
        hexiseq.predict({"name": "plan"})


def test_a_version_1_plan_loads_and_predicts(fitted_store):
    document = json.loads(V1_PLAN.read_text(encoding="utf-8"))
    assert document["schema_version"] == 1
    plan = Plan.from_json(V1_PLAN)
    assert plan.model.name == "llama3.2-3b" and plan.train.seq_len == 8192
    datasheet = hexiseq.predict(plan, cost_model="datasheet")
    assert datasheet.cost_model == {"H100-SXM": DATASHEET_LABEL}
    assert datasheet.step_time_s > 0 and len(datasheet.ranks) == 1
    fitted = hexiseq.predict(plan, store=fitted_store, cost_model="fitted")
    assert fitted.cost_model["H100-SXM"].startswith("fitted (profile runs 1, 2, 3")
    assert fitted.step_time_s != datasheet.step_time_s
