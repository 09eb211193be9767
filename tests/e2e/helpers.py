"""Plumbing for the browser tests: servers on a free port, Chromium, steps that leave evidence.

Nothing here knows about pergrad_viz itself: the tests drive the explorer the way a user does,
through the page (slider handles, the keyboard) and read back what the page shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
EXPLORER_NOTEBOOK = "03_explorer.ipynb"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "e2e"
LATENCY_LOG = ARTIFACTS / "latency.txt"

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

# Timeouts (ms for Playwright, s for the rest). The machine may be small and shared: generous, but bounded.
SERVER_START_S = 120
PAGE_LOAD_MS = 120_000
WIDGETS_MS = 240_000  # first `import torch` + a first sweep in a fresh kernel
CHANGE_MS = 120_000  # one slider move -> a new plot
HEAVY_CHANGE_MS = 180_000  # batch size 256 / hidden width 512
SETTLE_S = 1.5  # the plot is "new" once its image stops changing for this long

SLIDERS = ("batch size", "hidden width")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tmp: Path, marker: str) -> dict[str, str]:
    """The environment for a Jupyter/Voila server and its kernels.

    - PYTHONPATH starts with the repo root, so `import pergrad_viz` works in the kernel whether or not the
      package is installed (editable) in the environment running the tests.
    - Jupyter config and runtime state live in `tmp`, so the user's ~/.jupyter settings and workspaces neither
      leak in nor get written. JUPYTER_DATA_DIR points at an empty folder too: kernelspecs and lab extensions then
      come from this environment's sys.prefix (the venv's ipykernel `python3`, whose argv[0] "python" jupyter_client
      replaces with the server's sys.executable), not from ~/.local/share/jupyter.
    - `marker` tags every process started from here (server and kernels), so teardown can find stragglers.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for name, sub in [
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ]:
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(tmp / sub)
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_PREFER_ENV_PATH", None)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PERGRAD_E2E_MARKER"] = marker
    return env


def _pids_with_marker(marker: str) -> list[int]:
    """Processes whose environment carries our marker (Linux /proc; elsewhere: none found)."""
    needle = f"PERGRAD_E2E_MARKER={marker}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return [p for p in pids if p != os.getpid()]


