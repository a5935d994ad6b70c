"""`hexiseq predict --plan`: old and new prediction side by side, --json, one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_runner import CliRun, run_main

from hexiseq import Plan
from hexiseq.costmodel import DATASHEET_LABEL
from hexiseq.store import Store

V1_PLAN = str(Path(__file__).parents[1] / "core" / "data" / "plan_v1_llama3.2-3b_8k.json")
H100_FIT = Path(__file__).parent / "data" / "h100_fitted_model.json"
PASSWORD = "s3cr3t-pw"


@pytest.fixture(autouse=True)
def no_store_in_environment(monkeypatch):
    monkeypatch.delenv("HEXISEQ_STORE_URL", raising=False)


@pytest.fixture
def fitted_store(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'fitted.db'}"
    with Store.open(url) as store:
        store.save_fitted_model(H100_FIT.read_text(encoding="utf-8"))
    return url


def assert_one_line_error(run: CliRun, pattern: str) -> None:
    assert run.code == 2
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert re.search(pattern, run.stderr), run.stderr


def test_text_shows_old_and_new_per_rank_and_the_cost_model(fitted_store):
    run = run_main(["predict", "--plan", V1_PLAN, "--store", fitted_store])
    assert run.code == 0 and run.stderr == ""
    old = Plan.from_json(V1_PLAN).predicted
    assert f"step time   {old.step_time_s:.4g} s -> " in run.stdout
    assert re.search(r"tokens/s    18,412 -> [\d,]+  \(new/old \d\.\d{3}\)", run.stdout)
    assert re.search(
        r"H100-SXM: datasheet estimate -> .*memory calibrated by measured", run.stdout
    )
    time_rows = re.findall(
        r"^(?:0\s+H100-SXM\s+n0|\s+)\s+(old|new)\s+([\d. ]+)$", run.stdout, re.M
    )
    assert [label for label, _ in time_rows] == ["old", "new"]
    old_ms = [float(cell) for cell in time_rows[0][1].split()]
    assert old_ms[0] == pytest.approx(1e3 * old.ranks[0].linear_s, abs=0.005)
    assert old_ms[-1] == pytest.approx(1e3 * old.step_time_s, abs=0.005)
    memory_row = re.search(
        r"^\s+0\s+H100-SXM\s+58\.53\s+([\d.]+)\s+[\d.]+\s+80\.00\s+73\.2 %", run.stdout, re.M
    )
    assert memory_row, run.stdout


def test_fitted_uses_the_stores_fit_for_every_op(fitted_store):
    run = run_main(
        ["predict", "--plan", V1_PLAN, "--store", fitted_store, "--cost-model", "fitted"]
    )
    assert run.code == 0, run.stderr
    assert re.search(r"H100-SXM: datasheet estimate -> fitted \(profile runs 1, 2, 3", run.stdout)


def test_datasheet_of_a_datasheet_plan_is_unchanged():
    run = run_main(["predict", "--plan", V1_PLAN, "--cost-model", "datasheet"])
    assert run.code == 0
    assert f"H100-SXM: {DATASHEET_LABEL} (unchanged)" in run.stdout
    assert "(store " not in run.stdout


def test_json_holds_the_new_and_the_old_prediction(fitted_store):
    run = run_main(["predict", "--plan", V1_PLAN, "--store", fitted_store, "--json"])
    assert run.code == 0 and run.stderr == ""
    document = json.loads(run.stdout)
    assert document["old"] == Plan.from_json(V1_PLAN).predicted.to_dict()
    assert "memory calibrated by measured peaks" in document["new"]["cost_model"]["H100-SXM"]
    new_memory = document["new"]["ranks"][0]["memory_bytes"]
    assert new_memory != document["old"]["ranks"][0]["memory_bytes"]
    assert document["store"] == fitted_store and document["cost_model_choice"] == "auto"
    assert {"memory_bytes", "memory_capacity_bytes", "memory_terms", "linear_s"} <= set(
        document["new"]["ranks"][0]
    )


def test_the_environment_names_the_store(fitted_store, monkeypatch):
    monkeypatch.setenv("HEXISEQ_STORE_URL", fitted_store)
    run = run_main(["predict", "--plan", V1_PLAN, "--json"])
    assert "memory calibrated" in json.loads(run.stdout)["new"]["cost_model"]["H100-SXM"]


def test_bad_json_is_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json", encoding="utf-8")
    assert_one_line_error(run_main(["predict", "--plan", str(path)]), r"not valid JSON")


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--cost-model", "measured"], r"--cost-model: invalid choice: 'measured'"),
        (["--cost-model", "fitted"], r"fitted needs a store"),
        (["--store", "sqlite:///no/such/dir/x.db"], r"no such SQLite file"),
    ],
)
def test_bad_options_are_one_line(extra, pattern):
    assert_one_line_error(run_main(["predict", "--plan", V1_PLAN, *extra]), pattern)


def test_a_missing_plan_file_is_one_line(tmp_path):
    missing = str(tmp_path / "none.json")
    assert_one_line_error(run_main(["predict", "--plan", missing]), r"cannot be read")


def test_fitted_with_no_fit_in_the_store_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Store.open(url).close()
    run = run_main(["predict", "--plan", V1_PLAN, "--store", url, "--cost-model", "fitted"])
    assert_one_line_error(run, r"holds no fitted model")


@pytest.mark.parametrize("where", ["--store", "environment"])
def test_a_store_password_is_never_printed(where, monkeypatch):
    url = f"postgresql://hexiseq:{PASSWORD}@127.0.0.1:1/hexiseq"
    argv = ["predict", "--plan", V1_PLAN]
    if where == "--store":
        argv += ["--store", url]
    else:
        monkeypatch.setenv("HEXISEQ_STORE_URL", url)
    run = run_main(argv)
    assert run.code == 2
    assert PASSWORD not in run.stdout + run.stderr
    assert "hexiseq:***@127.0.0.1" in run.stderr
