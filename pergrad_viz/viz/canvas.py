"""What every figure of :mod:`pergrad_viz.viz` stands on: a new figure without a layout engine and its margins
in inches, estimates of text widths, titles wrapped to fit, a fixed colour per method, arrays from tensors, PNG
bytes.

Figures are built on the object API (:class:`matplotlib.figure.Figure`, never ``pyplot``), so no figure is
registered globally and nothing leaks: a figure is freed once the caller drops it.
"""

from __future__ import annotations

import io
import textwrap
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator

from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR
from pergrad_viz.strategies import STRATEGIES

__all__ = [
    "CHAR_IN",
    "DIVERGING",
    "PALETTE",
    "PooledCanvas",
    "REFERENCES",
    "REFERENCE_STYLE",
    "TITLE_Y",
    "axes_at_inches",
    "fit_text",
    "fixed_axes",
    "method_color",
    "minor_ticks_as_marks",
    "place_margins",
    "text_width_in",
    "title_height_in",
    "to_numpy",
    "to_png",
]

REFERENCES = (FORWARD_BACKWARD, MEMORY_FLOOR)
REFERENCE_STYLE = {
    FORWARD_BACKWARD: {"color": "0.35", "marker": "s"},
    MEMORY_FLOOR: {"color": "0.6", "marker": "v"},
}
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan")
DIVERGING = "RdBu_r"  # blue < 0 < red, white at 0
TITLE_Y = 1.0  # every axes title at the top of its axes (where matplotlib's automatic placement puts it when, as
# here, no tick labels sit above the axes): given, it spares the automatic placement (a third of a title's cost)


def method_color(name: str) -> str:
    """A fixed colour per method, the same in every figure."""
    names = [*STRATEGIES, "auto", "opacus", "backpack"]
    k = names.index(name) if name in names else len(names) + sum(map(ord, name))
    return PALETTE[k % len(PALETTE)]


def fixed_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes, bool]:
    """``ax``'s figure, or a new figure of ``figsize`` inches without a layout engine (its margins are set with
    :func:`place_margins`: a constrained layout would double the time to draw it). The flag: the figure is new."""
    if ax is not None:
        return ax.figure, ax, False
    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot(), True


CHAR_IN = {"x-small": 0.056, "small": 0.066, "medium": 0.08}  # inches per character, DejaVu Sans (generous)


def text_width_in(lines: Iterable[str], size: str = "small") -> float:
    """The width in inches of the longest of ``lines`` (an estimate that errs on the wide side)."""
    return max((len(line) for text in lines for line in str(text).split("\n")), default=0) * CHAR_IN[size]


def place_margins(fig: Figure, *, left: float, right: float, bottom: float, top: float, **spacing: float) -> None:
    """Margins in inches around the subplots (so labels and titles stay inside the figure)."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=min(left / w, 0.45), right=max(1 - right / w, 0.55), bottom=min(bottom / h, 0.45),
                        top=max(1 - top / h, 0.55), **spacing)


def title_height_in(title: str | None) -> float:
    """Room above the axes for a (wrapped) medium-size title."""
    return 0.12 + 0.21 * (title.count("\n") + 1) if title else 0.12


RENDERERS_KEPT = 8  # renderers kept per thread (one per figure size and dpi drawn lately)
_renderers = threading.local()


class PooledCanvas(FigureCanvasAgg):
    """An Agg canvas that draws on a renderer kept from earlier figures of the same size and dpi (one pool per
    thread): a new renderer per figure would allocate its pixels again and miss matplotlib's cache of text sizes,
    which is kept per renderer. The renderer is cleared before each drawing, as Agg's own is."""

    def get_renderer(self) -> RendererAgg:
        w, h = self.figure.bbox.size
        key = (w, h, self.figure.dpi)
        pool = getattr(_renderers, "pool", None)
        if pool is None:
            pool = _renderers.pool = OrderedDict()
        renderer = pool.pop(key, None) or RendererAgg(w, h, self.figure.dpi)
        pool[key] = renderer  # the most recent last
        while len(pool) > RENDERERS_KEPT:
            pool.popitem(last=False)
        self.renderer = renderer
        return renderer