class Server:
    """A Jupyter/Voila server in its own process group; output to a log file in the artifacts folder."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path, port: int, log_path: Path):
        self.name, self.cmd, self.env, self.cwd, self.port, self.log_path = name, cmd, env, cwd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, ready_path: str | None, timeout_s: float = SERVER_START_S) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self._log.write("$ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before listening; server log: {self.log_path}"
                )
            if self._ready(ready_path):
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.name} not listening on {self.url} after {timeout_s:.0f} s; server log: {self.log_path}"
        )

    def _ready(self, ready_path: str | None) -> bool:
        if ready_path is None:  # only a TCP connect: a GET on Voila's page would start a kernel
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
            return False
        try:
            with urllib.request.urlopen(self.url + ready_path, timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def get_json(self, path: str):
        import json

        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read().decode())

    def stop(self) -> None:
        """SIGTERM the process group (a Jupyter server then shuts its kernels down), SIGKILL what is left,
        then any process still carrying our marker (kernels live in their own sessions)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # children left in the group after the leader exited
        marker = self.env.get("PERGRAD_E2E_MARKER")
        if marker:
            deadline = time.monotonic() + 10
            while (left := _pids_with_marker(marker)) and time.monotonic() < deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGTERM if time.monotonic() < deadline - 5 else signal.SIGKILL)
                time.sleep(0.5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def jupyter_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def code_cell_sources(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    sources = [c["source"] for c in cells if c["cell_type"] == "code"]
    return ["".join(s) if isinstance(s, list) else s for s in sources]


# ----------------------------------------------------------------------------------------------- evidence


def artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def screenshot(page, name: str, show=None) -> Path:
    """A full-page screenshot; `show` (a locator) is scrolled into view first: JupyterLab scrolls inside
    its notebook panel, so a full-page shot alone would miss an explorer below the fold."""
    path = artifact(f"{name}.png")
    if show is not None:
        with contextlib.suppress(Exception):
            show.scroll_into_view_if_needed(timeout=5_000)
    try:
        page.screenshot(path=str(path), full_page=True, timeout=30_000)
    except Exception as exc:  # a screenshot must never hide the real failure
        path = artifact(f"{name}.screenshot-failed.txt")
        path.write_text(f"could not take a screenshot: {exc!r}\n", encoding="utf-8")
    return path


@contextlib.contextmanager
def step(page, server: Server, name: str) -> Iterator[None]:
    """Run a browser step; on any failure leave a screenshot and name it and the server log in the message."""
    try:
        yield
    except Exception as exc:
        shot = screenshot(page, f"FAILED-{server.name}-{name}")
        msg = (
            f"{server.name}: step '{name}' failed: {type(exc).__name__}: {exc}\n"
            f"  screenshot: {shot}\n"
            f"  server log: {server.log_path}\n"
            f"  last server log lines:\n{server.log_tail(25)}"
        )
        raise AssertionError(msg) from exc


def record_latency(frontend: str, what: str, seconds: float) -> None:
    line = f"latency {frontend} {what}: {seconds:.2f} s"
    print(line)
    LATENCY_LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LATENCY_LOG, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{frontend}\t{what}\t{seconds:.3f}\n")


# ------------------------------------------------------------------------------------------ the explorer

# ipywidgets 8 renders a slider as
#   div.widget-slider > label.widget-label("batch size") + div.slider-container > div.noUi-target
#       ... div.noUi-handle[role=slider][tabindex=0][aria-valuenow=<option index>]
#   + div.widget-readout (the selected option's label; contenteditable, but typing there is not how most
#     people move a slider)
# noUiSlider's handles take the keyboard, as a user with a keyboard (or a screen reader) moves them: focus the
# handle, ArrowLeft/Right step one option, Home/End go to the ends; with continuous_update=False the value is
# sent to the kernel on the resulting "change" event, once per key press.


def slider(scope, label: str):
    """The slider widget whose description label reads exactly `label`."""
    return scope.locator(".widget-slider").filter(
        has=scope.page.locator("label.widget-label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$"))
    )


def slider_handle(scope, label: str):
    return slider(scope, label).locator(".noUi-handle").first


def slider_readout(scope, label: str) -> str:
    return slider(scope, label).locator(".widget-readout").first.inner_text().strip()


# The plot: <img> elements inside the explorer with an inline image (ipywidgets.Image -> blob: URL,
# an Output with image/png -> data: URL). Their srcs, in order, identify the current figure(s).
_PLOT_SRCS_JS = """
(root) => Array.from(root.querySelectorAll('img'))
    .filter(img => /^(data:image\\/|blob:)/.test(img.getAttribute('src') || ''))
    .map(img => ({src: img.getAttribute('src'), ok: img.complete && img.naturalWidth > 0,
                  w: img.getBoundingClientRect().width}))
"""


def plot_images(scope) -> list[dict]:
    return scope.evaluate(_PLOT_SRCS_JS)


def plot_key(scope) -> tuple[str, ...]:
    return tuple(img["src"] for img in plot_images(scope))


def wait_for_plot(scope, timeout_ms: int) -> tuple[str, ...]:
    """Wait until the explorer shows at least one loaded, visible inline image; return the srcs."""
    scope.page.wait_for_function(
        f"""(root) => {{
            const imgs = ({_PLOT_SRCS_JS})(root);
            return imgs.length > 0 && imgs.every(i => i.ok && i.w > 0);
        }}""",
        arg=scope.element_handle(),
        timeout=timeout_ms,
        polling=200,
    )
    return plot_key(scope)


def wait_for_new_plot(scope, old: tuple[str, ...], t0: float, timeout_ms: int) -> tuple[tuple[str, ...], float]:
    """Wait until the plot differs from `old` and is loaded, then until it stays put for SETTLE_S
    (an explorer may redraw in stages). Returns (new srcs, seconds from t0 to the last change)."""
    page = scope.page
    root = scope.element_handle()
    page.wait_for_function(
        f"""([root, old]) => {{
            const imgs = ({_PLOT_SRCS_JS})(root);
            const now = imgs.map(i => i.src);
            return imgs.length > 0 && imgs.every(i => i.ok && i.w > 0)
                && (now.length !== old.length || now.some((s, k) => s !== old[k]));
        }}""",
        arg=[root, list(old)],
        timeout=timeout_ms,
        polling=100,
    )
    key, t_last = _settle(scope, t0 + timeout_ms / 1000)
    return key, t_last - t0


def _settle(scope, deadline: float) -> tuple[tuple[str, ...], float]:
    """Poll until the images have not changed for SETTLE_S and nothing says "computing" (an explorer may
    redraw in stages: chart first, heatmaps later). Returns (srcs, perf_counter() of the last change seen)."""
    current, t_last = plot_key(scope), time.perf_counter()
    while True:
        imgs = plot_images(scope)
        key = tuple(i["src"] for i in imgs)
        now = time.perf_counter()
        if key != current or not all(i["ok"] for i in imgs):
            current, t_last = key, now
        elif now - t_last >= SETTLE_S and not is_busy(scope):
            return current, t_last
        if now > deadline:
            raise TimeoutError(f"the explorer did not settle (images still changing or busy): {explorer_text(scope)!r}")
        time.sleep(0.1)


def explorer_text(scope) -> str:
    """The text the explorer shows, without slider labels/readouts (which change on the client alone)."""
    return scope.evaluate(
        """(root) => {
            const parts = [];
            const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
            for (let n = walker.nextNode(); n; n = walker.nextNode()) {
                const el = n.parentElement;
                if (!el || el.closest('.widget-slider, style, script')) continue;
                if (n.nodeValue.trim()) parts.push(n.nodeValue.trim());
            }
            return parts.join('\\n');
        }"""
    )


BUSY = re.compile(r"\bcomputing\b", re.IGNORECASE)


def is_busy(scope) -> bool:
    """The explorer says it is computing ("⏳ computing…")."""
    return BUSY.search(explorer_text(scope)) is not None


def shows_setting(scope, label: str, value: str) -> bool:
    """The explorer's text (outside the sliders) names the setting: "batch size B=64", "batch size 64",
    "hidden width: 128", as in its status line and table caption."""
    pattern = rf"{re.escape(label)}\W{{0,3}}(?:[A-Za-z]{{1,2}}\s*=\s*)?{re.escape(value)}(?![\w.])"
    return re.search(pattern, explorer_text(scope), re.IGNORECASE) is not None


def kernel_commands(marker: str) -> list[list[str]]:
    """argv of the running ipykernel processes started under `marker` (Linux /proc; elsewhere: [])."""
    cmds = []
    for pid in _pids_with_marker(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("ipykernel" in a for a in argv):
            cmds.append([a for a in argv if a])
    return cmds


# ------------------------------------------------------------------------------------ the shared checks


@dataclass
class Ui:
    """A page showing the explorer: `scope` is the output area that holds it."""

    frontend: str
    page: object
    scope: object
    server: Server


def explorer_scope(page):
    """The output area holding the explorer (the one with the "batch size" slider)."""
    label = page.locator("label.widget-label", has_text=re.compile(r"^\s*batch size\s*$"))
    return page.locator(".jp-OutputArea-output").filter(has=label).first


def settle(ui: Ui, timeout_ms: int) -> tuple[str, ...]:
    """Wait for a loaded plot that stays the same for SETTLE_S while the explorer is not busy."""
    deadline = time.perf_counter() + timeout_ms / 1000
    wait_for_plot(ui.scope, timeout_ms)
    return _settle(ui.scope, deadline)[0]


def check_renders(ui: Ui) -> None:
    from playwright.sync_api import expect

    with step(ui.page, ui.server, "explorer renders"):
        for label in SLIDERS:
            expect(slider(ui.scope, label), f"slider {label!r}").to_be_visible()
            expect(slider_handle(ui.scope, label), f"handle of slider {label!r}").to_be_visible()
            readout = slider_readout(ui.scope, label)
            assert readout.isdigit(), f"slider {label!r} reads {readout!r}, expected a number"
        imgs = plot_images(ui.scope)
        assert imgs, "no plot: no <img> with a data:/blob: source in the explorer"
        assert all(i["ok"] and i["w"] > 0 for i in imgs), f"a plot image is not loaded or not shown: {imgs}"
    screenshot(ui.page, f"{ui.frontend}-rendered", ui.scope)


def _handle_state(ui: Ui, label: str) -> tuple[int, int]:
    h = slider_handle(ui.scope, label)
    return int(float(h.get_attribute("aria-valuenow"))), int(float(h.get_attribute("aria-valuemax")))


def move_slider(ui: Ui, label: str, key: str, timeout_ms: int = CHANGE_MS, tag: str = "") -> tuple[str, str, float]:
    """Press `key` on the slider's handle, as a user would (focus + keyboard), and wait for the new plot.

    Returns (old readout, new readout, seconds from the key press to the settled new plot). Screenshots before
    and after; on failure a screenshot and the server log path are in the message.
    """
    what = f"{label}{'-' + tag if tag else ''}"
    name = f"{ui.frontend}-{what}"
    with step(ui.page, ui.server, f"move {label!r} with {key}"):
        old_value = slider_readout(ui.scope, label)
        old_plot = settle(ui, timeout_ms)
        screenshot(ui.page, f"{name}-before", ui.scope)
        handle = slider_handle(ui.scope, label)
        handle.focus()
        t0 = time.perf_counter()
        handle.press(key)
        # the readout follows at once on the client ...
        deadline = time.monotonic() + 10
        while (new_value := slider_readout(ui.scope, label)) == old_value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert new_value != old_value, f"pressing {key} on the {label!r} handle left its readout at {old_value}"
        # ... the plot once the kernel has recomputed it
        try:
            _, latency = wait_for_new_plot(ui.scope, old_plot, t0, timeout_ms)
        except Exception as exc:
            raise AssertionError(
                f"no new plot {timeout_ms / 1000:.0f} s after moving {label!r} {old_value} -> {new_value} ({exc}); "
                f"the explorer reads:\n{explorer_text(ui.scope)[-2000:]}"
            ) from exc
    other = " ".join(f"{s} {slider_readout(ui.scope, s)}" for s in SLIDERS if s != label)
    record_latency(
        ui.frontend, f"{label} {old_value} -> {new_value} (at {other}){' [' + tag + ']' if tag else ''}", latency
    )
    screenshot(ui.page, f"{name}-after", ui.scope)
    with step(ui.page, ui.server, f"explorer shows {label} {new_value}"):
        deadline = time.monotonic() + 30
        while not shows_setting(ui.scope, label, new_value) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shows_setting(ui.scope, label, new_value), (
            f"after moving {label!r} to {new_value}, the explorer's text (outside the sliders) does not name "
            f"{label} {new_value}:\n{explorer_text(ui.scope)}"
        )
        assert slider_readout(ui.scope, label) == new_value, "the slider did not keep its new value"
    return old_value, new_value, latency


def check_kernel_python(server: Server) -> None:
    """The kernels the server started run a python of this environment (the one running pytest), which
    imports pergrad_viz from here. Linux only (reads /proc); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    cmds = kernel_commands(server.env["PERGRAD_E2E_MARKER"])
    assert cmds, f"no ipykernel process found under the {server.name} server"
    here = Path(sys.executable).parent.resolve()
    assert all(Path(c[0]).parent.resolve() == here for c in cmds), f"kernels {cmds} do not run a python of {here}"


def check_slider_change(ui: Ui, label: str) -> None:
    now, top = _handle_state(ui, label)
    move_slider(ui, label, "ArrowLeft" if now >= top else "ArrowRight")


def check_heavy(ui: Ui) -> None:
    """Both sliders to their maximum (End key); the second move gives the heaviest setting's latency."""
    for label in SLIDERS:
        now, top = _handle_state(ui, label)
        if now >= top:  # already there: step back first so that End is a change
            move_slider(ui, label, "ArrowLeft", HEAVY_CHANGE_MS, tag="back")
        move_slider(ui, label, "End", HEAVY_CHANGE_MS, tag="max")
