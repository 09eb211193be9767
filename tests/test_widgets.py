"""The explorer's callbacks, driven from code as a slider move would (no kernel, no browser; Agg backend).

One small explorer is shared by the tests (batch sizes 1..8, hidden widths 8/16, tiny timing budget); each
test first puts it in the state it needs with ``Explorer.set`` (which refreshes only if that changes anything:
the tests are ordered so that most start where the previous one left off).
"""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

import ipywidgets as w  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import pergrad_viz as pv  # noqa: E402
from pergrad_viz import bench, widgets  # noqa: E402

SLOW = ("loop", "autograd_stack", "batched_grad")


@pytest.fixture(scope="module")
def ex():
    return widgets.explorer(batch_sizes=(1, 2, 4, 8), hidden_widths=(8, 16), default_batch=4, default_hidden=8,
                            min_run_time=1e-3, sweep_batches=2, slow_limit=16, dpi=30)


@pytest.fixture
def fresh(ex):
    ex.set(batch=4, hidden=8, quantity="grads", strategies=list(pv.STRATEGIES))
    assert ex.error == ""
    return ex


def settings(records) -> set[tuple[str, int, int]]:
    return {(r.quantity, r.batch_size, r.hidden) for r in records}


def test_controls(ex):
    assert isinstance(ex, w.VBox)
    assert ex.batch_slider.description == "batch size" and ex.hidden_slider.description == "hidden width"
    for s in (ex.batch_slider, ex.hidden_slider, ex.sample_slider):
        assert s.continuous_update is False
    assert ex.batch_slider.options == (1, 2, 4, 8) and ex.hidden_slider.options == (8, 16)
    assert ex.sample_slider.description == "sample"
    assert list(ex.strategy_boxes) == list(pv.STRATEGIES)
    assert all(isinstance(b, w.Checkbox) for b in ex.strategy_boxes.values())
    assert dict(ex.quantity_toggle.options) == {"per-sample gradients": "grads", "output Jacobian": "jacobian"}


def test_default_hidden_width_joins_the_options():
    ex = widgets.explorer(hidden_widths=(8, 16, 32), default_hidden=20, compute=False)
    assert ex.hidden_slider.options == (8, 16, 20, 32) and ex.hidden_slider.value == 20
    with pytest.raises(ValueError, match="unknown strategies"):
        widgets.explorer(strategies=("loop", "nope"), compute=False)


def images_shown(ex) -> list[w.Image]:
    found, todo = [], [ex]
    while todo:
        widget = todo.pop()
        if isinstance(widget, w.Image):
            found.append(widget)
        todo.extend(getattr(widget, "children", ()))
    return found


def test_renders_png_images_and_table(fresh):
    shown = images_shown(fresh)
    assert {id(i) for i in shown} == {id(fresh.runtime_image), id(fresh.bar_image), id(fresh.heatmap_image),
                                      id(fresh.images_image)}
    assert all(i.format == "png" and bytes(i.value).startswith(b"\x89PNG") for i in shown)
    assert "<table" in fresh.table_html.value and "vs loop" in fresh.table_html.value
    assert fresh.busy.value == ""
    assert plt.get_fignums() == []  # nothing registered with pyplot: no figure leaks


def test_verification_line_small(fresh):
    first = fresh.status.splitlines()[0]
    assert first.startswith("max |difference| between strategies:")
    diff = float(re.search(r"([0-9.]+e[-+][0-9]+)", fresh.status).group(1))  # as notebook 03 reads it
    assert diff < 1e-4 and diff == pytest.approx(fresh.max_difference, rel=0.06, abs=1e-12)
    assert "float32" in first
    assert "skipped" not in fresh.status  # B=4 <= slow_limit: everything timed


def test_sample_slider_redraws_images_only(fresh):
    drawn, images, records = fresh.figures_drawn, fresh.images_image.value, fresh.records
    fresh.sample_slider.value = 3
    assert fresh.images_image.value != images
    assert fresh.figures_drawn == drawn and fresh.records is records


