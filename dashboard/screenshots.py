"""Drive the live dashboard with headless Chromium: load every page, collect what went wrong,
save a screenshot of each. The browser test uses it; run as a script it regenerates the
committed screenshots `docs/dashboard-<page>.png` from a store filled by `hexiseq plan`,
`hexiseq run`, `hexiseq profile` and `hexiseq fit` (`fill_example_store`):

    .venv/bin/python -m hexiseq.dashboard.screenshots [--out docs]

Needs Playwright for Python and a Chromium (`apt-get install chromium`; Playwright's own
browser download is not needed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hexiseq.store import child_environment

PAGES = {
    "plan": "",
    "cluster": "cluster",
    "memory": "memory",
    "throughput": "throughput",
    "profiles": "profiles",
    "whatif": "whatif",
}
"""Page name -> URL path (the plan page is the default, at /)."""
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
STARTUP_TIMEOUT_S = 45.0
PAGE_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
SETTLE_S = 1.0
"""Quiet time after a page's script finished, for plotly to draw."""
MAX_HEIGHT_PX = 5000
EXAMPLE_PLAN = ["--cluster", "h100x8-a100x8", "--model", "llama-30b", "--seq-len", "512k"]
TINY_PLAN = ["--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", "4k"]


@dataclass(frozen=True)
class PageCheck:
    """What one page showed: its exceptions and error messages (both empty when all is well)."""

    page: str
    exceptions: list[str]
    errors: list[str]
    screenshot: Path | None


def find_chromium() -> str | None:
    """A Chromium executable on this machine, or None."""
    for path in (*CHROMIUM_PATHS, shutil.which("chromium") or ""):
        if path and Path(path).exists():
            return path
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_dashboard(store_url: str, port: int) -> Iterator[str]:
    """`HEXISEQ_STORE_URL=URL hexiseq dashboard --port PORT` in a subprocess, up and healthy;
    yields its base URL and stops it (its whole process group) on exit."""
    command = [sys.executable, "-m", "hexiseq.cli", "dashboard", "--port", str(port)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=child_environment(store_url),
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, process)
        yield base_url
    finally:
        _stop(process)


def _wait_healthy(base_url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            raise RuntimeError(f"the dashboard exited with {process.returncode}: {output}")
        health_url = f"{base_url}/_stcore/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(health_url, timeout=2) as reply:
            if reply.status == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"the dashboard did not answer on {base_url} in {STARTUP_TIMEOUT_S} s")


def _stop(process: subprocess.Popen) -> None:
    """Stop the dashboard's whole process group: `hexiseq dashboard` and the Streamlit server it
    runs. A server with a browser session open can outlive SIGTERM (servers were left behind
    by the browser tests), so whatever is left of the group after STOP_TIMEOUT_S is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _group_alive(process):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of the dashboard's group is left (its leader reaped when done)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def check_pages(base_url: str, out_dir: Path | None, chromium: str) -> list[PageCheck]:
    """Load every page in one headless Chromium; screenshots into `out_dir` when given."""
    from playwright.sync_api import sync_playwright

    checks = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, path in PAGES.items():
                checks.append(_check_page(page, f"{base_url}/{path}", name, out_dir))
        finally:
            browser.close()
    return checks


def _check_page(page, url: str, name: str, out_dir: Path | None) -> PageCheck:
    page.goto(url, timeout=PAGE_TIMEOUT_S * 1000)
    page.wait_for_selector("h1", timeout=PAGE_TIMEOUT_S * 1000)
    wait_until_idle(page)
    exceptions = page.locator('[data-testid="stException"]').all_inner_texts()
    if "Traceback" in page.inner_text("body") and not exceptions:
        exceptions = ["a traceback is shown"]
    errors = page.locator('[data-testid="stAlertContentError"]').all_inner_texts()
    screenshot = None
    if out_dir is not None:
        screenshot = out_dir / f"dashboard-{name}.png"
        _screenshot_whole_page(page, screenshot)
    return PageCheck(name, exceptions, errors, screenshot)


def _screenshot_whole_page(page, path: Path) -> None:
    """Streamlit scrolls inside its main container, so `full_page` alone cuts the page off:
    grow the viewport to the content's height for the shot, then restore it."""
    viewport = page.viewport_size
    height = page.evaluate(_CONTENT_HEIGHT_JS)
    page.set_viewport_size({"width": viewport["width"], "height": min(height, MAX_HEIGHT_PX)})
    wait_until_idle(page)  # plotly redraws at the new size
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(viewport)


_CONTENT_HEIGHT_JS = """() => Math.max(document.body.scrollHeight,
    ...Array.from(document.querySelectorAll('[data-testid="stMain"]')).map(e => e.scrollHeight))"""


def wait_until_idle(page) -> None:
    """Until Streamlit's "running" indicator has been gone for SETTLE_S."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    quiet_since = None
    while time.monotonic() < deadline:
        running = page.locator('[data-testid="stStatusWidget"]').count() > 0
        if running:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= SETTLE_S:
            return
        time.sleep(0.2)


def fill_example_store(store_url: str) -> None:
    """The README's first plan (8x H100 + 8x A100, LLaMA-30B, 512K) searched with 30 Optuna
    trials whose study is kept in the store, saved with its baselines; a 'tiny' plan for the
    emulated 2-type CPU cluster run for 3 steps by the runtime (predicted vs measured); and a
    quick CPU profile of this machine with its fit (about a minute in all)."""
    with tempfile.TemporaryDirectory() as folder:
        tiny_plan = str(Path(folder) / "tiny.json")
        for arguments in (
            ["plan", *TINY_PLAN, "--out", tiny_plan],
            ["run", "--plan", tiny_plan, "--steps", "3", "--device", "cpu"],
            ["plan", *EXAMPLE_PLAN, "--trials", "30", "--storage", store_url],
            ["profile", "--device", "cpu", "--quick"],
            ["fit"],
        ):
            command = [sys.executable, "-m", "hexiseq.cli", *arguments, "--store", store_url]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder (docs)")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("no Chromium found: apt-get install chromium", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        store_url = f"sqlite:///{Path(folder) / 'hexiseq.db'}"
        fill_example_store(store_url)
        with running_dashboard(store_url, free_port()) as base_url:
            checks = check_pages(base_url, args.out, chromium)
    for check in checks:
        problems = check.exceptions + check.errors
        print(
            f"{check.page}: {check.screenshot}" + (f"  PROBLEMS: {problems}" if problems else "")
        )
    return 1 if any(c.exceptions or c.errors for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
