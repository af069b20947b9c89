"""The RollArt page in a real browser (headless Chromium, Debian's build): a short run goes on, the
page fills every panel live, and a screenshot of it is taken.

The screenshot goes to the test's temporary directory. The README's picture, docs/dashboard.png (tracked),
is only replaced on request: ``ROLLART_UPDATE_SCREENSHOTS=1 .venv/bin/python -m pytest tests/test_dashboard_browser.py``.
"""

import os
import shutil
import time
from pathlib import Path

import pytest
from distributed import Client

import rollart_dask
from tests.conftest import flow_dict

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
README_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "dashboard.png"  # replaced only with ROLLART_UPDATE_SCREENSHOTS=1
# data-* attributes of the page's header, one per panel: each must show data while the run goes on
PANELS = ("inflight", "busy-points", "staleness", "lag", "syncs", "counts", "evals")

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [
    pytest.mark.needs("chromium"),  # Debian's chromium at CHROMIUM: skipped without it, a failure in CI on x86-64 (tests/conftest.py)
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[dev]')"),
]


def panel_values(page) -> dict:
    header = page.locator(".rollart-summary")  # Playwright's CSS locators reach into Bokeh's shadow DOM
    if header.count() == 0:
        return {}
    return {p: float(header.first.get_attribute(f"data-{p}") or 0) for p in PANELS}


def test_rollart_page_fills_live_in_a_browser(address, tmp_path):
    screenshot = tmp_path / "dashboard.png"
    # redundancy 1: each group's extra member is dropped, so the dropped/failed panel has something to show
    flow = flow_dict(**{"trainer.steps": 10_000, "eval.every": 2, "rollout.redundancy": 1})
    with Client(address) as client:
        run = rollart_dask.launch(flow, client=client, out=tmp_path / "run")
        try:
            t0 = time.monotonic()
            while run.dashboard_url is None:
                assert run.status in ("starting", "running"), run.error
                assert time.monotonic() - t0 < 120, "the run never registered its page"
                time.sleep(0.5)
            with sync_playwright() as p:
                browser = p.chromium.launch_persistent_context(
                    str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=ARGS, viewport={"width": 1400, "height": 1000}
                )
                page = browser.new_page()
                page.goto(run.dashboard_url, wait_until="load", timeout=60_000)

                def ready(seen: dict) -> bool:  # every panel non-empty, with enough steps and evaluations to draw lines
                    return bool(seen) and all(seen.values()) and seen["evals"] >= 2 and seen["busy-points"] >= 8

                seen: dict = {}
                while True:
                    assert time.monotonic() - t0 < 300, f"panels still empty after 300 s: {seen}"
                    assert run.status == "running", run.error
                    page.wait_for_timeout(1000)  # the page refreshes once a second
                    seen = panel_values(page)
                    if ready(seen):
                        page.screenshot(path=str(screenshot), full_page=True)
                        if ready(panel_values(page)):  # no refresh emptied a panel while the shot was taken
                            break
                assert page.title() == "Dask: RollArt"  # set by the Bokeh document once it is live
                browser.close()
        finally:
            run.stop(timeout=240)
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("ROLLART_UPDATE_SCREENSHOTS") == "1":  # opt-in: replace the README's picture with this one
        shutil.copyfile(screenshot, README_SCREENSHOT)
