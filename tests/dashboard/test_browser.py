"""Headless Chromium against the real `hexiseq dashboard` subprocess: every page loads on a
populated store and shows no exception and no error."""

from __future__ import annotations

import pytest

from hexiseq.dashboard import screenshots

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def chromium() -> str:
    pytest.importorskip("playwright", reason="Playwright for Python is not installed")
    path = screenshots.find_chromium()
    if path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    return path


def test_every_page_loads_without_error(chromium, populated_store, tmp_path):
    port = screenshots.free_port()
    with screenshots.running_dashboard(populated_store.url, port) as base_url:
        checks = screenshots.check_pages(base_url, tmp_path, chromium)
    assert [c.page for c in checks] == list(screenshots.PAGES)
    for check in checks:
        assert not check.exceptions, (check.page, check.exceptions)
        assert not check.errors, (check.page, check.errors)
        assert check.screenshot.stat().st_size > 10_000, check.page  # something was drawn


NAV_TITLES = ["Plan", "Cluster", "Memory headroom", "Throughput", "Profiles", "What-if"]


@pytest.mark.parametrize("first_page", ["profiles", "memory"])
def test_a_deep_link_opened_first_shows_the_page_titles_as_navigation(
    chromium, empty_store_url, first_page
):
    """A fresh server, `/profiles` loaded first: the sidebar listed file names (app, cluster,
    memory, ...) from the page folder instead of the titles."""
    from playwright.sync_api import sync_playwright

    port = screenshots.free_port()
    with (
        screenshots.running_dashboard(empty_store_url, port) as base_url,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{base_url}/{first_page}")
            links = page.locator('[data-testid="stSidebarNavLink"]')
            links.first.wait_for(timeout=30_000)
            assert links.all_inner_texts() == NAV_TITLES
        finally:
            browser.close()
