"""Tests of the `hexiseq` command line (hexiseq.cli): in process, and once through the console
script to check the entry point and its exit codes."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_runner import CliRun, run_main

from hexiseq import Plan
from hexiseq.store import Store

BASELINES = ("uniform-usp", "ring-only", "ulysses-only", "homogeneous-subset")
DEVICE_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(H100-SXM|A100-80G)\s+\d+\s")


def console_command() -> list[str]:
    """The installed `hexiseq` script next to this Python, else `python -m hexiseq.cli`."""
    script = Path(sys.executable).with_name("hexiseq")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hexiseq.cli"]


@dataclass
class PaperRun:
    run: CliRun
    out: Path
    store_url: str


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory) -> PaperRun:
    """`hexiseq plan` for 8 H100 + 8 A100, llama-30b, 256K tokens: run once per module."""
    folder = tmp_path_factory.mktemp("cli")
    out = folder / "best.json"
    store_url = f"sqlite:///{folder / 'x.db'}"
    run = run_main(
        [
            "plan",
            "--cluster",
            "h100x8-a100x8",
            "--model",
            "llama-30b",
            "--seq-len",
            "256k",
            "--out",
            str(out),
            "--store",
            store_url,
        ]
    )
    return PaperRun(run, out, store_url)


def _baseline_table(stdout: str) -> dict[str, str]:
    """Rows of the 'plan vs baselines' table: label -> tokens/s cell."""
    table = stdout.split("plan vs baselines", 1)[1].splitlines()
    rows: dict[str, str] = {}
    for line in table[3:]:  # title, header, dashes
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1]
    return rows


def _tokens_per_s(cell: str) -> float:
    return float(cell.replace(",", ""))


# --- the paper case -----------------------------------------------------------------------------


def test_plan_exits_zero_and_writes_nothing_to_stderr(paper_run):
    assert paper_run.run.code == 0, paper_run.run.stderr
    assert paper_run.run.stderr == ""


def test_plan_prints_one_row_per_device(paper_run):
    rows = [DEVICE_ROW.match(line) for line in paper_run.run.stdout.splitlines()]
    rows = [row for row in rows if row]
    assert [int(row[1]) for row in rows] == list(range(16))
    assert [row[3] for row in rows] == ["H100-SXM"] * 8 + ["A100-80G"] * 8
    assert {row[2] for row in rows} == {"h100-node", "a100-node"}


def test_plan_labels_the_cost_model_and_lists_baselines(paper_run):
    stdout = paper_run.run.stdout
    assert "datasheet estimate" in stdout
    assert "16 devices" in stdout and "256K tokens" in stdout
    table = _baseline_table(stdout)
    for name in BASELINES:
        assert any(label.startswith(name) for label in table), name
    # Ulysses cannot split 52 heads over 16 ranks: shown as infeasible, not dropped.
    ulysses = next(line for line in stdout.splitlines() if line.startswith("ulysses-only"))
    assert "infeasible" in ulysses


def test_printed_best_beats_every_feasible_baseline(paper_run):
    table = _baseline_table(paper_run.run.stdout)
    best_label, best_cell = next(iter(table.items()))
    assert best_label.startswith("hexiseq")
    best = _tokens_per_s(best_cell)
    feasible = {label: _tokens_per_s(cell) for label, cell in table.items() if cell != "-"}
    del feasible[best_label]
    assert len(feasible) >= 2  # uniform-usp and ring-only run on this cluster
    assert all(best > other for other in feasible.values()), (best, feasible)


def test_written_plan_loads_and_matches_the_printout(paper_run):
    plan = Plan.from_json(paper_run.out)
    assert plan.cluster.name == "h100x8-a100x8"
    assert plan.model.name == "llama-30b"
    assert plan.train.seq_len == 262144
    plan.layout().validate()
    best_cell = next(iter(_baseline_table(paper_run.run.stdout).values()))
    assert best_cell == f"{plan.predicted.tokens_per_s:,.1f}"
    assert f"plan written to {paper_run.out}" in paper_run.run.stdout


def test_done_when_every_rank_of_the_best_plan_is_within_95_percent_of_memory(paper_run):
    plan = Plan.from_json(paper_run.out)
    fractions = [rank.memory_fraction for rank in plan.predicted.ranks]
    assert len(fractions) == 16
    assert all(0 < fraction <= 0.95 for fraction in fractions), fractions


def test_store_holds_the_best_plan_and_feasible_baselines(paper_run):
    plan = Plan.from_json(paper_run.out)
    with Store.open(paper_run.store_url) as store:
        records = store.list_plans()
        assert sorted(r.label for r in records) == ["best", "ring-only", "uniform-usp"]
        best = next(r for r in records if r.label == "best")
        assert (best.cluster_name, best.model_name, best.seq_len) == (
            "h100x8-a100x8",
            "llama-30b",
            262144,
        )
        assert best.tokens_per_s == plan.predicted.tokens_per_s
        assert best.step_time_s == plan.predicted.step_time_s
        assert best.cost_model == "datasheet estimate"
        assert Plan.from_json_text(store.get_plan_json(best.id)) == plan
        others = [r.tokens_per_s for r in records if r.label != "best"]
        assert all(best.tokens_per_s > other for other in others)
    assert f"as plan {best.id} " in paper_run.run.stdout


# --- sequence-length forms ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_len", "tokens", "shown"),
    [("131072", 131072, "128K"), ("128k", 131072, "128K"), ("1M", 1048576, "1M")],
)
def test_seq_len_forms(tmp_path, seq_len, tokens, shown):
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", seq_len]
    run = run_main([*argv, "--out", str(out), "--no-store"])
    assert run.code == 0, run.stderr
    assert f"{shown} tokens" in run.stdout
    assert "saved to" not in run.stdout  # --no-store
    assert Plan.from_json(out).train.seq_len == tokens


def test_no_checkpointing_flag_reaches_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", "4k"]
    assert run_main([*argv, "--out", str(out), "--no-store", "--no-checkpointing"]).code == 0
    assert Plan.from_json(out).train.activation_checkpointing is False


# --- bad input ----------------------------------------------------------------------------------

GOOD = {"--cluster": "cpu-emulated-2type", "--model": "tiny", "--seq-len": "4k"}


def _argv(**changes: str | None) -> list[str]:
    options = dict(GOOD)
    for key, value in changes.items():
        options[f"--{key.replace('_', '-')}"] = value
    argv = ["plan", "--no-store"]
    for option, value in options.items():
        if value is not None:
            argv += [option, value]
    return argv


BAD_INPUTS = {
    "unknown-preset": ({"cluster": "h100x9"}, r"--cluster 'h100x9' is neither .*; presets: "),
    "bad-seq-len": ({"seq_len": "12q"}, r"--seq-len '12q' is not a length; allowed: "),
    "seq-len-too-small": ({"seq_len": "1"}, r"--seq-len must be at least 2 tokens"),
    "missing-cluster-file": ({"cluster": "{tmp}/none.yaml"}, r"cluster file .*none\.yaml: cannot"),
    "bad-yaml-file": ({"cluster": "{tmp}/bad.yaml"}, r"cluster file .*bad\.yaml: not valid YAML"),
    "invalid-cluster-file": (
        {"cluster": "{tmp}/wrong.yaml"},
        r"cluster file .*wrong\.yaml: nodes\[0\]\.gpu: unknown GPU 'X1'; allowed: ",
    ),
    "unknown-model": ({"model": "gpt5"}, r"model 'gpt5' is not a preset, a file, .*; presets: "),
    "missing-seq-len": ({"seq_len": None}, r"the following arguments are required: --seq-len"),
    "missing-cluster": ({"cluster": None}, r"the following arguments are required: --cluster"),
}


def _bad_files(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("name: c\nnodes: [\n", encoding="utf-8")
    (tmp_path / "wrong.yaml").write_text(
        "name: c\nnodes:\n  - {name: n0, gpu: X1, count: 1}\n", encoding="utf-8"
    )


def _assert_one_line_error(run: CliRun, pattern: str, code: int = 2) -> None:
    assert run.code == code
    assert run.stderr.endswith("\n") and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert re.search(pattern, run.stderr), run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize(("changes", "pattern"), list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, changes, pattern):
    monkeypatch.chdir(tmp_path)  # whatever happens, no hexiseq.db lands in the repository
    _bad_files(tmp_path)
    changes = {k: v.format(tmp=tmp_path) if v else v for k, v in changes.items()}
    run = run_main(_argv(**changes))
    _assert_one_line_error(run, pattern)
    assert run.stderr.startswith("hexiseq")


def test_no_plan_fits_exits_3_with_one_line(tmp_path, monkeypatch):
    """Its own exit code: not 2 (bad input), which a script would treat differently."""
    monkeypatch.chdir(tmp_path)
    run = run_main(_argv(cluster="h100x8", model="llama3-70b", seq_len="1M"))
    pattern = r"^hexiseq: error: no plan for llama3-70b .* fits on h100x8: .* GiB short"
    _assert_one_line_error(run, pattern, code=3)


def test_no_subcommand_and_unknown_option_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _assert_one_line_error(run_main([]), r"required: command")
    _assert_one_line_error(
        run_main([*_argv(), "--colour", "red"]), r"unrecognized arguments: --colour red"
    )


def test_unwritable_out_exits_2_before_the_search(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "no-such-dir" / "plan.json"
    run = run_main([*[a for a in _argv() if a != "--no-store"], "--out", str(out)])
    assert run.code == 2
    assert run.stderr == f"hexiseq: error: --out {out}: cannot write (No such file or directory)\n"
    assert run.stdout == ""  # nothing searched or printed
    assert not out.exists() and not (tmp_path / "hexiseq.db").exists()
    folder = run_main([*_argv(), "--out", str(tmp_path)])
    _assert_one_line_error(folder, r"--out .*: cannot write \(Is a directory\)")


def test_bad_store_url_exits_2(tmp_path):
    argv = [a for a in _argv() if a != "--no-store"]
    run = run_main([*argv, "--store", "bogus://x"])
    _assert_one_line_error(run, r"store URL 'bogus://x' uses unsupported dialect 'bogus'")


def test_bad_input_creates_no_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in _argv(cluster="h100x9") if a != "--no-store"]
    assert run_main(argv).code == 2
    assert not (tmp_path / "hexiseq.db").exists()


# --- the console script -------------------------------------------------------------------------


def test_console_script_runs_a_plan(tmp_path):
    out = tmp_path / "plan.json"
    argv = [*console_command(), *_argv(seq_len="128k"), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "plan vs baselines" in done.stdout and "128K tokens" in done.stdout
    assert Plan.from_json(out).train.seq_len == 131072


@pytest.mark.parametrize(
    ("command", "changes", "pattern"),
    [
        ("script", {"seq_len": "lots"}, r"^hexiseq: error: --seq-len 'lots' is not a length"),
        ("module", {"model": None}, r"^hexiseq plan: error: the following arguments are required"),
    ],
    ids=["script-bad-seq-len", "module-missing-model"],
)
def test_console_entry_exits_2_with_one_line(tmp_path, command, changes, pattern):
    prefix = console_command() if command == "script" else [sys.executable, "-m", "hexiseq.cli"]
    argv = [*prefix, *_argv(**changes)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert re.search(pattern, done.stderr), done.stderr
