"""The figures of pergrad_viz.viz, checked headless (Agg): lines, labels, scales, boundaries, colour limits."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (only to check that nothing registers figures globally)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pergrad_viz import viz  # noqa: E402
from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR, Record  # noqa: E402
from pergrad_viz.tutorial.networks import MLP  # noqa: E402


def rec(strategy: str, batch: int, median: float | None, *, hidden: int = 20, quantity: str = "grads",
        speedup: float | None = None, note: str = "") -> Record:
    return Record(strategy, quantity, batch, hidden, median, None if median is None else median / 10, 1000,
                  speedup_vs_loop=speedup, vs_forward_backward=None if median is None else median / 1e-3, note=note)


def sweep_records() -> list[Record]:
    out = []
    for b in (1, 4, 16):
        loop = None if b > 4 else 1e-3 * b
        out += [rec("loop", b, loop, note="" if loop else f"skipped: {b} backward passes > slow_limit=4"),
                rec("hooks", b, 2e-4 * b, speedup=(loop / (2e-4 * b)) if loop else None),
                rec(FORWARD_BACKWARD, b, 1e-4 * b), rec(MEMORY_FLOOR, b, 1e-5 * b)]
    return out


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


# ------------------------------------------------------------------------------------------------ runtime


def test_runtime_figure_lines_scales_and_skips():
    fig = viz.runtime_figure(sweep_records(), highlight=16)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "batch size B"
    labels = legend_texts(ax)
    assert labels == ["loop (skipped above B=4)", "hooks", FORWARD_BACKWARD, MEMORY_FLOOR]
    by_label = {c.get_label(): c.lines[0] for c in ax.containers}  # errorbar: (data line, caps, bars)
    assert list(by_label["hooks"].get_xdata()) == [1, 4, 16]
    assert list(by_label["loop (skipped above B=4)"].get_xdata()) == [1, 4]  # the skipped point is not drawn
    for ref in (FORWARD_BACKWARD, MEMORY_FLOOR):
        assert by_label[ref].get_linestyle() == "--"
        r, g, b, _ = matplotlib.colors.to_rgba(by_label[ref].get_color())
        assert r == g == b  # grey
    assert by_label["hooks"].get_linestyle() == "-"
    assert any(list(line.get_xdata()) == [16, 16] for line in ax.get_lines())  # the highlight


def test_runtime_figure_names_a_method_skipped_everywhere_and_other_axis():
    records = [rec("loop", 8, None, hidden=h, note="skipped") for h in (8, 16)]
    records += [rec("hooks", 8, 1e-3 * h, hidden=h) for h in (8, 16)]
    ax = viz.runtime_figure(records, x="hidden").axes[0]
    assert ax.get_xlabel() == "hidden width"
    assert legend_texts(ax) == ["loop (skipped at every hidden)", "hooks"]
    mixed = [*sweep_records(), *[rec("hooks", b, 1e-3, hidden=64) for b in (1, 4)]]
    labels = legend_texts(viz.runtime_figure(mixed).axes[0])
    assert "hooks (hidden=20)" in labels and "hooks (hidden=64)" in labels


def test_runtime_figure_draws_into_given_axes_and_rejects_bad_input():
    fig = Figure()
    ax = fig.add_subplot()
    assert viz.runtime_figure(sweep_records(), ax=ax, title="T") is fig
    assert ax.get_title() == "T"
    with pytest.raises(ValueError, match="no records"):
        viz.runtime_figure([])
    with pytest.raises(ValueError, match="x must be"):
        viz.runtime_figure(sweep_records(), x="width")


def test_bar_figure_bars_and_speedups():
    one = [r for r in sweep_records() if r.batch_size == 4]
    ax = viz.bar_figure(one).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["loop", "hooks", FORWARD_BACKWARD, MEMORY_FLOOR]
    assert len(ax.patches) == 4 and ax.get_xscale() == "log"
    texts = [t.get_text() for t in ax.texts]
    assert any("5x vs loop" in t for t in texts), texts
    skipped = [r for r in sweep_records() if r.batch_size == 16]
    ax = viz.bar_figure(skipped).axes[0]
    assert len(ax.patches) == 3  # no bar for the skipped loop, but its note
    assert any(t.get_text().startswith("skipped: 16 backward passes") for t in ax.texts)
    with pytest.raises(ValueError, match="one setting"):
        viz.bar_figure(sweep_records())


# ------------------------------------------------------------------------------------------------ heatmap


def test_param_boundaries_in_named_parameters_order_trainable_only():
    model = MLP(784, 20, 10)
    assert viz.param_boundaries(model) == [("fc1.weight", 0, 15680), ("fc1.bias", 15680, 15700),
                                             ("fc2.weight", 15700, 15900), ("fc2.bias", 15900, 15910)]
    model.fc1.bias.requires_grad_(False)
    assert [n for n, *_ in viz.param_boundaries(model)] == ["fc1.weight", "fc2.weight", "fc2.bias"]
    grads = {"a": torch.zeros(5, 3, 4), "b": torch.zeros(5, 2)}
    assert viz.param_boundaries(grads, lead=1) == [("a", 0, 12), ("b", 12, 14)]
    assert viz.param_boundaries([("w", (2, 3)), ("b", (2,))]) == [("w", 0, 6), ("b", 6, 8)]


SYNTH = [("big", 0, 9000), ("mid", 9000, 10000), ("tiny", 10000, 10007)]


def test_heatmap_boundaries_exact_after_downsampling():
    rng = np.random.default_rng(0)
    data = rng.normal(size=(6, 10007)).astype(np.float32)
    data[2, 4321] = 100.0  # a spike that pooling must keep, in the right place
    fig = viz.gradient_heatmap(data, SYNTH, max_cols=500, min_layer_frac=0)
    ax = fig.axes[0]
    vlines = sorted(line.get_xdata()[0] for line in ax.get_lines())
    assert vlines == [9000, 10000]  # exact parameter indices, although the columns were pooled
    assert [im.get_label() for im in ax.images] == ["big", "mid", "tiny"]
    assert [tuple(im.get_extent()[:2]) for im in ax.images] == [(0, 9000), (9000, 10000), (10000, 10007)]
    widths = [im.get_array().shape[1] for im in ax.images]
    assert sum(widths) <= 500 + len(SYNTH) and widths[0] < 9000
    big = np.asarray(ax.images[0].get_array())
    factor = -(-9000 // widths[0])
    k = int(np.argmax(big[2]))
    assert big[2, k] == 100.0 and k * factor <= 4321 < (k + 1) * factor
    assert ax.get_xlim() == (0, 10007)
    assert [t.get_text().split()[0] for t in ax.get_xticklabels()] == ["big", "mid", "tiny"]


def test_heatmap_widens_small_layers_and_keeps_order():
    data = np.ones((3, 10007), dtype=np.float32)
    ax = viz.gradient_heatmap(data, dict((n, (a, b)) for n, a, b in SYNTH), min_layer_frac=0.05).axes[0]
    extents = [tuple(im.get_extent()[:2]) for im in ax.images]
    assert extents[0][0] == 0 and extents[-1][1] == 10007
    for (_, x1), (y0, _) in zip(extents, extents[1:], strict=False):
        assert x1 == pytest.approx(y0)
    assert all(x1 - x0 >= 0.05 * 10007 - 1e-6 for x0, x1 in extents)
    assert sorted(line.get_xdata()[0] for line in ax.get_lines()) == pytest.approx([e[1] for e in extents[:-1]])
    assert np.asarray(ax.images[2].get_array()).shape[1] == 7  # a tiny layer: every value shown
    assert "widened" in ax.get_xlabel()


def test_heatmap_colour_limits_symmetric_robust_and_tensor_input():
    values = torch.linspace(-1, 3, 4000).reshape(4, 1000)
    ax = viz.gradient_heatmap(values, [("w", 0, 1000)], percentile=99.0).axes[0]
    lo, hi = ax.images[0].get_clim()
    assert lo == -hi and hi == pytest.approx(np.percentile(np.abs(values.numpy()), 99.0), rel=1e-5)
    assert ax.images[0].get_cmap().name == viz.DIVERGING
    ax = viz.gradient_heatmap(torch.zeros(7), None).axes[0]  # 1-D and all zero: one row, a non-empty scale
    assert ax.images[0].get_clim() == (-1.0, 1.0)


def test_heatmap_rows_pooled_and_highlight():
    data = np.zeros((3000, 50), dtype=np.float32)
    data[1234, 7] = -5.0
    ax = viz.gradient_heatmap(data, max_rows=1000, highlight_row=1234).axes[0]
    arr = np.asarray(ax.images[0].get_array())
    assert arr.shape[0] <= 1000 and arr.min() == -5.0
    assert ax.get_ylim() == (3000, 0)
    assert ax.patches  # the outlined row


def test_heatmap_rejects_wrong_boundaries():
    with pytest.raises(ValueError, match="P=10"):
        viz.gradient_heatmap(np.zeros((2, 10)), [("a", 0, 6)])
    with pytest.raises(ValueError, match="without gaps"):
        viz.gradient_heatmap(np.zeros((2, 10)), [("a", 0, 4), ("b", 5, 10)])
    with pytest.raises(ValueError, match=r"\(B, P\)"):
        viz.gradient_heatmap(np.zeros((2, 3, 10)))


# ------------------------------------------------------------------------------------------------ images


def image_axes(fig: Figure) -> list:
    return [a for a in fig.axes if a.images and a.get_label() != "<colorbar>"]


def test_first_layer_images_count_colours_and_input():
    grads = torch.randn(10, 784)
    fig = viz.first_layer_images(grads, image=torch.randn(784), titles=[f"c{k}" for k in range(10)], ncols=4)
    axes = image_axes(fig)
    assert len(axes) == 11
    assert axes[0].get_title() == "input" and axes[0].images[0].get_cmap().name == "gray"
    assert [a.get_title() for a in axes[1:]] == [f"c{k}" for k in range(10)]
    limit = float(grads.abs().max())
    for a in axes[1:]:
        assert a.images[0].get_clim() == pytest.approx((-limit, limit))
        assert a.images[0].get_array().shape == (28, 28)
    assert len(fig.axes) == 12  # the images and one colour bar; the unused grid cells are removed


def test_first_layer_images_3d_without_input_and_errors():
    fig = viz.first_layer_images(np.random.default_rng(0).normal(size=(5, 28, 28)), ncols=3)
    assert len(image_axes(fig)) == 5 and [a.get_title() for a in image_axes(fig)] == list("01234")
    with pytest.raises(ValueError, match="square"):
        viz.first_layer_images(np.zeros((3, 780)))
    with pytest.raises(ValueError, match="titles"):
        viz.first_layer_images(np.zeros((3, 784)), titles=["a"])
    with pytest.raises(ValueError, match="pixels"):
        viz.first_layer_images(np.zeros((3, 784)), image=np.zeros(10))


def test_png_and_no_global_figures():
    before = plt.get_fignums()
    fig = viz.runtime_figure(sweep_records())
    png = viz.to_png(fig, dpi=40)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert not fig.axes  # cleared after rendering
    viz.gradient_heatmap(np.ones((2, 5)))
    viz.first_layer_images(np.ones((2, 784)))
    assert plt.get_fignums() == before


def test_every_figure_is_exported_and_the_old_module_gives_the_same_objects():
    import warnings

    from pergrad_viz.core.layout import param_boundaries

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import pergrad_viz.plots as plots  # the module of version 0.1's figures, kept for old code

    assert all(hasattr(viz, name) for name in viz.__all__)
    assert {name for name in viz.__all__ if name.endswith("_figure")} >= {
        "runtime_figure", "bar_figure", "clipping_figure", "outer_product_figure", "factor_figure", "token_figure"}
    assert plots is viz
    assert viz.param_boundaries is param_boundaries


# ------------------------------------------------------------------------------------------------ DP step costs
def dp_rows_example() -> list[dict]:
    return [{"method": "forward+backward", "median_s": 0.010, "iqr": 0.1, "peak": 4 << 20, "note": ""},
            {"method": "pv clipped_grad_sum", "median_s": 0.025, "iqr": 0.2, "peak": 6 << 20, "note": ""},
            {"method": "materialised + clip", "median_s": 0.040, "iqr": None, "peak": None, "note": ""},
            {"method": "opacus ghost clipping", "median_s": None, "iqr": None, "peak": None,
             "note": "failed: RuntimeError: no rule"}]


def test_dp_cost_figure_bars_are_the_times_and_peaks_with_ratios_to_the_plain_step():
    fig = viz.dp_cost_figure(dp_rows_example(), title="a tiny ViT")
    assert isinstance(fig, Figure) and fig._suptitle.get_text() == "a tiny ViT"
    times, peaks = fig.axes
    assert [t.get_text() for t in times.get_yticklabels()] == [r["method"] for r in dp_rows_example()]
    assert [round(p.get_width(), 6) for p in times.patches] == [10.0, 25.0, 40.0]  # ms, the failed row has no bar
    assert [round(p.get_width(), 6) for p in peaks.patches] == [4.0, 6.0]  # MB; the unread peak has none
    texts = [t.get_text() for t in times.texts]
    assert any("(2.5x)" in t for t in texts) and any("(4x)" in t for t in texts)
    assert any("failed: RuntimeError" in t for t in texts)
    assert any("6.0 MB (1.5x)" in t for t in (t.get_text() for t in peaks.texts))
    assert len(times.lines) == 2  # the IQR lines of the rows that have one
    assert not plt.get_fignums()


def test_dp_cost_figure_needs_a_timed_reference():
    with pytest.raises(ValueError, match="first"):
        viz.dp_cost_figure([])
    with pytest.raises(ValueError, match="first"):
        viz.dp_cost_figure(dp_rows_example()[3:])
