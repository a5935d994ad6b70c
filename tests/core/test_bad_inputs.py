"""Issue 17's fuzz set (`benchmarks/bad_inputs.py`): every one of its 300-odd bad inputs, at
every entry point (CLI commands and options, the Python API, cluster, model, plan and grid
files, store and study URLs), gets one clear message and writes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "bad_inputs.py"


def _catalog():
    spec = importlib.util.spec_from_file_location("bad_inputs", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_bad_input_gets_one_clear_message_and_writes_nothing(tmp_path, monkeypatch):
    catalog = _catalog()
    monkeypatch.chdir(tmp_path)  # where a default store would go, were one written
    monkeypatch.delenv("HEXISEQ_STORE_URL", raising=False)
    plan_path, plan_document = catalog.good_plan(tmp_path)
    cases = catalog.cli_cases(tmp_path, plan_path, plan_document)
    cases += catalog.api_cases(tmp_path, plan_path)
    assert len(cases) >= 300
    judged = [(case, *catalog.judge(case, timeout_s=60)) for case in cases]
    unclear = [f"{o}: {c.entry} [{c.label}]: {d}" for c, o, d in judged if o != "clear"]
    assert not unclear, "\n".join(unclear)
    assert not (tmp_path / "hexiseq.db").exists()
