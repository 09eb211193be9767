"""Plumbing for the browser tests: servers on a free port, Chromium, steps that leave evidence.

The tests drive the explorer the way a user does, through the page (slider handles and the keyboard, clicks) and
read back what the page shows; the one thing they rely on is the explorer's progress line, an element
``.pergrad-progress`` whose ``data-state`` is ``busy``, ``measuring`` (everything is shown and final but the slow
baselines' rows, marked as coming: ``tr.pergrad-coming``), ``done`` or ``error`` and whose ``data-setting`` names
the setting (``mlp B=64 hidden=20 grads``: the network of the menu, batch size, width, quantity).
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
WIDGETS_MS = 180_000  # first `import torch` + the first setting in a fresh kernel
CHANGE_S = 60  # one input -> the settled view (measured, and compared with the targets, not waited for)

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


# Voila scrolls inside #rendered_cells (the page itself is one viewport high): a full-page screenshot must grow
# the viewport to the content first. JupyterLab scrolls inside its notebook panel instead (see `screenshot`).
_CONTENT_SIZE_JS = """
() => {
    const box = document.querySelector('#rendered_cells') || document.scrollingElement || document.body;
    const outside = document.documentElement.scrollHeight - box.clientHeight;
    return {width: Math.max(box.scrollWidth, document.documentElement.scrollWidth),
            height: box.scrollHeight + Math.max(0, outside)};
}
"""


def full_page_screenshot(page, name: str) -> Path:
    """A screenshot of the whole dashboard: the viewport is sized to the content (Voila scrolls inside
    ``#rendered_cells``), the picture taken, and the viewport put back."""
    before = page.viewport_size
    size = page.evaluate(_CONTENT_SIZE_JS)
    page.set_viewport_size({"width": before["width"], "height": max(before["height"], int(size["height"]) + 16)})
    try:
        page.wait_for_timeout(300)  # a relayout at the new size
        return screenshot(page, name)
    finally:
        page.set_viewport_size(before)


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



# ------------------------------------------------------------------------------------------ the explorer

# ipywidgets 8 renders a slider as
#   div.widget-slider > label.widget-label("batch size") + div.slider-container > div.noUi-target
#       ... div.noUi-handle[role=slider][tabindex=0][aria-valuenow=<option index>]
#   + div.widget-readout (the selected option's label)
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


# The figures: <img> elements inside the explorer with an inline image (ipywidgets.Image -> blob: URL), shown.
_IMAGES_JS = """
(root) => Array.from(root.querySelectorAll('img'))
    .filter(img => /^(data:image\\/|blob:)/.test(img.getAttribute('src') || '') && img.offsetParent !== null)
    .map(img => ({src: img.getAttribute('src'), ok: img.complete && img.naturalWidth > 0,
                  natural: img.naturalWidth, shown: img.getBoundingClientRect().width}))
"""


def plot_images(scope) -> list[dict]:
    return scope.evaluate(_IMAGES_JS)


def loaded_images(scope, timeout_s: float = 5.0) -> list[dict]:
    """The figures once every one has loaded, or as they are after ``timeout_s``: a figure replaced just before the
    progress line said done is still being decoded by the browser for a few milliseconds (``naturalWidth`` 0)."""
    deadline = time.monotonic() + timeout_s
    imgs = plot_images(scope)
    while not all(i["ok"] for i in imgs) and time.monotonic() < deadline:
        time.sleep(0.05)
        imgs = plot_images(scope)
    return imgs


def progress(scope) -> dict:
    """The progress line: {"state": busy|done|error, "setting": "model B=.. hidden=.. quantity", "text": ...}."""
    return scope.evaluate(
        """(root) => {
            const p = root.querySelector('.pergrad-progress');
            return p ? {state: p.dataset.state, setting: p.dataset.setting, text: p.textContent} : {};
        }"""
    )


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


# ------------------------------------------------------------------------------------------ latency


@dataclass(frozen=True)
class Target:
    """What a change must achieve (seconds from the input): the first new figure, and the settled view."""

    name: str
    first_s: float
    settled_s: float


DEFAULTS = Target("defaults", 0.5, 2.0)  # B=32 / hidden 20 and settings of that size
LARGE = Target("B=256/hidden 512", 1.5, 6.0)  # settings with B >= 128 or hidden >= 256


def target_for(setting: str) -> Target:
    """The target class of a ``data-setting`` string such as ``mlp B=256 hidden=512 grads``."""
    values = dict(part.split("=") for part in setting.split() if "=" in part)
    large = int(values.get("B", 0)) >= 128 or int(values.get("hidden", 0)) >= 256
    return LARGE if large else DEFAULTS


@dataclass
class Latency:
    frontend: str
    control: str
    change: str  # e.g. "32 -> 64"
    setting: str  # the setting it ends on (data-setting)
    first_s: float | None  # input -> first new figure shown (None: no figure changes, e.g. a cached view)
    settled_s: float  # input -> everything shown is final (the progress line says measuring or done)
    complete_s: float  # input -> the progress line says done: the slow baselines' rows are in too
    note: str = ""

    @property
    def target(self) -> Target:
        return target_for(self.setting)

    @property
    def met(self) -> bool:
        first_ok = self.first_s is None or self.first_s <= self.target.first_s
        return first_ok and self.settled_s <= self.target.settled_s


RESULTS: list[Latency] = []


def record(row: Latency) -> Latency:
    RESULTS.append(row)
    first = "-" if row.first_s is None else f"{row.first_s:.2f}"
    line = (f"latency {row.frontend} {row.control} {row.change} [{row.setting}]: first figure {first} s, "
            f"settled {row.settled_s:.2f} s (target {row.target.first_s:g} / {row.target.settled_s:g} s: "
            f"{'met' if row.met else 'MISSED'}), every row {row.complete_s:.2f} s{' ' + row.note if row.note else ''}")
    print(line)
    LATENCY_LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LATENCY_LOG, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{line}\n")
    return row


def latency_table(rows: list[Latency]) -> str:
    """The measured latencies as an aligned table (the README's "Explorer latency" section shows one)."""
    head = ("frontend", "control", "change", "ends on", "first figure", "settled", "every row",
            "target (first / settled)", "")
    body = []
    for r in rows:
        first = "-" if r.first_s is None else f"{r.first_s:.2f} s"
        body.append((r.frontend, r.control, r.change, r.setting, first, f"{r.settled_s:.2f} s", f"{r.complete_s:.2f} s",
                     f"{r.target.first_s:g} s / {r.target.settled_s:g} s ({r.target.name})",
                     ("met" if r.met else "MISSED") + (f"; {r.note}" if r.note else "")))
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# In-page probe, installed right before an input: records (performance.now() ms after the install) when the
# first <img> of the explorer shows a new, loaded figure, when the progress line last turned "measuring" or "done"
# (settled: every figure shown is final; the slow baselines' rows still coming are marked) and when it turned
# "done"; at the settled moment, what the page said was still coming (the rows marked, the progress line's text).
_PROBE_JS = """
(root) => {
    if (window.__pvProbe) { window.__pvProbe.stop(); }
    const t0 = performance.now();
    const before = new Map(Array.from(root.querySelectorAll('img')).map(i => [i, i.getAttribute('src')]));
    const probe = {first: null, settled: null, done: null, setting: null, states: [], coming: null};
    const check = () => {
        const now = performance.now() - t0;
        if (probe.first === null) {
            for (const img of root.querySelectorAll('img')) {
                const src = img.getAttribute('src') || '';
                if (/^blob:|^data:image/.test(src) && before.get(img) !== src && img.complete
                        && img.naturalWidth > 0 && img.offsetParent !== null) { probe.first = now; break; }
            }
        }
        const p = root.querySelector('.pergrad-progress');
        if (p) {
            const key = p.dataset.state + ' ' + p.dataset.setting;
            if (probe.states[probe.states.length - 1] !== key) probe.states.push(key);
            const final = p.dataset.state === 'done' || p.dataset.state === 'error';
            if (final || p.dataset.state === 'measuring') {
                if (probe.settled === null || probe.setting !== p.dataset.setting) {
                    probe.settled = now;
                    probe.coming = {state: p.dataset.state, text: p.textContent,
                                    rows: Array.from(root.querySelectorAll('tr.pergrad-coming'))
                                        .map(tr => tr.dataset.method)};
                }
                if (final && (probe.done === null || probe.setting !== p.dataset.setting)) probe.done = now;
                if (!final) probe.done = null;
                probe.setting = p.dataset.setting;
            } else { probe.settled = null; probe.done = null; probe.setting = p.dataset.setting; }
        }
    };
    const observer = new MutationObserver(check);
    observer.observe(root, {subtree: true, childList: true, attributes: true, characterData: true});
    const timer = setInterval(check, 15);
    probe.stop = () => { observer.disconnect(); clearInterval(timer); };
    window.__pvProbe = probe;
    check();
    probe.settled = null;
    probe.done = null;
}
"""


def _probe(scope) -> dict:
    return scope.evaluate("() => { const p = window.__pvProbe; return {first: p.first, settled: p.settled, "
                          "done: p.done, setting: p.setting, states: p.states, coming: p.coming}; }")


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


def wait_done(ui: Ui, timeout_s: float = WIDGETS_MS / 1000) -> dict:
    """Wait until the explorer's progress line says done; returns it. An error state fails at once, with what
    the explorer shows (its error box included)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = progress(ui.scope)
        if state.get("state") == "error":
            raise AssertionError(f"the explorer shows an error ({state.get('text')!r}):\n"
                                 f"{explorer_text(ui.scope)[:3000]}")
        if state.get("state") == "done":
            return state
        time.sleep(0.1)
    raise TimeoutError(f"the explorer did not finish within {timeout_s:.0f} s: {progress(ui.scope)}")


def measure(ui: Ui, control: str, change: str, act, expect: str | None = None, timeout_s: float = CHANGE_S,
            note: str = "") -> Latency:
    """Install the in-page probe, ``act()`` (one input, as a user gives it), wait for the settled view and record
    the latencies. ``expect``: the ``data-setting`` the view must end on (else whatever it ends on)."""
    wait_done(ui)
    ui.scope.evaluate(_PROBE_JS)
    act()
    deadline = time.monotonic() + timeout_s
    while True:
        probe = _probe(ui.scope)
        if probe["done"] is not None and (expect is None or probe["setting"] == expect):
            time.sleep(0.3)  # a late message (a stale setting's) would show now
            again = _probe(ui.scope)
            if again["done"] == probe["done"] and again["setting"] == probe["setting"]:
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"{control} {change}: not settled within {timeout_s:.0f} s (states seen: "
                                 f"{probe['states']}); the explorer reads:\n{explorer_text(ui.scope)[-1500:]}")
        time.sleep(0.05)
    state = progress(ui.scope)
    assert state["state"] == "done", f"{control} {change}: the explorer shows an error: {explorer_text(ui.scope)}"
    coming = probe["coming"]
    if coming["state"] == "measuring":  # settled before done: what is still coming must say so on the page
        assert "still timing the slower methods" in coming["text"], coming
        named = [m for m in ("loop", "autograd_stack", "batched_grad", "torch_func") if m in coming["text"]]
        assert set(named) <= set(coming["rows"]), f"{control} {change}: rows named as coming not marked: {coming}"
    first = None if probe["first"] is None else probe["first"] / 1000
    return record(Latency(ui.frontend, control, change, probe["setting"], first, probe["settled"] / 1000,
                          probe["done"] / 1000, note))


def press(ui: Ui, label: str, key: str, times: int = 1):
    """An input: focus the slider's handle and press ``key`` (``times`` times, as fast as a user can)."""

    def act():
        handle = slider_handle(ui.scope, label)
        handle.focus()
        for _ in range(times):
            handle.press(key)

    return act


def verdict(scope) -> dict:
    """The explorer's verdict: {"ok": "true"/"false", "word": "agree"/"DISAGREE"} ({} before it is shown), the
    error boxes shown, and the notes shown by kind ({"noisy": [...], "provisional": [...], "skipped": [...]})."""
    return scope.evaluate(
        """(root) => {
            const v = root.querySelector('.pergrad-verdict');
            const shown = (e) => e.offsetParent !== null && e.textContent.trim() !== '';
            const notes = {};
            for (const n of root.querySelectorAll('.pergrad-note')) {
                (notes[n.dataset.kind] = notes[n.dataset.kind] || []).push(n.textContent.trim());
            }
            return {ok: v ? v.dataset.ok : null, word: v ? v.textContent.trim() : null, notes: notes,
                    errors: Array.from(root.querySelectorAll('.pergrad-error')).filter(shown)
                        .map(e => e.textContent.trim())};
        }"""
    )


def check_renders(ui: Ui) -> None:
    """The explorer shows its controls and six figures, has finished ("done", not "error"), shows no error box, and
    says that the results agree with the loop."""
    from playwright.sync_api import expect

    with step(ui.page, ui.server, "explorer renders"):
        for label in SLIDERS:
            expect(slider(ui.scope, label), f"slider {label!r}").to_be_visible()
            readout = slider_readout(ui.scope, label)
            assert readout.replace(".", "").isdigit(), f"slider {label!r} reads {readout!r}, expected a number"
        state = wait_done(ui)
        assert state.get("state") == "done", f"the explorer has not finished: {state}"
        shown = verdict(ui.scope)
        assert shown["errors"] == [], f"the explorer shows an error box: {shown['errors']}"
        assert shown["ok"] == "true" and shown["word"] == "agree", (
            f"the verdict reads {shown['word']!r}, expected 'agree':\n{explorer_text(ui.scope)[:2000]}")
        imgs = loaded_images(ui.scope)
        for _ in range(75):  # a figure replaced just now decodes in its own time (seconds on a loaded machine)
            if len(imgs) >= 6 and all(i["ok"] for i in imgs):
                break
            ui.page.wait_for_timeout(200)
            imgs = loaded_images(ui.scope)
        assert len(imgs) >= 6, f"expected the explorer's six figures, found {len(imgs)}: {imgs}"
        assert all(i["ok"] for i in imgs), f"a figure is not loaded: {imgs}"
    screenshot(ui.page, f"{ui.frontend}-rendered", ui.scope)


QUIET_LOAD = 0.5  # load average per CPU below which the machine counts as quiet


def machine_load() -> float:
    """The 1-minute load average per CPU this process may use (0 where unknown)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    try:
        return os.getloadavg()[0] / cpus
    except OSError:
        return 0.0


def check_calm_timing(ui: Ui) -> str:
    """At the defaults, no timing is flagged noisy on a quiet machine (:data:`QUIET_LOAD`); on a busy one the flags
    are honest, so they are reported, not asserted. Returns a line saying which it was (also logged to
    test-artifacts/e2e/timing-calm.txt, with the number of noisy notes: read that, as the load this check sees
    includes the browser's and the server's own)."""
    shown = verdict(ui.scope)
    noisy = shown["notes"].get("noisy", [])
    load = machine_load()
    rows = ui.scope.evaluate(
        """(root) => Array.from(root.querySelectorAll('table:not(.pergrad-layers) tbody tr'))
            .map(tr => Array.from(tr.querySelectorAll('td')).slice(0, 3).map(td => td.textContent.trim()))"""
    )
    spreads = ", ".join(f"{m} {median} (IQR {iqr})" for m, median, iqr in rows if median != "-")
    line = (f"{ui.frontend} at the defaults: load {load:.2f} per CPU, noisy notes: {len(noisy)}, provisional: "
            f"{len(shown['notes'].get('provisional', []))}; {spreads}")
    print(line)
    with open(artifact("timing-calm.txt"), "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{line}\n")
    if load <= QUIET_LOAD and noisy:
        # Since explorers in one kernel take turns (explorer/worker.py), a quiet machine shows the note in about
        # 1 load of 12 (one method's spread, e.g. autograd_stack IQR 2.8 ms on 5.2 ms): reported as an expected
        # failure, visible in the summary, rather than failing make test by chance. Issue 19.
        import pytest

        pytest.xfail(f"a quiet machine (load {load:.2f} per CPU) shows a noisy flag (about 1 load in 12): {noisy}")
    return line


def check_figures_at_natural_size(ui: Ui) -> None:
    """Every figure is shown at the size it was drawn (not stretched into blur): CSS width = pixel width."""
    imgs = loaded_images(ui.scope)
    stretched = [i for i in imgs if abs(i["shown"] - i["natural"]) > 1]
    assert not stretched, f"figures shown at another size than drawn (natural vs shown px): {stretched}"


def check_kernel_python(server: Server) -> None:
    """The kernels the server started run a python of this environment (the one running pytest), which
    imports pergrad_viz from here. Linux only (reads /proc); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    cmds = kernel_commands(server.env["PERGRAD_E2E_MARKER"])
    assert cmds, f"no ipykernel process found under the {server.name} server"
    here = Path(sys.executable).parent.resolve()
    assert all(Path(c[0]).parent.resolve() == here for c in cmds), f"kernels {cmds} do not run a python of {here}"


def run_latency_script(ui: Ui) -> list[Latency]:
    """Each control once at the defaults' size (and back: a view reused from the cache), five quick moves, the
    sample and clipping sliders, then the largest setting (B=256, hidden 512). Returns the rows recorded."""
    rows = []
    grads = "grads"
    with step(ui.page, ui.server, "latency: batch size"):
        rows.append(measure(ui, "batch size", "32 -> 64", press(ui, "batch size", "ArrowRight"),
                            f"mlp B=64 hidden=20 {grads}"))
        rows.append(measure(ui, "batch size", "64 -> 32", press(ui, "batch size", "ArrowLeft"),
                            f"mlp B=32 hidden=20 {grads}", note="back to a setting seen: timings reused"))
    with step(ui.page, ui.server, "latency: hidden width"):
        rows.append(measure(ui, "hidden width", "20 -> 32", press(ui, "hidden width", "ArrowRight"),
                            f"mlp B=32 hidden=32 {grads}"))
        rows.append(measure(ui, "hidden width", "32 -> 20", press(ui, "hidden width", "ArrowLeft"),
                            f"mlp B=32 hidden=20 {grads}", note="back to a setting seen: timings reused"))
    with step(ui.page, ui.server, "latency: quantity"):
        toggle = ui.scope.get_by_role("button", name="output Jacobian")
        rows.append(measure(ui, "quantity", "-> output Jacobian", toggle.click, "mlp B=32 hidden=20 jacobian"))
        back = ui.scope.get_by_role("button", name="per-sample gradients")
        rows.append(measure(ui, "quantity", "-> per-sample gradients", back.click, f"mlp B=32 hidden=20 {grads}",
                            note="timings reused"))
    with step(ui.page, ui.server, "latency: strategy checkbox"):
        box = ui.scope.get_by_role("checkbox", name="torch_func")
        rows.append(measure(ui, "strategy", "untick torch_func", box.click, f"mlp B=32 hidden=20 {grads}",
                            note="timings reused"))
        rows.append(measure(ui, "strategy", "tick torch_func", box.click, f"mlp B=32 hidden=20 {grads}",
                            note="timings reused"))
    with step(ui.page, ui.server, "latency: sample and clipping sliders"):
        rows.append(measure(ui, "sample", "0 -> 1", press(ui, "sample", "ArrowRight"), f"mlp B=32 hidden=20 {grads}"))
        rows.append(measure(ui, "clipping C", "one step up", press(ui, "clipping threshold C", "ArrowRight"),
                            f"mlp B=32 hidden=20 {grads}"))
    with step(ui.page, ui.server, "latency: five quick moves"):
        # 32 -> 16 -> 8 -> 4 -> 8 -> 4 as fast as the keyboard goes: the view must end on B=4, within its target
        def five():
            handle = slider_handle(ui.scope, "batch size")
            handle.focus()
            for key in ("ArrowLeft", "ArrowLeft", "ArrowLeft", "ArrowRight", "ArrowLeft"):
                handle.press(key)

        rows.append(measure(ui, "batch size", "five quick moves 32 -> 4", five, f"mlp B=4 hidden=20 {grads}",
                            note="the last setting wins"))
        assert slider_readout(ui.scope, "batch size") == "4"
    with step(ui.page, ui.server, "latency: the largest setting"):
        rows.append(measure(ui, "batch size", "4 -> 256 (End)", press(ui, "batch size", "End"),
                            f"mlp B=256 hidden=20 {grads}"))
        rows.append(measure(ui, "hidden width", "20 -> 512 (End)", press(ui, "hidden width", "End"),
                            f"mlp B=256 hidden=512 {grads}"))
        check_figures_at_natural_size(ui)
        text = explorer_text(ui.scope)
        assert "batch size B=256, hidden width 512" in text, text[-1500:]
        assert "skipped as too slow" in text, "the slow baselines' skip note is not shown at B=256"
    screenshot(ui.page, f"{ui.frontend}-largest", ui.scope)
    return rows


# The built-in menu as the dropdown shows it: (key, the dropdown's text, the width slider's label, default width)
MENU = (("cnn", "small CNN: conv -> GroupNorm -> conv -> linear", "channels", 8),
        ("transformer", "transformer encoder on 16 image tokens", "d_model", 32),
        ("lstm", "LSTM classifier on 16 image tokens", "hidden size", 32),
        ("vit-lora", "tiny ViT with LoRA adapters (Hugging Face + peft)", "LoRA rank", 8),
        ("mlp", "tutorial MLP: 784 -> hidden -> 10", "hidden width", 20))


def run_model_menu(ui: Ui, screenshots: bool = False) -> list[Latency]:
    """Each network of the menu from the dropdown, at its default size (B=32): its latency (a row per model), the
    panels re-drawn for it (the width slider's label, the rule text, the layer table), the verdict 'agree'; back to
    the MLP last. ``screenshots``: a full-page picture of the dashboard for each network."""
    rows = []
    previous = "mlp"
    for key, title, width_label, width in MENU:
        with step(ui.page, ui.server, f"model menu: {key}"):
            select = ui.scope.locator(".widget-dropdown select").first
            rows.append(measure(ui, "model", f"{previous} -> {key}",
                                lambda t=title, s=select: s.select_option(label=t), f"{key} B=32 hidden={width} grads",
                                note="back to the first network: timings reused" if key == "mlp"
                                else "first visit: the network built and timed"))
            slider(ui.scope, width_label).first.wait_for(timeout=10_000)
            assert slider_readout(ui.scope, width_label) == str(width)
            shown = verdict(ui.scope)
            assert shown["ok"] == "true" and shown["errors"] == [], explorer_text(ui.scope)[:2000]
            text = explorer_text(ui.scope)
            assert "per-sample gradients by" in text and "How the fast rule works" in text, text[:2000]
            imgs = loaded_images(ui.scope)
            assert len(imgs) >= 6 and all(i["ok"] for i in imgs), imgs
            if screenshots:
                full_page_screenshot(ui.page, f"{ui.frontend}-model-{key}")
            else:
                screenshot(ui.page, f"{ui.frontend}-model-{key}", ui.scope)
        previous = key
    return rows
