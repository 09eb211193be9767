"""Every title, label and annotation stays inside its figure; the explorer's new panels show what they claim."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pergrad_viz import plots  # noqa: E402
from pergrad_viz.bench import FORWARD_BACKWARD, MEMORY_FLOOR, Record  # noqa: E402

LONG = "per-sample gradients at batch size B=256, hidden width 512: a title long enough to need two lines or more"


def outside(fig: Figure) -> list[str]:
    """Axes (with everything drawn on them: labels, titles, annotations, legends) and figure texts that reach
    beyond the figure, after drawing it as it is saved."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    parts = [(f"axes {k} ({ax.get_title()[:30]!r})", ax.get_tightbbox(renderer)) for k, ax in enumerate(fig.axes)]
    texts = [t for t in [*fig.texts, fig._suptitle] if t is not None and t.get_visible() and t.get_text().strip()]
    parts += [(repr(t.get_text()[:40]), t.get_window_extent(renderer)) for t in texts]
    bad = []
    for what, box in parts:
        if box is not None and (box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1):
            bad.append(f"{what}: {box.x0:.0f}..{box.x1:.0f} x {box.y0:.0f}..{box.y1:.0f} "
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


def figures() -> dict[str, Figure]:
    rng = np.random.default_rng(0)
    sweep = [Record(n, "grads", b, 512, 1e-3 * b * k, 1e-4, 1000, note="") for b in (1, 16, 256)
             for k, n in enumerate(["loop", "autograd_stack", "torch_func", "hooks", FORWARD_BACKWARD], 1)]
    sweep += [Record("batched_grad", "grads", 256, 512, None, None, 1000, note="skipped: too slow")]
    bounds = [("fc1.weight", 0, 401408), ("fc1.bias", 401408, 401920), ("fc2.weight", 401920, 407040),
              ("fc2.bias", 407040, 407050)]
    return {
        "bars": plots.bar_figure(records(), title=LONG, noisy=("torch_func",)),
        "bars pending": plots.bar_figure(records()[:2], pending=("loop", FORWARD_BACKWARD), title=LONG),
        "runtime": plots.runtime_figure(sweep, highlight=256, title=LONG, width=6.4, height=3.4),
        "heatmap": plots.gradient_heatmap(rng.normal(size=(16, 407050)).astype(np.float32), bounds, title=LONG,
                                          max_cols=600),
        "heatmap rows": plots.gradient_heatmap(rng.normal(size=(10, 1000)), [("w", 0, 1000)], title=LONG,
                                               row_labels=["T-shirt/top", "Ankle boot", *"abcdefgh"]),
        "images": plots.first_layer_images(rng.normal(size=(9, 784)), image=rng.normal(size=784), suptitle=LONG,
                                           titles=[f"unit {k}" for k in range(9)], image_title="input (Ankle boot)"),
        "rule": plots.outer_product_figure(rng.normal(size=784), rng.normal(size=512), gradient_norm=3.0, title=LONG),
        "clip": plots.clipping_figure(rng.gamma(2, 10, 256), {"fc1": rng.gamma(2, 9, 256), "fc2": rng.gamma(2, 3, 256)},
                                      20.0, sums=(480.0, 95.0), title=LONG, width=8.0),
        "histogram": plots.norm_histogram(rng.gamma(2, 1, 256), rng.gamma(2, 0.4, 256), 1.0),
    }


@pytest.mark.parametrize("name", list(figures()))
def test_text_fits_inside_the_figure(name):
    fig = figures()[name]
    assert outside(fig) == [], name


def test_bar_figure_pending_rows_and_noisy_note():
    fig = plots.bar_figure(records()[:2], pending=("loop", FORWARD_BACKWARD), noisy=("hooks",))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["hooks", "torch_func", "loop", FORWARD_BACKWARD]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("timing…") == 2 and any("noisy: rerun" in t and t.startswith("170 ms") for t in texts)
    assert len(ax.patches) == 2  # bars only for what was timed
    assert "B=256" in ax.get_title() and "hidden=512" in ax.get_title()


def test_histogram_bins_aligned_to_c_and_clipped_norms_left_of_the_line():
    edges = plots.aligned_edges(3.7, 1.0, bins=30)
    assert np.any(np.isclose(edges, 1.0)) and edges[0] == 0 and edges[-1] >= 3.7
    counts = plots.right_closed_counts(torch.tensor([1.0, 1.0 + 1e-7, 0.999999, 1.1]), edges)
    at_c = int(np.argmin(np.abs(edges - 1.0)))
    assert counts[at_c - 1] == 3 and counts[at_c] == 1  # exactly C (up to rounding): the bin ending at C
    fig = plots.norm_histogram(torch.tensor([0.5, 2.0, 3.0]), torch.tensor([0.5, 1.0, 1.0]), 1.0)
    ax = fig.axes[0]
    after = ax.containers[1]
    right_edges = [p.get_x() + p.get_width() for p in after if p.get_height() > 0]
    assert max(right_edges) == pytest.approx(1.0)  # the clipped norms' bin ends at the C line


def test_clipping_figure_counts_and_sums():
    total = torch.tensor([0.5, 1.0, 2.0, 4.0])
    fig = plots.clipping_figure(total, {"fc1": total * 0.8, "fc2": total * 0.6}, 1.0, sums=(7.0, 2.5))
    top, bottom = fig.axes[:2]
    assert "clipped: 2 of 4 samples (50%)" in top.get_title() and "||sum clipped|| = 2.5" in top.get_title()
    kept, scaled = top.containers[:2]
    assert sum(p.get_height() for p in kept) == 2 and sum(p.get_height() for p in scaled) == 2
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == ["fc1", "fc2"]


def test_outer_product_figure_shows_the_identity_with_both_numbers():
    a, g = torch.rand(784), torch.randn(20)
    fig = plots.outer_product_figure(a, g, gradient_norm=float(torch.outer(g, a).norm()))
    text = " ".join(t.get_text() for t in fig.texts)
    g_norm, a_norm = float(g.norm()), float(a.norm())
    assert f"{g_norm:.5g} x {a_norm:.5g} = {g_norm * a_norm:.5g}" in text
    assert f"per_sample_grads: {float(torch.outer(g, a).norm()):.5g}" in text
    outer = next(ax for ax in fig.axes if ax.images and ax.images[0].get_array().shape == (20, 784))
    assert np.allclose(outer.images[0].get_array(), np.outer(g.numpy(), a.numpy()))
    with pytest.raises(ValueError, match="image"):
        plots.outer_product_figure(torch.rand(10), g)
