"""`rollart report` pages in a real browser (headless Chromium, Debian's build): the report of the quickstart and the
one comparing `benchmarks/sync_vs_rollart.py`'s two runs, both made from real runs kept under docs/report-runs/
(their metrics.jsonl gzipped, flow.yaml, summary.json; a fresh run's report is made in tests/test_cli_e2e.py). Every figure must load and the
summary table must name each run with its last held-out success.

The screenshot goes to the test's temporary directory; the README's picture, docs/report.png (tracked), is replaced
only on request: ``ROLLART_UPDATE_SCREENSHOTS=1 .venv/bin/python -m pytest tests/test_report_browser.py``.
"""

import os
import shutil
from pathlib import Path

import pytest
from rollart_dask.tools.report import build_report
from rollart_dask.tools.report.figures import FIGURES
from tests.test_dashboard_browser import ARGS, CHROMIUM, sync_playwright

DOCS = Path(__file__).resolve().parents[1] / "docs"
SAMPLES = DOCS / "report-runs"  # real runs: `rollart run flows/quickstart.yaml`, `benchmarks/sync_vs_rollart.py --minutes 4`
README_SCREENSHOT = DOCS / "report.png"

pytestmark = [
    pytest.mark.needs("chromium"),  # Debian's chromium at CHROMIUM: skipped without it, a failure in CI on x86-64 (tests/conftest.py)
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[dev]')"),
]


def open_report(index: Path, screenshot: Path | None = None) -> dict:
    """What the browser shows of a report: each image's loaded width, the summary table's rows, the headings."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(index.resolve().as_uri(), wait_until="load", timeout=60_000)
        shown = {
            "images": page.eval_on_selector_all("img", "els => Object.fromEntries(els.map(e => [e.getAttribute('src'), e.naturalWidth]))"),
            "rows": page.eval_on_selector_all("table tr", "els => els.slice(1).map(e => e.innerText)"),
            "headings": page.eval_on_selector_all("h2", "els => els.map(e => e.innerText)"),
            "title": page.title(),
        }
        if screenshot:
            page.screenshot(path=str(screenshot), full_page=False)
        browser.close()
    return shown


def test_the_quickstart_report_in_a_browser(tmp_path):
    index = build_report([SAMPLES / "quickstart"], out=tmp_path / "report")
    shown = open_report(index, tmp_path / "report.png")
    assert shown["images"] == {name: shown["images"][name] for name, _, _ in FIGURES} and all(w > 400 for w in shown["images"].values()), (
        shown["images"]
    )
    assert shown["headings"] == [heading for _, heading, _ in FIGURES]
    [row] = shown["rows"]
    assert row.startswith("quickstart") and "rollart α=1" in row and "frozenlake 0.9" in row, row  # it learned: last held-out ≥ 0.9
    assert (tmp_path / "report.png").stat().st_size > 20_000
    if os.environ.get("ROLLART_UPDATE_SCREENSHOTS") == "1":  # opt-in: replace the README's picture with this one
        shutil.copyfile(tmp_path / "report.png", README_SCREENSHOT)


def test_the_sync_vs_rollart_report_compares_both_runs_in_a_browser(tmp_path):
    index = build_report([SAMPLES / "sync_vs_rollart"], out=tmp_path / "report")
    shown = open_report(index)
    assert shown["title"] == "rollart report — 2 runs compared"
    assert set(shown["images"]) >= {"heldout.png", "train.png", "staleness.png", "phases.png"} and all(
        w > 400 for w in shown["images"].values()
    )
    modes = sorted(row.split("\t")[2] for row in shown["rows"])
    assert modes == ["rollart α=1", "sync α=0"], shown["rows"]
