"""`hexiseq plan` search options: trials, seed, storage, workers, Pareto front."""

from __future__ import annotations

import optuna
import pytest

from hexiseq.cli import main

BASE = ["plan", "--cluster", "h100x8-a100x8", "--model", "llama3-8b", "--seq-len", "256k"]


def run(argv, capsys):
    code = main([*BASE, "--no-store", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_trials_and_pareto_print_the_front(capsys):
    code, out, err = run(["--trials", "12", "--seed", "2", "--pareto"], capsys)
    assert code == 0, err
    assert "Pareto front (throughput vs memory headroom" in out
    assert "candidates scored" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "--workers: must be at least 1"),
        (["--time-budget", "0"], "--time-budget: must be positive"),
        (["--time-budget", "soon"], "'soon' is not a number of seconds"),
        (["--trials", "0"], "--trials: must be at least 1"),
    ],
)
def test_bad_search_options_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        code = main([*BASE, "--no-store", *argv])
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_storage_lets_a_second_run_go_on(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    counts = []
    for _ in range(2):
        code, _, err = run(["--trials", "5", "--storage", url], capsys)
        assert code == 0, err
        (summary,) = optuna.get_all_study_summaries(storage=url)
        counts.append(summary.n_trials)
    # A new study scores at least the greedy short list; a continued one exactly 5 more.
    assert counts[0] >= 5
    assert counts[1] == counts[0] + 5
