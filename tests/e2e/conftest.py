"""Fixtures for the browser tests: Chromium (Debian's, never `playwright install`), JupyterLab and Voila
servers on a free port of 127.0.0.1, rooted at a temporary copy of notebooks/.

Without a browser the tests skip, saying why; under CI (CI=true) that is a failure instead.
Every server is stopped in fixture teardown, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from .helpers import (
    CHROMIUM,
    CHROMIUM_ARGS,
    EXPLORER_NOTEBOOK,
    NOTEBOOKS_DIR,
    RESULTS,
    Server,
    artifact,
    free_port,
    in_ci,
    jupyter_cmd,
    latency_table,
    server_env,
)

CULL_IDLE_S = 8  # the README's command uses minutes; the test cannot wait that long
CULL_INTERVAL_S = 2


def pytest_terminal_summary(terminalreporter):
    """The explorer's measured latencies as one table at the end of the run (also without -s)."""
    if RESULTS:
        terminalreporter.write_sep("=", "explorer latency (input -> first new figure / settled view)")
        terminalreporter.write_line(latency_table(RESULTS))
        missed = [r for r in RESULTS if not r.met]
        terminalreporter.write_line(f"{len(RESULTS) - len(missed)} of {len(RESULTS)} changes met their targets"
                                    + (f"; missed: {', '.join(f'{r.frontend} {r.control} {r.change}' for r in missed)}"
                                       if missed else ""))


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        return f"playwright is not importable ({exc}): pip install -r requirements.txt (make setup does this)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"chromium not found at {CHROMIUM}: apt-get install chromium (make test does this)"
    return None


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session."""
    reason = _browser_missing()
    if reason:
        if in_ci():
            pytest.fail(f"CI=true and the browser tests cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, timeout=120_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def notebook_copy(tmp_path_factory) -> Path:
    """A throw-away copy of notebooks/: the servers may write checkpoints and outputs there, never into the repo."""
    nb = NOTEBOOKS_DIR / EXPLORER_NOTEBOOK
    if not nb.is_file():
        pytest.fail(f"{nb} is missing: the browser tests drive the explorer notebook", pytrace=False)
    dst = tmp_path_factory.mktemp("e2e") / "notebooks"
    shutil.copytree(NOTEBOOKS_DIR, dst, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return dst


def _lab_settings(settings_dir: Path) -> None:
    """JupyterLab user settings for a quiet, offline page: no news or update checks, no toasts over the widgets."""
    path = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))


def _root_flag() -> list[str]:
    return ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []


@pytest.fixture(scope="module")
def lab_server(notebook_copy, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    _lab_settings(tmp / "user-settings")
    port = free_port()
    cmd = jupyter_cmd(
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={notebook_copy}",
        "--IdentityProvider.token=",
        "--ServerApp.disable_check_xsrf=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        f"--LabApp.user_settings_dir={tmp / 'user-settings'}",
        *_root_flag(),
    )
    env = server_env(tmp / "state", uuid.uuid4().hex)
    server = Server("jupyterlab", cmd, env, notebook_copy, port, artifact("jupyterlab-server.log"))
    try:
        server.start("/api/status")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def voila_server(notebook_copy, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("voila")
    port = free_port()
    cmd = jupyter_cmd(
        "voila",
        str(notebook_copy / EXPLORER_NOTEBOOK),
        "--no-browser",
        f"--port={port}",
        "--Voila.ip=127.0.0.1",
        "--Voila.port_retries=0",
        f"--Voila.root_dir={notebook_copy}",
        f"--Voila.connection_dir_root={tmp}",
        "--show_tracebacks=True",
        # as in the README's command, with short times: a closed page's kernel is culled once idle
        f"--MappingKernelManager.cull_idle_timeout={CULL_IDLE_S}",
        f"--MappingKernelManager.cull_interval={CULL_INTERVAL_S}",
    )
    env = server_env(tmp / "state", uuid.uuid4().hex)
    server = Server("voila", cmd, env, notebook_copy, port, artifact("voila-server.log"))
    try:
        server.start(None)
        yield server
    finally:
        server.stop()
