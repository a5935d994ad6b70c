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


def test_a_cluster_edited_on_the_whatif_page_is_the_one_planned(chromium, empty_store_url):
    """In Chromium: the a100-node's count edited from 8 to 4 in the nodes table, then the
    search: the result is for the edited cluster (12 devices), not the preset."""
    from playwright.sync_api import sync_playwright

    port = screenshots.free_port()
    with (
        screenshots.running_dashboard(empty_store_url, port) as base_url,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"{base_url}/whatif")
            grid = page.locator('[data-testid="stDataFrameResizable"]').first
            grid.wait_for(timeout=30_000)
            box = grid.bounding_box()
            row_px = 35  # the header, then one row per node
            page.wait_for_timeout(1_000)  # the grid takes clicks once it has drawn
            page.mouse.click(box["x"] + 0.62 * box["width"], box["y"] + 2.5 * row_px)  # count
            page.wait_for_timeout(300)
            page.keyboard.type("4")
            page.wait_for_timeout(300)
            page.keyboard.press("Enter")
            page.wait_for_timeout(2_000)  # the edit reaches the app
            page.get_by_label("Sequence length (131072, 128k, 1M)").fill("64k")
            page.get_by_role("button", name="Run the search").click()
            result = page.get_by_text("Result:")
            result.wait_for(timeout=60_000)
            assert result.inner_text() == "Result: llama-30b on h100x8-a100x8 (edited), 64K"
        finally:
            browser.close()


def test_the_plan_picked_in_the_sidebar_stays_picked_across_the_navigation(
    chromium, populated_store
):
    """In Chromium: a plan other than the newest picked in the sidebar, then each page opened
    by its navigation link: the sidebar still shows that plan."""
    from playwright.sync_api import sync_playwright

    port = screenshots.free_port()
    with (
        screenshots.running_dashboard(populated_store.url, port) as base_url,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(base_url)
            picker = page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"] input')
            picker.first.wait_for(timeout=30_000)
            screenshots.wait_until_idle(page)
            newest = picker.first.input_value()
            picker.first.click()
            page.locator('[role="option"]').nth(1).click()
            screenshots.wait_until_idle(page)
            chosen = picker.first.input_value()
            assert chosen != newest
            for title in NAV_TITLES[1:] + NAV_TITLES[:1]:
                page.locator('[data-testid="stSidebarNavLink"]', has_text=title).click()
                page.get_by_role("heading", name=title, exact=True).wait_for(timeout=30_000)
                screenshots.wait_until_idle(page)
                assert picker.first.input_value() == chosen, title
        finally:
            browser.close()
