"""The explorer as a Voila dashboard: `voila notebooks/03_explorer.ipynb` (with the README's culling options)
shows the explorer and nothing else (no code, no printed text), every control's latency is measured as in
JupyterLab, and the kernel of a closed page goes away.

Latencies are printed as a table at the end of the run (and appended to test-artifacts/e2e/latency.txt).
"""

from __future__ import annotations

import re
import time

import pytest

from .conftest import CULL_IDLE_S, CULL_INTERVAL_S
from .helpers import (
    EXPLORER_NOTEBOOK,
    SLIDERS,
    WIDGETS_MS,
    Ui,
    check_calm_timing,
    check_figures_at_natural_size,
    check_kernel_python,
    check_renders,
    code_cell_sources,
    explorer_scope,
    full_page_screenshot,
    kernel_commands,
    run_latency_script,
    run_model_menu,
    step,
    wait_done,
)

pytestmark = pytest.mark.e2e

FRONTEND = "voila"


def _open(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(60_000)
    with step(page, server, "open the dashboard"):
        # Voila streams the page while it runs the notebook: "load" fires once every cell has run.
        page.goto(server.url + "/", timeout=WIDGETS_MS, wait_until="commit")
        page.wait_for_load_state("load", timeout=WIDGETS_MS)
    ui = Ui(FRONTEND, page, explorer_scope(page), server)
    with step(page, server, "wait for the explorer"):
        for label in SLIDERS:
            ui.scope.locator("label.widget-label", has_text=label).first.wait_for(timeout=WIDGETS_MS)
        wait_done(ui)
    return context, ui


@pytest.fixture(scope="module")
def dashboard(browser, voila_server):
    context, ui = _open(browser, voila_server)
    try:
        yield ui
    finally:
        context.close()


def test_dashboard_renders(dashboard):
    check_renders(dashboard)
    check_figures_at_natural_size(dashboard)
    full_page_screenshot(dashboard.page, f"{FRONTEND}-full-page")


def test_dashboard_timing_is_calm_at_the_defaults(dashboard):
    check_calm_timing(dashboard)


def test_dashboard_shows_the_explorer_only(dashboard, notebook_copy):
    page = dashboard.page
    with step(page, dashboard.server, "no code and no printed text on the dashboard"):
        for selector in [".jp-CodeCell .jp-InputArea", ".jp-InputPrompt", ".cm-editor", ".CodeMirror"]:
            shown = [e for e in page.locator(selector).all() if e.is_visible()]
            assert not shown, f"{len(shown)} visible {selector!r} on the dashboard"
        streams = page.locator(".jp-OutputArea-output[data-mime-type^='application/vnd.jupyter.std']")
        assert streams.count() == 0, f"printed text on the dashboard: {streams.all_text_contents()}"
        text = " ".join(page.locator("body").inner_text().split())
        for source in code_cell_sources(notebook_copy / EXPLORER_NOTEBOOK):
            lines = [ln.strip() for ln in source.splitlines()]
            code = [ln for ln in lines if len(ln) >= 10 and not ln.startswith("#") and re.search(r"[=(]|import ", ln)]
            for line in code:
                assert " ".join(line.split()) not in text, f"the dashboard shows the code line {line!r}"


def test_kernel_runs_this_python(dashboard):
    check_kernel_python(dashboard.server)


def test_model_menu(dashboard):
    """Each network of the menu, chosen from the dropdown: a latency row per model, every panel for it."""
    rows = run_model_menu(dashboard, screenshots=True)
    assert [r.setting.split()[0] for r in rows] == ["cnn", "transformer", "lstm", "vit-lora", "mlp"]


def test_latency_of_every_control(dashboard):
    rows = run_latency_script(dashboard)
    assert rows and all(r.settled_s > 0 for r in rows)


def test_the_kernel_of_a_closed_page_goes(browser, voila_server, dashboard):
    """Each page load starts a kernel (about 0.85 GB with the explorer); closed pages' kernels are culled."""
    marker = voila_server.env["PERGRAD_E2E_MARKER"]
    before = len(kernel_commands(marker))
    context, ui = _open(browser, voila_server)
    assert len(kernel_commands(marker)) == before + 1, "a new page load should start its own kernel"
    context.close()
    deadline = time.monotonic() + CULL_IDLE_S + 4 * CULL_INTERVAL_S + 20
    while len(kernel_commands(marker)) > before and time.monotonic() < deadline:
        time.sleep(0.5)
    left = len(kernel_commands(marker))
    assert left == before, (f"{left - before} kernel(s) of the closed page still running "
                            f"{CULL_IDLE_S + 4 * CULL_INTERVAL_S + 20:.0f} s after closing it")
    assert len(kernel_commands(marker)) >= 1, "the open dashboard's kernel must not be culled"
