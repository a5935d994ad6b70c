"""`hexiseq dashboard`: start the Streamlit app on 127.0.0.1 against a store.

Core code: it finds the app's file without importing `hexiseq.dashboard` (nothing imports the
dashboard) and checks its dependencies before starting anything. The app gets the store URL and
the Optuna storage URL in its environment, never its command line (any user can read that).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from hexiseq.errors import InputError
from hexiseq.store import (
    OPTUNA_STORAGE_ENV,
    STORE_URL_HELP,
    child_environment,
    display_url,
    parse_database_url,
)

DEFAULT_PORT = 8501
DASHBOARD_MODULES = ("streamlit", "plotly", "pandas")
INSTALL_HINT = "pip install -e '.[dashboard]'"
_OPTUNA_URLS = "give a SQLAlchemy URL such as sqlite:///optuna.db or postgresql://USER@HOST/DB"


def add_dashboard_parser(commands) -> None:
    """The `dashboard` subcommand and its options."""
    dashboard = commands.add_parser(
        "dashboard",
        help="browse plans, memory headroom and throughput in a local Streamlit app",
        description="Start the hexiseq dashboard (Streamlit) on http://127.0.0.1:PORT.",
    )
    dashboard.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store to show {STORE_URL_HELP}",
    )
    dashboard.add_argument(
        "--optuna-storage",
        metavar="URL",
        help="SQLAlchemy URL of Optuna studies to show beside those in the store (a `hexiseq "
        "plan --storage`); visitors can choose only between these two, never type a URL",
    )
    dashboard.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})"
    )


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1..65535 (got {text})")
    return value


def app_path() -> Path:
    """The dashboard's entry script, located without importing the dashboard package."""
    spec = importlib.util.find_spec("hexiseq.dashboard")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the hexiseq.dashboard package is not installed with this hexiseq")
    return Path(next(iter(spec.submodule_search_locations))) / "app.py"


def streamlit_command(port: int) -> list[str]:
    """The `streamlit run` command line: bound to 127.0.0.1, headless, no usage statistics; no
    URL in it (`streamlit_environment` carries them)."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app_path()),
        "--server.address",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
    ]


def streamlit_environment(store_url: str, optuna_storage: str | None) -> dict[str, str]:
    """The app's environment: this one, with $HEXISEQ_STORE_URL and the Optuna storage URL set
    (the latter removed when None, so that a stale one is not shown)."""
    environment = child_environment(store_url)
    environment.pop(OPTUNA_STORAGE_ENV, None)
    if optuna_storage is not None:
        environment[OPTUNA_STORAGE_ENV] = optuna_storage
    return environment


def run_dashboard(args: argparse.Namespace) -> int:
    """Check the dependencies and the store (InputError: one line, exit 2), then run Streamlit
    until it is stopped; returns its exit code (0 on Ctrl-C)."""
    missing = [name for name in DASHBOARD_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(f"the dashboard needs {', '.join(missing)}: {INSTALL_HINT}")
    from hexiseq.store import Store

    if args.optuna_storage is not None:  # parsed here; the page says if it cannot be read
        parse_database_url(args.optuna_storage, "--optuna-storage", _OPTUNA_URLS)
    store = Store.open(args.store)  # a bad URL fails here, in one line
    shown_url = store.url  # the password hidden
    store.close()
    shown = f"store {shown_url}"
    if args.optuna_storage is not None:
        shown += f", Optuna storage {display_url(args.optuna_storage)}"
    print(f"hexiseq dashboard on http://127.0.0.1:{args.port} ({shown}); Ctrl-C stops")
    command = streamlit_command(args.port)
    environment = streamlit_environment(args.store, args.optuna_storage)
    try:
        return subprocess.run(command, env=environment, check=False).returncode
    except KeyboardInterrupt:
        return 0
