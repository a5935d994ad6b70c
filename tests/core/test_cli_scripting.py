"""`hexiseq` in scripts and pipelines (issue 14): --version, --json, `plans list|show|export`,
`--out -`, a closed pipe, the exit codes, --study-name, the torch hint, the progress bar."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import optuna
import pytest
from cli_runner import CliRun, run_main

from hexiseq import Plan
from hexiseq.cli import main
from hexiseq.search import plan_search
from hexiseq.store import Store

PROBLEM = ["--cluster", "h100x8-a100x8", "--model", "llama-30b", "--seq-len", "128k"]
TINY = ["--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", "4k"]


def console_command() -> list[str]:
    """The installed `hexiseq` script next to this Python, else `python -m hexiseq.cli`."""
    script = Path(sys.executable).with_name("hexiseq")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hexiseq.cli"]


def assert_one_line(run: CliRun, pattern: str, code: int = 2) -> None:
    assert run.code == code, run
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert re.search(pattern, run.stderr), run.stderr
    assert run.stdout == ""


@dataclass
class Planned:
    run: CliRun
    document: dict
    store_url: str


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Planned:
    """`hexiseq plan --json` once for the module, saving to a fresh store."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('scripting') / 'plans.db'}"
    run = run_main(["plan", *PROBLEM, "--store", store_url, "--json"])
    assert run.code == 0, run.stderr
    return Planned(run, json.loads(run.stdout), store_url)


@pytest.fixture(scope="module")
def api_result():
    """The same search through the Python API (deterministic: the same plan)."""
    return plan_search("h100x8-a100x8", "llama-30b", "128k")


# --- --version and the exit codes ---------------------------------------------------------------


def test_version_comes_from_the_package_metadata():
    run = run_main(["--version"])
    assert run.code == 0
    assert run.stdout == f"hexiseq {version('hexiseq')}\n"


def test_help_documents_the_exit_codes():
    run = run_main(["--help"])
    assert run.code == 0
    codes = run.stdout.split("exit codes:", 1)[1]
    for line in ("0    done", "1    internal error", "2    bad input", "3    no plan fits"):
        assert line in codes
    assert re.search(r"141\s+stdout was closed early", codes)


def test_no_plan_fits_is_exit_3_and_prints_no_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--cluster", "h100x8", "--model", "llama3-70b", "--seq-len", "1M"]
    assert_one_line(run_main([*argv, "--no-store", "--json"]), r"no plan for .* fits", code=3)


# --- plan --json ---------------------------------------------------------------------------------


def test_plan_json_is_one_document_on_stdout_and_nothing_else(planned):
    assert planned.run.stderr == ""
    assert planned.run.stdout.strip().startswith("{")
    assert "plan vs baselines" not in planned.run.stdout  # no human table


def test_plan_json_matches_the_python_api(planned, api_result):
    document, best = planned.document, api_result.best
    assert (document["cluster"], document["model"], document["seq_len"]) == (
        "h100x8-a100x8",
        "llama-30b",
        131072,
    )
    assert document["best"]["tokens_per_s"] == best.predicted.tokens_per_s
    assert document["best"]["step_time_s"] == best.predicted.step_time_s
    assert document["best"]["cost_model"] == best.predicted.cost_model
    assert set(document["baselines"]) == set(api_result.baselines)
    for name, baseline in document["baselines"].items():
        expected = api_result.speedup_over(name)
        assert baseline["feasible"] is (expected is not None), name
        assert baseline.get("speedup") == expected, name
    assert document["speedup_over_strongest"] == api_result.speedup_over_strongest()
    assert document["strongest_baseline"] == api_result.strongest_baseline.name
    replicas = document["data_parallel"]
    assert replicas["tokens_per_s"] == api_result.data_parallel.tokens_per_s
    assert replicas["speedup"] == api_result.speedup_over_data_parallel()
    infeasible = document["baselines"]["ulysses-only"]
    assert infeasible["feasible"] is False and "heads" in infeasible["reason"]


def test_plan_json_has_one_row_per_device(planned, api_result):
    ranks = planned.document["best"]["ranks"]
    assert [row["rank"] for row in ranks] == list(range(16))
    for row, assignment, predicted in zip(
        ranks, api_result.best.assignments, api_result.best.predicted.ranks
    ):
        assert (row["gpu"], row["node"], row["tokens"]) == (
            assignment.gpu,
            assignment.node,
            assignment.tokens,
        )
        assert tuple(row["head_range"]) == assignment.head_range
        assert row["memory_bytes"] == predicted.memory_bytes
        assert row["step_s"] == pytest.approx(predicted.step_s)
        assert row["step_s"] == pytest.approx(sum(row["time_s"].values()))


