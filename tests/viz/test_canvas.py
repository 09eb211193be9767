"""What every figure stands on, checked for the pixels it draws: the pooled Agg renderer, the minor ticks turned
into marks, the titles at a given height, each compared with matplotlib's own way of drawing the same figure."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from PIL import Image  # noqa: E402

from pergrad_viz import viz  # noqa: E402
from pergrad_viz.bench.records import FORWARD_BACKWARD, Record  # noqa: E402
from pergrad_viz.viz.canvas import minor_ticks_as_marks  # noqa: E402


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def agg_pixels(fig: Figure, dpi: float = 60) -> np.ndarray:
    """The figure drawn the way matplotlib draws it, on a canvas and renderer of its own."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_figure(buf, format="png", dpi=dpi)
    return pixels(buf.getvalue())


def records() -> list[Record]:
    return [Record(name, "grads", b, 20, median * b, median * b / 10, 1000)
            for b in (1, 4, 16, 64) for name, median in (("loop", 2e-3), ("hooks", 3e-4), (FORWARD_BACKWARD, 1e-4))]


def line_figure(color: str, title: str, height: float = 2.0) -> Figure:
    fig = Figure(figsize=(3, height))
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [0, 1, 0] if color == "red" else [1, 0, 1], color=color)
    ax.set_title(title)
    return fig


def test_the_pooled_renderer_draws_each_figure_as_a_renderer_of_its_own_would():
    shown = (("red", "one", 2.0), ("blue", "two", 2.0), ("blue", "taller", 2.5), ("red", "one", 2.0))
    pngs = [viz.to_png(line_figure(*figure), dpi=60) for figure in shown]
    for png, figure in zip(pngs, shown, strict=True):
        assert png.startswith(b"\x89PNG")
        assert (pixels(png) == agg_pixels(line_figure(*figure))).all()  # nothing of the one before left over
    assert (pixels(pngs[3]) == pixels(pngs[0])).all() and (pixels(pngs[1]) != pixels(pngs[0])).any()


def test_minor_ticks_as_marks_draw_the_same_pixels_without_minor_ticks():
    for make in (lambda: viz.runtime_figure(records(), title="time vs batch size"),
                 lambda: viz.bar_figure([r for r in records() if r.batch_size == 16], title="bars")):
        fig = make()
        logs = [a for ax in fig.axes for a in (ax.xaxis, ax.yaxis) if len(a.get_minorticklocs()) > 10]
        assert logs  # a log axis has dozens
        minor_ticks_as_marks(fig)
        assert all(len(a.get_minorticklocs()) == 0 for a in logs)
        assert (agg_pixels(fig) == agg_pixels(make())).all()


def test_labelled_minor_ticks_stay_ticks():
    fig = Figure(figsize=(3, 2))
    ax = fig.add_subplot()
    ax.plot([2, 5], [2, 5])
    ax.set_yscale("log")  # less than a decade: matplotlib labels the minor ticks
    before = agg_pixels(fig)
    minor_ticks_as_marks(fig)
    assert any(ax.yaxis.get_minor_formatter().format_ticks(ax.yaxis.get_minorticklocs()))
    assert (agg_pixels(fig) == before).all()


def test_titles_sit_where_matplotlibs_automatic_placement_puts_them():
    def figure(title_y: float | None) -> Figure:
        fig = Figure(figsize=(3, 2))
        ax = fig.add_subplot()
        ax.plot([1, 10], [3, 40])
        ax.set_title("a title", fontsize="medium", **({} if title_y is None else {"y": title_y}))
        return fig

    assert (agg_pixels(figure(viz.canvas.TITLE_Y)) == agg_pixels(figure(None))).all()


def test_a_pyplot_figure_keeps_its_canvas():
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(3, 2))
    try:
        canvas = fig.canvas
        fig.add_subplot().plot([0, 1], [1, 0])
        assert viz.to_png(fig, close=False).startswith(b"\x89PNG")
        assert fig.canvas is canvas and fig.canvas.manager is not None
    finally:
        plt.close(fig)