def test_batch_size_change_recomputes(fresh):
    drawn, chart = fresh.figures_drawn, fresh.runtime_image.value
    fresh.batch_slider.value = 8
    assert settings(fresh.records) == {("grads", 8, 8)}
    assert fresh.figures_drawn == drawn + 1 and fresh.runtime_image.value != chart
    assert {r.batch_size for r in fresh.scaling_records} == {1, 8}  # the scaling curve
    assert fresh.sample_slider.max == 7
    assert "B=8" in fresh.table_html.value


def test_skip_note_above_slow_limit(ex):
    fresh = ex
    fresh.set(batch=8, hidden=8, quantity="grads", strategies=list(pv.STRATEGIES))  # as the test above left it
    # B=8: the loop pushes 8 samples through backward passes, the other two 8 x 8 = 64 > slow_limit=16
    assert {r.strategy for r in fresh.records if r.skipped} == {"autograd_stack", "batched_grad"}
    note = fresh.status.splitlines()[1]
    assert note.startswith("skipped as too slow") and all(n in note for n in ("autograd_stack", "batched_grad"))
    assert "slow_limit=16" in note and "skipped" in fresh.status_html.value
    assert fresh.status.splitlines()[0].startswith("max |difference|")  # torch_func vs hooks still compared


def test_hidden_width_change_recomputes(fresh):
    drawn = fresh.figures_drawn
    fresh.hidden_slider.value = 16
    assert settings(fresh.records) == {("grads", 4, 16)}
    assert fresh.figures_drawn == drawn + 1


def test_quantity_toggle_gives_jacobian_records(fresh):
    drawn = fresh.figures_drawn
    fresh.quantity_toggle.value = "jacobian"
    assert settings(fresh.records) == {("jacobian", 4, 8)}
    assert fresh.figures_drawn == drawn + 1
    # B x Y = 40 sample-backward passes > slow_limit=16: the slow baselines are skipped, and the explorer says so
    assert {r.strategy for r in fresh.records if r.skipped} == set(SLOW)
    assert "skipped" in fresh.status and all(name in fresh.status for name in SLOW)
    assert fresh.max_difference is not None and fresh.max_difference < 1e-4


def test_unchecking_a_strategy_removes_it(fresh):
    fresh.strategy_boxes["torch_func"].value = False
    assert "torch_func" not in {r.strategy for r in fresh.records}
    assert "torch_func" not in {r.strategy for r in fresh.scaling_records}
    assert {"loop", "hooks", bench.FORWARD_BACKWARD} <= {r.strategy for r in fresh.records}


def test_errors_are_shown_and_the_ui_keeps_working(fresh, monkeypatch):
    busy_while_computing = []

    def too_big(*args, **kwargs):
        busy_while_computing.append(fresh.busy.value)
        raise pv.MemoryBudgetError("would need about 9.00 GiB; use a smaller batch")

    monkeypatch.setattr(bench, "sweep", too_big)
    fresh.batch_slider.value = 8  # no exception escapes the callback
    assert "MemoryBudgetError" in fresh.error and "smaller batch" in fresh.error
    assert "MemoryBudgetError" in fresh.error_html.value and fresh.busy.value == ""
    assert len(busy_while_computing) == 1 and "computing…" in busy_while_computing[0]
    monkeypatch.undo()
    fresh.batch_slider.value = 2
    assert fresh.error == "" and fresh.error_html.value == ""
    assert settings(fresh.records) == {("grads", 2, 8)}


def test_memory_estimate_refuses_before_allocating(fresh, monkeypatch):
    monkeypatch.setattr(widgets, "available_bytes", lambda device: 1000)
    monkeypatch.setattr(bench, "sweep", lambda *a, **k: pytest.fail("sweep ran despite the estimate"))
    fresh.hidden_slider.value = 16
    assert "MemoryBudgetError" in fresh.error and "Choose a smaller batch size" in fresh.error