def test_plan_json_names_the_stored_plan(planned):
    document = planned.document
    assert document["store"] == planned.store_url
    with Store.open(planned.store_url) as store:
        best = next(r for r in store.list_plans() if r.label == "best")
        stored = Plan.from_json_text(store.get_plan_json(document["plan_id"]))
    assert document["plan_id"] == best.id
    assert stored.predicted.tokens_per_s == document["best"]["tokens_per_s"]


def test_out_dash_writes_the_plan_json_to_stdout_and_the_table_to_stderr(tmp_path):
    run = run_main(["plan", *TINY, "--no-store", "--out", "-"])
    assert run.code == 0, run.stderr
    plan = Plan.from_json_text(run.stdout)  # stdout is the plan file, nothing else
    assert plan.cluster.name == "cpu-emulated-2type" and plan.train.seq_len == 4096
    assert "plan vs baselines" in run.stderr and "plan JSON written to stdout" in run.stderr


def test_out_dash_and_json_both_want_stdout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = run_main(["plan", *TINY, "--out", "-", "--json"])
    assert_one_line(run, r"--out - and --json both write to stdout")
    assert not (tmp_path / "hexiseq.db").exists()


# --- plans list|show|export ----------------------------------------------------------------------


def test_plans_list_json_matches_the_store(planned):
    run = run_main(["plans", "list", "--json", "--store", planned.store_url])
    assert run.code == 0 and run.stderr == ""
    listed = json.loads(run.stdout)["plans"]
    with Store.open(planned.store_url) as store:
        records = store.list_plans()
    assert [p["id"] for p in listed] == [r.id for r in records]
    assert [p["label"] for p in listed] == [r.label for r in records]
    assert [p["tokens_per_s"] for p in listed] == [r.tokens_per_s for r in records]
    assert "best" in {p["label"] for p in listed}


def test_plans_list_limit_and_table(planned):
    run = run_main(["plans", "list", "--limit", "2", "--store", planned.store_url])
    assert run.code == 0
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["id", "saved", "(UTC)"]
    assert len(lines) == 2 + 2  # header, dashes, two plans
    limited = json.loads(run_main(["plans", "list", "--limit", "1", "--json",
                                   "--store", planned.store_url]).stdout)  # fmt: skip
    assert len(limited["plans"]) == 1


def test_plans_show_json_and_text(planned):
    plan_id = planned.document["plan_id"]
    run = run_main(["plans", "show", str(plan_id), "--json", "--store", planned.store_url])
    assert run.code == 0, run.stderr
    shown = json.loads(run.stdout)
    assert (shown["id"], shown["label"]) == (plan_id, "best")
    assert shown["plan"] == planned.document["best"]
    text = run_main(["plans", "show", str(plan_id), "--store", planned.store_url])
    assert text.stdout.startswith(f"plan {plan_id} (best), saved ")
    assert "H100-SXM" in text.stdout and "A100-80G" in text.stdout


def test_plans_export_writes_a_plan_file_that_run_and_predict_read(planned, tmp_path):
    plan_id = planned.document["plan_id"]
    out = tmp_path / "exported.json"
    run = run_main(["plans", "export", str(plan_id), "--out", str(out),
                    "--store", planned.store_url])  # fmt: skip
    assert run.code == 0, run.stderr
    with Store.open(planned.store_url) as store:
        stored = Plan.from_json_text(store.get_plan_json(plan_id))
    assert Plan.from_json(out) == stored
    assert not list(tmp_path.glob(".exported.json.*"))  # the atomic write's temporary is gone
    to_stdout = run_main(["plans", "export", str(plan_id), "--store", planned.store_url])
    assert Plan.from_json_text(to_stdout.stdout) == stored
    predicted = run_main(["predict", "--plan", str(out), "--cost-model", "datasheet", "--json"])
    assert json.loads(predicted.stdout)["old"] == stored.predicted.to_dict()


def test_plans_unknown_id_and_missing_store_are_one_line(planned, tmp_path):
    store = ["--store", planned.store_url]
    assert_one_line(run_main(["plans", "show", "999", *store]), r"has no plan with id 999 \(ids")
    assert_one_line(run_main(["plans", "export", "999", *store]), r"has no plan with id 999")
    assert_one_line(run_main(["plans", "show", "x", *store]), r"'x' is not a plan id")
    missing = tmp_path / "none.db"
    run = run_main(["plans", "list", "--store", f"sqlite:///{missing}"])
    assert_one_line(run, r"store sqlite:///.*none\.db: no such SQLite file")
    assert not missing.exists()  # reading created no empty store


