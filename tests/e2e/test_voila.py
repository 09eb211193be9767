"""The explorer as a Voila dashboard: `voila notebooks/03_explorer.ipynb` shows the widgets and no code,
and moving a slider redraws the runtime chart.

Latencies (key press -> settled new plot) are printed and appended to test-artifacts/e2e/latency.txt:
measurements, not assertions. Screenshots before/after each move land in test-artifacts/e2e/.
"""

from __future__ import annotations

import re

import pytest

from .helpers import (
    EXPLORER_NOTEBOOK,
    SLIDERS,
    WIDGETS_MS,
    Ui,
    check_heavy,
    check_kernel_python,
    check_renders,
    check_slider_change,
    code_cell_sources,
    explorer_scope,
    settle,
    step,
)

pytestmark = pytest.mark.e2e

FRONTEND = "voila"


@pytest.fixture(scope="module")
def dashboard(browser, voila_server):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        with step(page, voila_server, "open the dashboard"):
            # Voila streams the page while it runs the notebook: "load" fires once every cell has run.
            page.goto(voila_server.url + "/", timeout=WIDGETS_MS, wait_until="commit")
            page.wait_for_load_state("load", timeout=WIDGETS_MS)
        ui = Ui(FRONTEND, page, explorer_scope(page), voila_server)
        with step(page, voila_server, "wait for the explorer"):
            for label in SLIDERS:
                ui.scope.locator("label.widget-label", has_text=label).first.wait_for(timeout=WIDGETS_MS)
            settle(ui, WIDGETS_MS)
        yield ui
    finally:
        context.close()


def test_dashboard_renders(dashboard):
    check_renders(dashboard)


def test_dashboard_shows_no_code(dashboard, notebook_copy):
    page = dashboard.page
    with step(page, dashboard.server, "no code on the dashboard"):
        for selector in [".jp-CodeCell .jp-InputArea", ".jp-InputPrompt", ".cm-editor", ".CodeMirror"]:
            shown = [e for e in page.locator(selector).all() if e.is_visible()]
            assert not shown, f"{len(shown)} visible {selector!r} on the dashboard"
        text = " ".join(page.locator("body").inner_text().split())
        for source in code_cell_sources(notebook_copy / EXPLORER_NOTEBOOK):
            lines = [ln.strip() for ln in source.splitlines()]
            code = [ln for ln in lines if len(ln) >= 10 and not ln.startswith("#") and re.search(r"[=(]|import ", ln)]
            for line in code:
                assert " ".join(line.split()) not in text, f"the dashboard shows the code line {line!r}"


def test_kernel_runs_this_python(dashboard):
    check_kernel_python(dashboard.server)


def test_batch_size_change_updates_plot(dashboard):
    check_slider_change(dashboard, "batch size")


def test_hidden_width_change_updates_plot(dashboard):
    check_slider_change(dashboard, "hidden width")


def test_latency_at_the_largest_setting(dashboard):
    check_heavy(dashboard)