def to_png(fig: Figure, *, dpi: float | None = None, close: bool = True) -> bytes:
    """The figure rendered as PNG bytes (e.g. for ``ipywidgets.Image``); with ``close`` its artists are cleared.

    Drawn on a pooled renderer (:class:`PooledCanvas`) and encoded with zlib's fastest level: the same pixels,
    a PNG a little larger, a third of the encoding time."""
    buf = io.BytesIO()
    if fig.canvas.manager is None and not isinstance(fig.canvas, PooledCanvas):
        PooledCanvas(fig)  # the figure's canvas from now on (not a pyplot figure's: its window keeps its own)
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    if close:
        fig.clear()
    return buf.getvalue()


def fit_text(text: str, width_in: float, fontsize_pt: float = 10.0) -> str:
    """``text`` wrapped to lines that fit ``width_in`` inches at ``fontsize_pt`` (about 0.55 em per character),
    for titles that must stay inside their figure."""
    chars = max(10, int(width_in * 72 / (0.55 * fontsize_pt)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def to_numpy(values: Any) -> np.ndarray:
    """``values`` (a tensor, on any device, or anything array-like) as a NumPy array of float32, or float64 where
    they are float64."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().to("cpu")
        if not values.dtype.is_floating_point or values.dtype.itemsize < 4:
            values = values.float()
        values = values.numpy()
    return np.asarray(values, dtype=np.float64 if np.asarray(values).dtype == np.float64 else np.float32)


def axes_at_inches(fig: Figure, x0: float, y0: float, w: float, h: float) -> Axes:
    """A new axes at (x0, y0) of size (w, h), all in inches from the figure's lower left corner."""
    fw, fh = fig.get_size_inches()
    return fig.add_axes((x0 / fw, y0 / fh, w / fw, h / fh))


def minor_ticks_as_marks(fig: Figure) -> None:
    """Turn each axis's minor ticks, where none has a label (a log axis has dozens), into one line of the same
    tick marks, for a finished figure that is only drawn from now on (the explorer's): the same pixels, without the
    Tick objects (each a mark, a label and a grid line) that matplotlib makes for them at every drawing. The marks
    are placed for the axes' current limits: nothing may be added to the figure afterwards."""
    for ax in fig.axes:
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if isinstance(axis.get_minor_locator(), NullLocator):
                continue
            lo, hi = sorted(axis.get_view_interval())  # the limits as drawn (autoscaled now, if due)
            slack = (hi - lo) * 1e-10
            locs = [float(v) for v in axis.get_minorticklocs() if lo - slack <= v <= hi + slack]
            if any(axis.get_minor_formatter().format_ticks(locs)):
                continue  # labelled minor ticks (a log axis over less than a decade or two) stay ticks
            tick = axis.get_minor_ticks(1)[0]  # its marks' style, as matplotlib would draw them
            for line, which in ((tick.tick1line, "tick1"), (tick.tick2line, "tick2")):
                if not (locs and line.get_visible()):
                    continue
                transform = (ax.get_xaxis_transform(which) if name == "x" else ax.get_yaxis_transform(which))
                at = [0.0 if which == "tick1" else 1.0] * len(locs)
                marks = Line2D(*((locs, at) if name == "x" else (at, locs)), linestyle="none", marker=line.get_marker(),
                               markersize=line.get_markersize(), markeredgewidth=line.get_markeredgewidth(),
                               markeredgecolor=line.get_markeredgecolor(), color=line.get_color(),
                               zorder=axis.get_zorder(), transform=transform, clip_on=False)
                ax.add_artist(marks)
            axis.set_minor_locator(NullLocator())