# --- a closed pipe -------------------------------------------------------------------------------


def test_a_pipe_closed_early_ends_quietly_with_141(tmp_path):
    """The reader goes away before the command writes: no traceback, exit 141."""
    command = [*console_command(), "plan", *TINY, "--no-store"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    ) as process:
        process.stdout.close()  # like `| head` that has already exited
        stderr = process.stderr.read().decode()
        code = process.wait(timeout=60)
    assert code == 141, stderr
    assert stderr == ""


def test_piping_into_head_prints_the_first_line_without_a_traceback(tmp_path):
    script = " ".join(console_command())
    done = subprocess.run(
        f"{script} plan {' '.join(PROBLEM)} --no-store --pareto --trials 10 | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.stdout.startswith("hexiseq: llama-30b on h100x8-a100x8")
    assert done.stdout.count("\n") == 1
    assert done.stderr == ""


# --- --study-name --------------------------------------------------------------------------------


def test_study_name_names_the_stored_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    argv = ["plan", *TINY, "--no-store", "--storage", storage, "--trials", "3", "--json"]
    run = run_main([*argv, "--study-name", "nightly"])
    assert run.code == 0, run.stderr
    assert json.loads(run.stdout)["search"]["study_name"] == "nightly"
    assert optuna.get_all_study_names(storage) == ["nightly"]
    other = run_main([*argv, "--study-name", "nightly", "--pareto"])
    assert_one_line(other, r"study 'nightly' was made to search throughput only.*--study-name")


def test_study_name_needs_storage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = run_main(["plan", *TINY, "--no-store", "--study-name", "x"])
    assert_one_line(run, r"--study-name names a study kept in --storage")


# --- without torch -------------------------------------------------------------------------------

NO_TORCH = (
    "import sys; sys.modules['torch'] = None; from hexiseq.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["run", "--plan", "plan.json", "--no-store"], "hexiseq run"),
        (["profile", "--device", "cpu", "--quick"], "hexiseq profile"),
        (["profile", "links", "--nproc", "2"], "hexiseq profile"),
    ],
    ids=["run", "profile", "profile-links"],
)
def test_without_torch_run_and_profile_say_what_to_install(tmp_path, argv, command):
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"hexiseq: error: {command} needs torch, which is not installed: pip install "
        "'hexiseq[runtime]' (in a checkout: pip install -e '.[runtime]')\n"
    )
    assert not (tmp_path / "hexiseq.db").exists()


def test_the_named_extra_brings_torch():
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("torch") for requirement in extras["runtime"])


# --- the progress bar ----------------------------------------------------------------------------


