"""`hexiseq dashboard`: start the Streamlit app on 127.0.0.1 against a store.

Core code: it finds the app's file without importing `hexiseq.dashboard` (nothing imports the
dashboard) and checks its dependencies before starting anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from hexiseq.errors import InputError
from hexiseq.store import DEFAULT_STORE_URL

DEFAULT_PORT = 8501
DASHBOARD_MODULES = ("streamlit", "plotly", "pandas")
INSTALL_HINT = "pip install -e '.[dashboard]'"


def add_dashboard_parser(commands) -> None:
    """The `dashboard` subcommand and its options."""
    dashboard = commands.add_parser(
        "dashboard",
        help="browse plans, memory headroom and throughput in a local Streamlit app",
        description="Start the hexiseq dashboard (Streamlit) on http://127.0.0.1:PORT.",
    )
    dashboard.add_argument(
        "--store",
        default=DEFAULT_STORE_URL,
        metavar="URL",
        help=f"SQLAlchemy URL of the store to show (default {DEFAULT_STORE_URL})",
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


def streamlit_command(store_url: str, port: int) -> list[str]:
    """The `streamlit run` command line: bound to 127.0.0.1, headless, no usage statistics."""
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
        "--",
        "--store",
        store_url,
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    """Check the dependencies and the store (InputError: one line, exit 2), then run Streamlit
    until it is stopped; returns its exit code (0 on Ctrl-C)."""
    missing = [name for name in DASHBOARD_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(f"the dashboard needs {', '.join(missing)}: {INSTALL_HINT}")
    from hexiseq.store import Store

    store = Store.open(args.store)  # a bad URL fails here, in one line
    shown_url = store.url  # the password hidden
    store.close()
    print(f"hexiseq dashboard on http://127.0.0.1:{args.port} (store {shown_url}); Ctrl-C stops")
    try:
        return subprocess.run(streamlit_command(args.store, args.port), check=False).returncode
    except KeyboardInterrupt:
        return 0
