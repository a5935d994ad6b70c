"""`hexiseq dashboard`: the command it starts, its errors, and the layer rules around it."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hexiseq.cli import dashboard as _cli_dashboard
from hexiseq.cli import main

ROOT = Path(__file__).parents[2]


def test_command_binds_streamlit_to_localhost_and_passes_the_store(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(
        _cli_dashboard.subprocess,
        "run",
        lambda command, env, check: (
            started.append((command, env)) or subprocess.CompletedProcess(command, 0)
        ),
    )
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["dashboard", "--store", url, "--port", "8123"]) == 0
    ((command, env),) = started
    assert command[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(command[4]) == ROOT / "dashboard" / "app.py"
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.port") + 1] == "8123"
    assert command[command.index("--server.headless") + 1] == "true"
    assert env["HEXISEQ_STORE_URL"] == url and url not in command  # argv is public


def test_bad_store_url_is_one_line_and_exit_2(capsys):
    assert main(["dashboard", "--store", "mysql://x@y/z"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mysql" in err and "sqlite" in err


def test_bad_port_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["dashboard", "--port", "70000"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_without_streamlit_it_says_what_to_install(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        _cli_dashboard.importlib.util,
        "find_spec",
        lambda name: None if name == "streamlit" else real_find_spec(name),
    )
    assert main(["dashboard", "--store", f"sqlite:///{tmp_path / 'x.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[dashboard]'" in err
    assert not (tmp_path / "x.db").exists()  # nothing created before the check


def test_import_hexiseq_and_its_cli_load_no_streamlit():
    code = (
        "import sys, hexiseq, hexiseq.cli; "
        "bad = [m for m in ('streamlit', 'plotly', 'pandas', 'hexiseq.dashboard') "
        "if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_dashboard_never_imports_the_runtime_or_torch():
    for path in (ROOT / "dashboard").rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith(("hexiseq.runtime", "torch")), f"{path}: {name}"


def test_nothing_imports_the_dashboard():
    for folder in ("hexiseq", "costmodel", "search", "runtime", "profiler"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in imported_modules(path):
                assert not name.startswith("hexiseq.dashboard"), f"{path}: {name}"
