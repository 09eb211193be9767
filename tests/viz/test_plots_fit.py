"""Every title, label and annotation stays inside its figure; the explorer's new panels show what they claim."""

from __future__ import annotations

import math
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import outside  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from pergrad_viz import viz  # noqa: E402
from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR, Record  # noqa: E402

LONG = "per-sample gradients at batch size B=256, hidden width 512: a title long enough to need two lines or more"


def texts_outside(fig: Figure) -> list[str]:
    """Every text artist drawn (titles, labels, annotations, legend entries, colour bar labels) whose box reaches
    beyond the figure. Tick labels are left to :func:`outside` (an axes' tight box holds the ticks it draws;
    matplotlib keeps labels of ticks beyond the view limits that it never draws)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    ticks = {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()] for label in (tick.label1, tick.label2)}
    bad = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or t.figure is None or id(t) in ticks:
            continue
        box = t.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            bad.append(f"{t.get_text()[:40]!r}: {box.x0:.0f}..{box.x1:.0f} x {box.y0:.0f}..{box.y1:.0f} "
                       f"(figure {width:.0f} x {height:.0f})")
    return bad


def records(batch: int = 256, hidden: int = 512) -> list[Record]:
    def rec(name, median, **kw):
        return Record(name, "grads", batch, hidden, median, None if median is None else median / 5, 10**8, **kw)

    return [rec("hooks", 0.17, speedup_vs_loop=2.2), rec("torch_func", 0.6, speedup_vs_loop=0.61),
            rec("loop", 0.37, speedup_vs_loop=1.0), rec(FORWARD_BACKWARD, 0.006, speedup_vs_loop=61.0),
            rec(MEMORY_FLOOR, 0.03, speedup_vs_loop=12.0),
            rec("autograd_stack", None, note="skipped: 65,536 sample-backward passes > slow_limit=1,024"),
            rec("batched_grad", None, note="skipped: 65,536 sample-backward passes > slow_limit=1,024")]


def figures() -> dict[str, Callable[[], Figure]]:
    """Each figure as a function that draws it (only the one a test asks for is drawn)."""
    rng = np.random.default_rng(0)
    sweep = [Record(n, "grads", b, 512, 1e-3 * b * k, 1e-4, 1000, note="") for b in (1, 16, 256)
             for k, n in enumerate(["loop", "autograd_stack", "torch_func", "hooks", FORWARD_BACKWARD], 1)]
    sweep += [Record("batched_grad", "grads", 256, 512, None, None, 1000, note="skipped: too slow")]
    bounds = [("fc1.weight", 0, 401408), ("fc1.bias", 401408, 401920), ("fc2.weight", 401920, 407040),
              ("fc2.bias", 407040, 407050)]
    small = [("fc1.weight", 0, 39200), ("fc1.bias", 39200, 39250), ("fc2.weight", 39250, 39750),
             ("fc2.bias", 39750, 39760)]  # hidden width 50
    return {
        "bars": lambda: viz.bar_figure(records(), title=LONG, noisy=("torch_func",)),
        "bars pending": lambda: viz.bar_figure(records()[:2], pending=("loop", FORWARD_BACKWARD), title=LONG),
        "runtime": lambda: viz.runtime_figure(sweep, highlight=256, title=LONG, width=6.4, height=3.4),
        "heatmap": lambda: viz.gradient_heatmap(rng.normal(size=(16, 407050)).astype(np.float32), bounds, title=LONG,
                                          max_cols=600),
        "heatmap rows": lambda: viz.gradient_heatmap(rng.normal(size=(10, 1000)), [("w", 0, 1000)], title=LONG,
                                               row_labels=["T-shirt/top", "Ankle boot", *"abcdefgh"]),
        "images": lambda: viz.first_layer_images(rng.normal(size=(9, 784)), image=rng.normal(size=784), suptitle=LONG,
                                           titles=[f"unit {k}" for k in range(9)], image_title="input (Ankle boot)"),
        "rule": lambda: viz.outer_product_figure(rng.normal(size=784), rng.normal(size=512), gradient_norm=3.0,
                                                   title=LONG),
        "clip": lambda: viz.clipping_figure(rng.gamma(2, 10, 256), {"fc1": rng.gamma(2, 9, 256),
                                                                      "fc2": rng.gamma(2, 3, 256)},
                                              20.0, sums=(480.0, 95.0), title=LONG, width=8.0),
        "histogram": lambda: viz.norm_histogram(rng.gamma(2, 1, 256), rng.gamma(2, 0.4, 256), 1.0),
        # as the explorer draws them (explorer/view.py WIDTHS)
        "explorer bars": lambda: viz.bar_figure(records(), title=LONG, noisy=("torch_func",), provisional=("hooks",),
                                          width=6.3),
        "explorer runtime": lambda: viz.runtime_figure(sweep, highlight=256, title=LONG, width=7.0, height=3.6,
                                                 legend="below"),
        "explorer heatmap": lambda: viz.gradient_heatmap(rng.normal(size=(256, 39760)).astype(np.float32), small,
                                                   title=LONG, figsize=(7.4, 3.4), highlight_row=255,
                                                   max_cols=560),
        "explorer images": lambda: viz.first_layer_images(rng.normal(size=(9, 784)), image=rng.normal(size=784),
                                                    suptitle=LONG, titles=[f"unit {k}" for k in range(9)],
                                                    image_title="input (Ankle boot)", cell=1.15),
        "explorer rule": lambda: viz.outer_product_figure(rng.normal(size=784), rng.normal(size=512),
                                                            gradient_norm=3.0, title=LONG, width=6.9),
        "explorer factors": lambda: viz.factor_figure(rng.normal(size=(16, 16)), rng.normal(size=(16, 32)),
                                                        rng.normal(size=(16, 32)), names=(LONG[:60], LONG[:50], "x"),
                                                        gradient_norm=1.0, difference=1e-8, title=LONG, width=6.9),
        "explorer tokens": lambda: viz.token_figure(rng.integers(0, 16, 16), rng.normal(size=(10, 16)), grid=(4, 4),
                                                      row_labels=["T-shirt/top", "Ankle boot", *"abcdefgh"],
                                                      title=LONG, matrix_title="m", xlabel="x", width=7.4),
        "explorer clip": lambda: viz.clipping_figure(rng.gamma(2, 10, 256), {"fc1": rng.gamma(2, 9, 256),
                                                                       "fc2": rng.gamma(2, 3, 256)},
                                               20.0, sums=(480.0, 95.0), title=LONG, width=6.5),
    }


@pytest.mark.parametrize("name", list(figures()))
def test_text_fits_inside_the_figure(name):
    fig = figures()[name]()
    assert outside(fig) == [], name
    assert texts_outside(fig) == [], name


def test_skipped_notes_stay_inside_the_axes():
    fig = viz.bar_figure(records(), title=LONG, width=6.3)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    box = ax.get_window_extent(canvas.get_renderer())
    notes = [t for t in ax.texts if t.get_text().startswith("skipped")]
    assert len(notes) == 2
    for t in notes:
        extent = t.get_window_extent(canvas.get_renderer())
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, (t.get_text(), extent, box)
        assert t.get_fontsize() >= 8  # readable: not the ~7 px it was


def test_runtime_legend_below_leaves_the_plot_its_width():
    sweep = [Record(n, "grads", b, 20, 1e-3 * b * k, 1e-4, 1000) for b in (1, 16, 256)
             for k, n in enumerate(["loop", "torch_func", "hooks", FORWARD_BACKWARD, MEMORY_FLOOR], 1)]
    sweep += [Record(n, "grads", 256, 20, None, None, 1000, note="skipped") for n in ("autograd_stack",
                                                                                      "batched_grad")]
    sweep += [Record(n, "grads", b, 20, 1e-3, 1e-4, 1000) for b in (1, 16) for n in ("autograd_stack",
                                                                                    "batched_grad")]
    fig = viz.runtime_figure(sweep, width=7.0, height=3.6, legend="below",
                               title="per-sample gradients: time vs batch size at hidden width 20 (dotted: B=256)")
    ax = fig.axes[0]
    assert ax.get_position().width * 7.0 > 5.5  # the axes keep most of the width
    assert ax.get_title().count("\n") <= 1  # at most two lines
    assert "autograd_stack (skipped above B=16)" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="legend"):
        viz.runtime_figure(sweep, legend="left")


def test_the_threshold_is_named_in_the_legend_not_on_a_bar():
    rng = np.random.default_rng(1)
    fig = viz.clipping_figure(rng.gamma(2, 10, 32), {"fc1": rng.gamma(2, 9, 32)}, 20.0)
    top = fig.axes[0]
    assert not [t for t in top.texts if "C =" in t.get_text()]
    assert "the threshold C = 20" in [t.get_text() for t in top.get_legend().get_texts()]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    legend = top.get_legend().get_window_extent(canvas.get_renderer())
    bars = [p.get_window_extent(canvas.get_renderer()) for p in top.patches if p.get_height() > 0]
    assert not [b for b in bars if b.overlaps(legend)], "the legend covers a bar"


def test_hidden_units_are_labelled_with_whole_numbers():
    fig = viz.outer_product_figure(torch.rand(784), torch.randn(20), width=6.9)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    outer = next(ax for ax in fig.axes if ax.images and ax.images[0].get_array().shape == (20, 784))
    signal = next(ax for ax in fig.axes if ax.get_xlabel() == "hidden unit")
    for ticks in ([t for t in outer.get_yticks() if -0.5 <= t <= 19.5], [t for t in signal.get_xticks()
                                                                         if -0.5 <= t <= 19.5]):
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_chosen_sample_is_marked_at_any_batch_size():
    fig = viz.gradient_heatmap(np.random.default_rng(0).normal(size=(128, 500)), highlight_row=77,
                                 figsize=(7.4, 3.4))
    ax = fig.axes[0]
    marks = [line for line in ax.get_lines() if line.get_marker() in (">", "<")]
    assert len(marks) == 2 and all(list(line.get_ydata()) == [77.5] for line in marks)
    assert all(line.get_markersize() >= 6 for line in marks)


def test_durations_and_ratios_read_as_people_write_them():
    assert viz.fmt_ratio(1930.4) == "1,930x" and viz.fmt_ratio(89.44) == "89.4x"
    assert viz.fmt_ratio(0.6684) == "0.668x"
    assert viz.fmt_seconds(939e-9) == "939 ns" and viz.fmt_seconds(9.57e-5) == "95.7 µs"
    assert viz.fmt_seconds(0.0137) == "13.7 ms" and viz.fmt_seconds(1.5) == "1.5 s"
    assert viz.fmt_seconds(-0.001) == viz.fmt_seconds(float("nan")) == viz.fmt_ratio(float("nan")) == "-"  # not times
    assert viz.fmt_ratio(float("inf")) == viz.fmt_ratio(-1.0) == "-"


def test_bar_figure_pending_rows_and_noisy_note():
    fig = viz.bar_figure(records()[:2], pending=("loop", FORWARD_BACKWARD), noisy=("hooks",))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["hooks", "torch_func", "loop", FORWARD_BACKWARD]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("timing…") == 2 and texts[0] == "170 ms (2.2x vs loop) ⚠ noisy"
    assert len(ax.patches) == 2  # bars only for what was timed
    assert "B=256" in ax.get_title() and "hidden=512" in ax.get_title()


def test_bar_figure_reads_the_noisy_field_of_the_records():
    rows = records()[:2]
    rows[1].noisy = True
    rows[0].note = "noisy in the note alone is not a flag"
    texts = [t.get_text() for t in viz.bar_figure(rows).axes[0].texts]
    assert texts[0].endswith("vs loop)") and texts[1].endswith("⚠ noisy"), texts


def test_histogram_bins_aligned_to_c_and_clipped_norms_left_of_the_line():
    edges = viz.aligned_edges(3.7, 1.0, bins=30)
    assert np.any(np.isclose(edges, 1.0)) and edges[0] == 0 and edges[-1] >= 3.7
    counts = viz.right_closed_counts(torch.tensor([1.0, 1.0 + 1e-7, 0.999999, 1.1]), edges)
    at_c = int(np.argmin(np.abs(edges - 1.0)))
    assert counts[at_c - 1] == 3 and counts[at_c] == 1  # exactly C (up to rounding): the bin ending at C
    fig = viz.norm_histogram(torch.tensor([0.5, 2.0, 3.0]), torch.tensor([0.5, 1.0, 1.0]), 1.0)
    ax = fig.axes[0]
    after = ax.containers[1]
    right_edges = [p.get_x() + p.get_width() for p in after if p.get_height() > 0]
    assert max(right_edges) == pytest.approx(1.0)  # the clipped norms' bin ends at the C line


def test_clipping_figure_counts_and_sums():
    total = torch.tensor([0.5, 1.0, 2.0, 4.0])
    fig = viz.clipping_figure(total, {"fc1": total * 0.8, "fc2": total * 0.6}, 1.0, sums=(7.0, 2.5))
    top, bottom = fig.axes[:2]
    assert "clipped: 2 of 4 samples (50%)" in top.get_title() and "||sum clipped|| = 2.5" in top.get_title()
    kept, scaled = top.containers[:2]
    assert sum(p.get_height() for p in kept) == 2 and sum(p.get_height() for p in scaled) == 2
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == ["fc1", "fc2"]


def test_outer_product_figure_shows_the_identity_with_both_numbers():
    a, g = torch.rand(784), torch.randn(20)
    fig = viz.outer_product_figure(a, g, gradient_norm=float(torch.outer(g, a).norm()))
    text = " ".join(t.get_text() for t in fig.texts)
    g_norm, a_norm = float(g.norm()), float(a.norm())
    assert f"{g_norm:.5g} x {a_norm:.5g} = {g_norm * a_norm:.5g}" in text
    assert f"per_sample_grads: {float(torch.outer(g, a).norm()):.5g}" in text
    outer = next(ax for ax in fig.axes if ax.images and ax.images[0].get_array().shape == (20, 784))
    assert np.allclose(outer.images[0].get_array(), np.outer(g.numpy(), a.numpy()))
    with pytest.raises(ValueError, match="image"):
        viz.outer_product_figure(torch.rand(10), g)


def test_histogram_bins_stay_few_when_norms_are_far_above_c_and_non_finite_norms_are_named():
    """Found by a probe of the explorer: C = 0.1 against norms up to 3,337 made 33,000 bins (13 s a redraw; 14.6 TiB
    at C = 1e-12), and a NaN norm a raw 'cannot convert float NaN to integer'."""
    for c in (0.1, 1e-12):
        edges = viz.aligned_edges(3337.0, c, bins=30)
        assert len(edges) <= 40 and np.any(np.isclose(edges, c)) and edges[-1] >= 3337.0
        assert np.all(np.diff(edges) > 0)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="not all finite"):
            viz.clipping_figure(torch.tensor([1.0, bad]), {}, 1.0)
