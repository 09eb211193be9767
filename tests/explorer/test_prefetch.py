"""The explorer's imports ahead (pergrad_viz.explorer.prefetch): paused while an explorer works, never a reason for
anyone to wait. Each test imports a small package of its own, written to a temporary folder (two modules, the first
importing the second), in a fresh Prefetch (not the process's one)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from pergrad_viz.explorer import prefetch
from pergrad_viz.explorer.worker import TURN

WAIT_S = 30.0


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``pvpre_<n>`` of two modules: ``first`` imports ``second``; returns the dotted names."""
    name = f"pvpre_{time.monotonic_ns()}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "first.py").write_text(f"from {name} import second\nVALUE = second.VALUE + 1\n")
    (root / "second.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}.first", f"{name}.second"
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def test_it_imports_in_order_once_no_explorer_works(package):
    first, second = package
    ahead = prefetch.Prefetch([first])
    assert ahead.done.wait(WAIT_S) and not ahead.failed
    assert sys.modules[first].VALUE == 42 and second in sys.modules
    assert ahead not in sys.meta_path  # its pause point goes with it


def test_it_waits_while_an_explorer_works(package):
    first, second = package
    with TURN:  # an explorer's job is running
        ahead = prefetch.Prefetch([first])
        time.sleep(10 * prefetch.POLL_S)
        assert not ahead.done.is_set() and second not in sys.modules  # paused at the package's first module
    assert ahead.done.wait(WAIT_S) and sys.modules[first].VALUE == 42


def test_a_thread_that_needs_a_paused_module_never_waits_on_the_pause(package):
    """The job that needs the modules (here another thread importing the same one) gets them: the paused imports
    go on while someone waits in the import system."""
    first, _second = package
    got = {}
    with TURN:
        ahead = prefetch.Prefetch([first])
        time.sleep(10 * prefetch.POLL_S)
        assert not ahead.done.is_set()  # paused, holding the lock of the package it is importing
        job = threading.Thread(target=lambda: got.setdefault("value", __import__(first, fromlist=["VALUE"]).VALUE))
        job.start()
        job.join(WAIT_S)
        assert not job.is_alive() and got == {"value": 42}
    assert ahead.done.wait(WAIT_S)


def test_a_module_that_fails_is_left_and_the_rest_imported(package):
    first, _second = package
    ahead = prefetch.Prefetch(["pvpre_no_such_module", first])
    assert ahead.done.wait(WAIT_S)
    assert list(ahead.failed) == ["pvpre_no_such_module"] and sys.modules[first].VALUE == 42


def test_the_process_starts_it_once_and_only_for_what_is_missing(monkeypatch, package):
    first, _second = package
    monkeypatch.setattr(prefetch, "STARTED", [])
    assert prefetch.start(["sys", "os"]) is None  # all imported already: nothing started
    with TURN:  # an explorer works: the imports wait
        ahead = prefetch.start([first])
        assert ahead is not None and prefetch.start(["pvpre_other"]) is ahead  # one at a time
    assert ahead.done.wait(WAIT_S) and ahead.modules == (first,)
    # a review: an explorer that started the imports of torch's lazy module alone kept a later one's libraries from
    # being imported ahead; once the first is done, a start for what is still missing starts again
    later = prefetch.start([first, "pvpre_no_such_module_either"])
    assert later is not ahead and later.modules == ("pvpre_no_such_module_either",)
    assert later.done.wait(WAIT_S)
    assert prefetch.start([first, "pvpre_no_such_module_either"]) is later  # a module that failed: not tried again


def test_an_import_passing_through_does_not_end_the_pause(package):
    """A job's ``from package import name`` of what is imported already (the import system's code runs, nothing
    waits) leaves the imports paused."""
    first, second = package
    with TURN:
        ahead = prefetch.Prefetch([first])
        deadline = time.monotonic() + 20 * prefetch.POLL_S
        while time.monotonic() < deadline:
            from email import message  # noqa: F401  (a package: the import system's _handle_fromlist runs)
        assert not ahead.done.is_set() and second not in sys.modules
    assert ahead.done.wait(WAIT_S)


def test_an_explorer_imports_what_a_jacobians_first_call_would_wait_for(monkeypatch):
    """torch imports sympy (0.3 s) at the first autograd.grad given grad_outputs: the first view of the Jacobian
    waited for it (0.62 s to the first figure, against a 0.5 s target). The explorer imports it ahead, after its
    first setting is shown, as it does the menu's libraries."""
    import matplotlib

    matplotlib.use("Agg")
    from pergrad_viz import widgets

    started: list[list[str]] = []
    monkeypatch.setattr(prefetch, "start", lambda modules: started.append(list(modules)))
    ex = widgets.explorer(models=("mlp",), strategies=("hooks",), batch_sizes=(1, 2), default_batch=2,
                          hidden_widths=(8,), default_hidden=8, rounds=1, sweep_batches=1, threads=1, ahead=False,
                          min_rounds=1, min_block_s=1e-4, tier_budget_s=0.05)
    try:
        assert ex.wait(60) and ex.view.done
    finally:
        ex.close()
    assert started and started[0][0] == "torch.fx.experimental.symbolic_shapes" == prefetch.TORCH_LAZY[0]