class _Terminal(io.StringIO):
    """A captured stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_workers_show_a_progress_bar_on_a_terminal_only(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    argv = ["plan", *TINY, "--no-store", "--storage", storage, "--trials", "12", "--json"]
    out, err = io.StringIO(), _Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--workers", "2"])
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["plan_id"] is None  # stdout stays one JSON document
    # the trials sampled after the short list, all of them, as Optuna's own bar counts them
    assert re.search(r"search: 100%.*\| (\d+)/\1 ", err.getvalue()), err.getvalue()
    piped = run_main([*argv, "--workers", "2", "--study-name", "piped"])  # stderr not a tty
    assert piped.code == 0 and piped.stderr == ""


# --- fit --json and profile --json --------------------------------------------------------------


def test_fit_json_holds_the_held_out_errors_of_the_saved_fit(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "costmodel"))
    import numpy as np
    from fit_cases import TrueDevice, compute_rows

    from hexiseq.costmodel import FittedCostModel

    url = f"sqlite:///{tmp_path / 'profiles.db'}"
    with Store.open(url) as store:
        run_id = store.save_profile_run(
            kind="compute", device_type="cpu", device_name="synthetic", torch_version="none",
            cuda_version=None, host="test", command="synthetic", grid_name="synthetic",
            quick=True,
        )  # fmt: skip
        for row in compute_rows(TrueDevice("cpu"), np.random.default_rng(0)):
            store.add_profile_measurement(run_id, row)
    run = run_main(["fit", "--store", url, "--json"])
    assert run.code == 0, run.stderr
    assert run.stderr == ""
    document = json.loads(run.stdout)
    with Store.open(url) as store:
        fitted = FittedCostModel.from_json(store.latest_fitted_model())
    assert document["covered_types"] == list(fitted.covered_types) == ["cpu"]
    assert len(document["ops"]) == len(fitted.document.ops) > 0
    for shown, fit in zip(document["ops"], fitted.document.ops):
        assert (shown["op"], shown["dtype"]) == (fit.op, fit.dtype)
        held = shown["heldout"]
        assert held["extrapolation_mape"] == fit.heldout.extrapolation_mape
        assert held["goal_met"] == fit.heldout.goal_met


GRID = """\
name: tiny
timing: {warmup_s: 0.0, samples: 10, input_sets: 2}
dtypes: {cpu: [float32]}
gemm: {ladder: [16, 32]}
attention: {q_lens: [16], kv_lens: [32], heads: [2], head_dims: [16], causal: [false, true]}
elementwise: {numels: [1024]}
links: {min_bytes: 1024, max_bytes: 2048}
"""
GRID_POINTS = 7


def test_profile_json_says_what_was_measured_and_skipped(tmp_path):
    pytest.importorskip("torch")
    grid = tmp_path / "tiny.yaml"
    grid.write_text(GRID, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'p.db'}"
    argv = ["profile", "--device", "cpu", "--grid", str(grid), "--store", url, "--json"]
    first = run_main(argv)
    assert first.code == 0, first.stderr
    document = json.loads(first.stdout)
    assert document["measured"] == {"ok": GRID_POINTS}
    assert document["skipped"] == {"already_stored": 0, "over_limit": 0}
    with Store.open(url) as store:
        assert len(store.profile_measurements()) == GRID_POINTS
    again = json.loads(run_main(argv).stdout)
    assert again["measured_total"] == 0 and again["run_id"] is None
    assert again["skipped"]["already_stored"] == GRID_POINTS


def test_profile_links_json_reads_the_sweep_back_from_the_store(tmp_path, monkeypatch):
    """torchrun replaced by a stand-in that stores two points as rank 0 would, and prints
    rank 0's human line: stdout must hold the JSON document alone."""
    pytest.importorskip("torch")
    from hexiseq.cli import profile as _cli_profile
    from hexiseq.profiles import ProfileMeasurement

    grid = tmp_path / "tiny.yaml"
    grid.write_text(GRID, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'p.db'}"

    def fake_torchrun(command, env, check, stdout):
        with Store.open(url) as store:
            run_id = store.save_profile_run(
                kind="links", device_type="cpu", device_name="x", torch_version="none",
                cuda_version=None, host="h", command="c", grid_name="tiny", quick=False,
            )  # fmt: skip
            for status, size in (("ok", 1024), ("error", 2048)):
                store.add_profile_measurement(run_id, _link_row(ProfileMeasurement, status, size))
        print("links intra:cpu: 2 points measured", file=stdout)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(_cli_profile.subprocess, "run", fake_torchrun)
    run = run_main(["profile", "links", "--nproc", "2", "--grid", str(grid), "--store", url,
                    "--json"])  # fmt: skip
    assert run.code == 0, run.stderr
    assert "2 points measured" in run.stderr  # rank 0's line went to stderr
    document = json.loads(run.stdout)
    assert document["measured"] == {"error": 1, "ok": 1}
    assert document["link_classes"] == ["intra:cpu"]
    assert document["skipped"]["already_stored"] == 10 - 2  # 10 points in the tiny grid


def _link_row(measurement_type, status: str, size: int):
    ok = status == "ok"
    return measurement_type(
        device_type="cpu",
        op="p2p",
        params={"message_bytes": size, "direction": "next"},
        dtype="float32",
        flops=0.0,
        bytes_moved=float(size),
        status=status,
        median_s=1e-5 if ok else None,
        p10_s=1e-5 if ok else None,
        p90_s=1e-5 if ok else None,
        samples=10 if ok else 0,
        device_name="x",
        torch_version="none",
        link_class="intra:cpu",
        error=None if ok else "boom",
    )


# --- the console script -----------------------------------------------------------------------

CONSOLE = (
    "import gc, sys; from hexiseq.cli import console; sys.argv[0] = 'hexiseq'; code = console(); "
    "print('frozen', gc.get_freeze_count() > 0, file=sys.stderr); sys.exit(code)"
)


def test_the_console_script_plans_then_freezes_the_heap_for_a_quick_exit(tmp_path):
    """`console` (the `hexiseq` script) runs the command in full, then leaves the exit's
    collection nothing to walk; `python -m hexiseq.cli` goes the same way."""
    out = tmp_path / "plan.json"
    argv = ["plan", *TINY, "--no-store", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE, *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "frozen True" in done.stderr
    assert Plan.from_json_text(out.read_text()).predicted.tokens_per_s > 0
    module = subprocess.run(
        [sys.executable, "-m", "hexiseq.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert module.returncode == 0, module.stderr
    assert "tokens/s" in module.stdout
