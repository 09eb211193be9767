"""Matplotlib figures: runtime curves and bars from benchmark records, gradient heatmaps, first-layer images.

Every function builds on the object API (:class:`matplotlib.figure.Figure`, never ``pyplot``), so no
figure is registered globally and nothing leaks: a figure is freed once the caller drops it. Each
function returns the :class:`~matplotlib.figure.Figure` it drew on; pass ``ax=`` to draw into an
existing axes instead. In a notebook, show a figure by leaving it as a cell's last expression (inline
backend) or with :func:`to_png`; everything works headless (the Agg renderer).

The plots take plain data (benchmark :class:`~pergrad_viz.bench.sweeps.Record` s, tensors or arrays, names and
shapes) and know nothing of how a strategy computes them.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR
from pergrad_viz.core.layout import param_boundaries
from pergrad_viz.strategies import STRATEGIES

__all__ = [
    "aligned_edges",
    "bar_figure",
    "clipping_figure",
    "factor_figure",
    "fit_text",
    "grouped_heatmap",
    "image_grid",
    "norm_histogram",
    "outer_product_figure",
    "right_closed_counts",
    "first_layer_images",
    "fmt_ratio",
    "fmt_seconds",
    "gradient_heatmap",
    "param_boundaries",
    "robust_limit",
    "runtime_figure",
    "to_png",
    "token_figure",
]

Boundaries = Mapping[str, tuple[int, int]] | Sequence[tuple[str, int, int]]

REFERENCES = (FORWARD_BACKWARD, MEMORY_FLOOR)
_REFERENCE_STYLE = {
    FORWARD_BACKWARD: {"color": "0.35", "marker": "s"},
    MEMORY_FLOOR: {"color": "0.6", "marker": "v"},
}
_PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
            "tab:cyan")
_X_AXES = {"batch_size": ("batch size B", "B"), "hidden": ("hidden width", "hidden")}
_QUANTITY_TITLES = {"grads": "per-sample gradients", "jacobian": "per-sample output Jacobians"}
DIVERGING = "RdBu_r"  # blue < 0 < red, white at 0


def _color(name: str) -> str:
    """A fixed colour per method, the same in every figure."""
    names = [*STRATEGIES, "auto", "opacus", "backpack"]
    k = names.index(name) if name in names else len(names) + sum(map(ord, name))
    return _PALETTE[k % len(_PALETTE)]


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _fixed_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes, bool]:
    """``ax``'s figure, or a new figure of ``figsize`` inches without a layout engine (its margins are set with
    :func:`_place`: a constrained layout would double the time to draw it). The flag: the figure is new."""
    if ax is not None:
        return ax.figure, ax, False
    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot(), True


_CHAR_IN = {"x-small": 0.056, "small": 0.066, "medium": 0.08}  # inches per character, DejaVu Sans (generous)


def _text_in(lines: Iterable[str], size: str = "small") -> float:
    """The width in inches of the longest of ``lines`` (an estimate that errs on the wide side)."""
    return max((len(line) for text in lines for line in str(text).split("\n")), default=0) * _CHAR_IN[size]


def _place(fig: Figure, *, left: float, right: float, bottom: float, top: float, **spacing: float) -> None:
    """Margins in inches around the subplots (so labels and titles stay inside the figure)."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=min(left / w, 0.45), right=max(1 - right / w, 0.55), bottom=min(bottom / h, 0.45),
                        top=max(1 - top / h, 0.55), **spacing)


def _title_in(title: str | None) -> float:
    """Room above the axes for a (wrapped) medium-size title."""
    return 0.12 + 0.21 * (title.count("\n") + 1) if title else 0.12


def to_png(fig: Figure, *, dpi: float | None = None, close: bool = True) -> bytes:
    """The figure rendered as PNG bytes (e.g. for ``ipywidgets.Image``); with ``close`` its artists are cleared."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    if close:
        fig.clear()
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- runtime


def fmt_seconds(s: float) -> str:
    """A duration as people read it: ``"1.5 s"``, ``"13.7 ms"``, ``"95.7 µs"``, ``"939 ns"`` (3 digits)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def fmt_ratio(r: float) -> str:
    """A ratio as people read it: ``"1,930x"``, ``"89.4x"``, ``"0.668x"`` (never ``1.93e+03x``)."""
    return f"{r:,.0f}x" if r >= 100 else f"{r:.3g}x"


_fmt_seconds = fmt_seconds


def _skip_text(timed: list[int], skipped: list[int], short: str) -> str:
    if not skipped:
        return ""
    if not timed:
        return f" (skipped at every {short})" if len(skipped) > 1 else f" (skipped at {short}={skipped[0]})"
    if min(skipped) > max(timed):
        return f" (skipped above {short}={max(timed)})"
    return f" (skipped at {short}={', '.join(map(str, skipped))})"


def runtime_figure(records: Iterable[Any], *, x: str = "batch_size", ax: Axes | None = None,
                   title: str | None = None, highlight: int | None = None, width: float = 7.0,
                   height: float = 4.0, legend: str = "right") -> Figure:
    """Median time per call against batch size (or hidden width), log-log, one line per method.

    Args:
        records: benchmark records (:class:`pergrad_viz.bench.sweeps.Record` or anything with its attributes
            ``strategy, quantity, batch_size, hidden, median_s, iqr_s``). Error bars span the interquartile
            range (median ± IQR/2). The reference rows ``forward+backward`` and ``memory floor`` are drawn
            dashed in grey. Skipped records (``median_s is None``) are not drawn but named in the legend,
            e.g. ``loop (skipped above B=64)``.
        x: ``"batch_size"`` or ``"hidden"``. When the records hold several values of the other one (or
            several quantities), each line is labelled with it.
        ax: draw into this axes (default: a new figure).
        title: default: the quantity and the fixed setting.
        highlight: an x value to mark with a dotted vertical line (e.g. the current batch size).
        width, height: of a new figure, in inches (the legend inside the figure).
        legend: ``"right"`` of the axes, or ``"below"`` them in columns (the axes then get the whole width:
            long entries such as ``autograd_stack (skipped above B=64)`` no longer squeeze the plot).

    Returns:
        The figure.

    Raises:
        ValueError: no records, or an unknown ``x``.
    """
    records = list(records)
    if x not in _X_AXES:
        raise ValueError(f"x must be one of {', '.join(map(repr, _X_AXES))}, got {x!r}")
    if not records:
        raise ValueError("no records to plot: pass the list returned by pergrad_viz.bench.sweeps.sweep(...)")
    other = "hidden" if x == "batch_size" else "batch_size"
    xlabel, short = _X_AXES[x]
    others = sorted({getattr(r, other) for r in records})
    quantities = sorted({r.quantity for r in records})

    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r.strategy, r.quantity, getattr(r, other)), []).append(r)
    # methods in order of first appearance, references last
    order = sorted(groups, key=lambda k: (k[0] in REFERENCES, REFERENCES.index(k[0]) if k[0] in REFERENCES else 0))

    fig, ax, new = _fixed_axes(ax, (width, height))
    labels = []
    for key in order:
        name, quantity, other_value = key
        rows = sorted(groups[key], key=lambda r: getattr(r, x))
        timed = [r for r in rows if r.median_s is not None]
        skipped = [getattr(r, x) for r in rows if r.median_s is None]
        label = name
        if len(quantities) > 1:
            label += f" [{quantity}]"
        if len(others) > 1:
            label += f" ({_X_AXES[other][1]}={other_value})"
        label += _skip_text([getattr(r, x) for r in timed], skipped, short)
        labels.append(label)
        style: dict[str, Any] = (
            {**_REFERENCE_STYLE[name], "linestyle": "--", "linewidth": 1.2} if name in REFERENCES
            else {"color": _color(name), "marker": "o", "linestyle": "-", "linewidth": 1.8}
        )
        xs = [getattr(r, x) for r in timed]
        ys = [r.median_s for r in timed]
        if timed:
            half = [(r.iqr_s or 0.0) / 2 for r in timed]
            lower = [min(h, y * 0.95) for h, y in zip(half, ys, strict=True)]  # stay positive on a log axis
            ax.errorbar(xs, ys, yerr=[lower, half], label=label, capsize=3, markersize=5, **style)
        else:  # nothing timed: a legend entry all the same
            ax.plot([], [], label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs_all = sorted({getattr(r, x) for r in records})
    ax.set_xticks(xs_all)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_seconds(v)))
    if len(xs_all) == 1:
        ax.set_xlim(xs_all[0] / 1.5, xs_all[0] * 1.5)
    if highlight is not None:
        ax.axvline(highlight, color="0.2", linestyle=":", linewidth=1, zorder=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median time per call")
    ax.grid(True, which="major", alpha=0.3)
    if title is None:
        what = " & ".join(_QUANTITY_TITLES.get(q, q) for q in quantities)
        fixed = f", {_X_AXES[other][1]}={others[0]}" if len(others) == 1 else ""
        title = f"{what}: time vs {xlabel}{fixed}"
    if legend not in ("right", "below"):
        raise ValueError(f"legend must be 'right' or 'below', got {legend!r}")
    if legend == "right" or not new:
        right = min(_text_in(labels, "small") + 0.6, width * 0.45)
        if new:  # wrapped to the axes' width: a title centred over the axes stays inside the figure
            title = fit_text(title, width - 0.85 - right)
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        if new:
            _place(fig, left=0.85, right=right, bottom=0.55, top=_title_in(title))
        return fig
    entry = _text_in(labels, "small") + 0.55  # a line sample and its label
    ncol = max(1, min(len(labels), int((width - 0.3) // entry)))
    rows = -(-len(labels) // ncol)
    bottom = 0.55 + 0.2 * rows + 0.12
    title = fit_text(title, width - 0.3)  # the whole width: centred over the axes it stays inside
    ax.set_title(title, fontsize="medium")
    top = _title_in(title)
    _place(fig, left=0.85, right=0.2, bottom=bottom, top=top)
    axes_h = height - bottom - top
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.5 / axes_h), ncol=ncol,
              frameon=False, columnspacing=1.2, handlelength=1.8, borderaxespad=0.0)
    return fig


def bar_figure(records: Iterable[Any], *, ax: Axes | None = None, title: str | None = None,
               pending: Sequence[str] = (), noisy: Collection[str] | None = None,
               provisional: Collection[str] = (), width: float = 6.0) -> Figure:
    """Horizontal bars of the median time of every method at one setting, annotated with the speed-up vs loop.

    Args:
        records: the records of one (quantity, batch size, hidden width), e.g.
            ``[r for r in records if r.batch_size == 32]``. Skipped methods get no bar but their note;
            where ``loop`` was not timed, the annotation is the time relative to forward+backward. A thin line
            spans each bar's interquartile range (median ± IQR/2).
        ax, title: as in :func:`runtime_figure` (default title: the quantity and the setting).
        pending: methods still being timed: a row each, reading "timing…", so the chart keeps its size while
            it fills in.
        noisy: methods whose measurement was noisy: their annotation says "⚠ noisy" (default: the records
            flagged ``noisy``).
        provisional: methods whose numbers are from the first rounds, more rounds on their way: annotated
            "provisional", in grey (not a warning).
        width: figure width in inches (a new figure only).

    The annotations sit to the right of the axes, inside the figure (constrained layout makes room).

    Raises:
        ValueError: no records (and nothing pending), or records of several settings.
    """
    records = list(records)
    if not records and not pending:
        raise ValueError("no records to plot: pass the records of one setting")
    settings = {(r.quantity, r.batch_size, r.hidden) for r in records}
    if len(settings) > 1:
        raise ValueError(f"bar_figure shows one setting, got {len(settings)}: {sorted(settings)}; filter the "
                         "records first, e.g. [r for r in records if r.batch_size == B and r.hidden == H]")
    rows = len(records) + len(pending)
    if noisy is None:
        noisy = {r.strategy for r in records if getattr(r, "noisy", False)}
    fig, ax, new = _fixed_axes(ax, (width, 0.32 * rows + 1.05))
    timed = [r.median_s for r in records if r.median_s is not None]
    left = min(timed) / 3 if timed else 1e-4
    right = max(timed) * 3 if timed else 1.0
    beside = ax.get_yaxis_transform()  # x in axes fraction, y in data
    names = [r.strategy for r in records] + list(pending)
    annotations = [_bar_label(r, r.strategy in noisy, r.strategy in provisional) for r in records
                   if r.median_s is not None]
    margin_left = _text_in(names, "medium") + 0.2
    margin_right = _text_in(annotations, "small") + 0.25
    axes_in = fig.get_figwidth() - margin_left - margin_right if new else fig.get_figwidth() * 0.45
    note_chars = max(16, int(axes_in * 0.97 / _CHAR_IN["small"]))
    for k, r in enumerate(records):
        ref = r.strategy in REFERENCES
        if r.median_s is None:  # inside the axes, on at most two lines
            note = f"skipped: {r.note.removeprefix('skipped: ')}" if r.note else "skipped"
            lines = textwrap.wrap(note, note_chars)
            if len(lines) > 2:
                lines = [lines[0], textwrap.shorten(" ".join(lines[1:]), note_chars, placeholder=" …")]
            ax.text(0.01, k, "\n".join(lines), transform=beside, va="center", fontsize="small", color="0.35",
                    linespacing=1.0)
            continue
        ax.barh(k, r.median_s - left, left=left, color=_REFERENCE_STYLE[r.strategy]["color"] if ref
                else _color(r.strategy), hatch="//" if ref else None, alpha=0.85 if ref else 1.0, height=0.7)
        if r.iqr_s:
            ax.plot([max(left, r.median_s - r.iqr_s / 2), r.median_s + r.iqr_s / 2], [k, k], color="black",
                    linewidth=1.0, solid_capstyle="butt")
        warn, soon = r.strategy in noisy, r.strategy in provisional
        color = "#8a5300" if warn else ("0.45" if soon else "black")
        ax.text(1.02, k, _bar_label(r, warn, soon), transform=beside, va="center", fontsize="small", color=color,
                clip_on=False)
    for j in range(len(records), rows):
        ax.text(0.01, j, "timing…", transform=beside, va="center", fontsize="small", color="0.4", style="italic")
    ax.set_xscale("log")
    ax.set_yticks(range(rows), [r.strategy for r in records] + list(pending))
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(left, right)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_seconds(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("median time per call (log scale; line: IQR)", fontsize="small")
    if title is None and settings:
        (quantity, batch, hidden), = settings
        title = f"{_QUANTITY_TITLES.get(quantity, quantity)}, B={batch}, hidden={hidden}"
    left, right = margin_left, margin_right
    if title:
        title = fit_text(title, fig.get_figwidth() - left - right + 2 * min(left, right)) if new else title
        ax.set_title(title, fontsize="medium")
    ax.grid(True, axis="x", alpha=0.3)
    if new:
        _place(fig, left=left, right=right, bottom=0.5, top=_title_in(title))
    return fig


def _bar_label(r: Any, noisy: bool, provisional: bool) -> str:
    """A bar's annotation: its time, its speed-up over the loop (or its time over forward+backward), a flag."""
    if r.speedup_vs_loop is not None:
        extra = "loop" if r.strategy == "loop" else f"{fmt_ratio(r.speedup_vs_loop)} vs loop"
    elif r.vs_forward_backward is not None and r.strategy != FORWARD_BACKWARD:
        extra = f"{fmt_ratio(r.vs_forward_backward)} fwd+bwd"
    else:
        extra = ""
    flag = " ⚠ noisy" if noisy else (" provisional" if provisional else "")
    return fmt_seconds(r.median_s) + (f" ({extra})" if extra else "") + flag


def fit_text(text: str, width_in: float, fontsize_pt: float = 10.0) -> str:
    """``text`` wrapped to lines that fit ``width_in`` inches at ``fontsize_pt`` (about 0.55 em per character),
    for titles that must stay inside their figure."""
    chars = max(10, int(width_in * 72 / (0.55 * fontsize_pt)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


# --------------------------------------------------------------------------------------------- heatmaps


def _to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().to("cpu")
        if not values.dtype.is_floating_point or values.dtype.itemsize < 4:
            values = values.float()
        values = values.numpy()
    return np.asarray(values, dtype=np.float64 if np.asarray(values).dtype == np.float64 else np.float32)


def _segments(boundaries: Boundaries | None, p: int) -> list[tuple[str, int, int]]:
    if boundaries is None:
        return [("parameters", 0, p)]
    flat = ([(str(n), int(a), int(b)) for n, (a, b) in boundaries.items()] if isinstance(boundaries, Mapping)
            else [(str(n), int(a), int(b)) for n, a, b in boundaries])
    flat.sort(key=lambda s: s[1])
    pos = 0
    for name, a, b in flat:
        if a != pos or b <= a:
            raise ValueError(f"boundaries must tile the columns 0..P={p} in order without gaps or overlaps: "
                             f"{name!r} covers [{a}, {b}) but the previous layer ends at {pos}; build them with "
                             "param_boundaries(model)")
        pos = b
    if pos != p:
        raise ValueError(f"boundaries end at column {pos} but the values have P={p} columns: are they for this "
                         "model? Build them with param_boundaries(model)")
    return flat


def _layer_widths(sizes: Sequence[int], min_frac: float) -> np.ndarray:
    """Display widths (fractions summing to 1): proportional to ``sizes``, but at least ``min_frac`` each."""
    sizes_arr = np.asarray(sizes, dtype=np.float64)
    frac = sizes_arr / sizes_arr.sum()
    if min_frac <= 0 or len(sizes) * min_frac >= 1:
        return frac if min_frac <= 0 else np.full(len(sizes), 1 / len(sizes))
    small = frac < min_frac
    while True:  # fix the small ones at min_frac, share the rest proportionally; repeat until stable
        rest = 1 - min_frac * small.sum()
        widths = np.where(small, min_frac, frac / frac[~small].sum() * rest)
        grown = small | (widths < min_frac)
        if (grown == small).all():
            return widths
        small = grown


def _maxabs_pool(a: np.ndarray, factor: int, axis: int) -> np.ndarray:
    """Pool ``factor`` consecutive entries along ``axis`` into the one of largest magnitude (sign kept).

    Reads ``a`` through views (max and min per block, no padded or absolute-value copy), so pooling a
    (256, 400k) gradient for display costs two passes over it."""
    if factor <= 1:
        return a
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1]
    full = n // factor * factor
    parts = []
    if full:
        blocks = a[..., :full].reshape(*a.shape[:-1], full // factor, factor)
        parts.append((blocks.max(axis=-1), blocks.min(axis=-1)))
    if full < n:
        rest = a[..., full:]
        parts.append((rest.max(axis=-1, keepdims=True), rest.min(axis=-1, keepdims=True)))
    hi = np.concatenate([p[0] for p in parts], axis=-1)
    lo = np.concatenate([p[1] for p in parts], axis=-1)
    return np.moveaxis(np.where(hi >= -lo, hi, lo), -1, axis)


def robust_limit(values: np.ndarray, percentile: float = 99.0, max_samples: int = 2_000_000) -> float:
    """The ``percentile`` of ``|values|`` (on an even subsample past ``max_samples``); falls back to the max,
    then to 1, so that a colour scale ``(-limit, limit)`` is never empty."""
    flat = values.reshape(-1)
    if flat.size > max_samples:
        flat = flat[:: -(-flat.size // max_samples)]
    flat = np.abs(flat)
    finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        return 1.0
    limit = float(np.percentile(finite, percentile))
    if limit <= 0:
        limit = float(finite.max())
    return limit if limit > 0 else 1.0


def gradient_heatmap(grads_flat: Any, boundaries: Boundaries | None = None, *, ax: Axes | None = None,
                     title: str | None = "per-sample gradients", ylabel: str = "sample",
                     row_labels: Sequence[str] | None = None, highlight_row: int | None = None,
                     max_cols: int = 2000, max_rows: int = 1000, min_layer_frac: float = 0.05,
                     percentile: float = 99.0, cmap: str = DIVERGING, colorbar: bool = True,
                     figsize: tuple[float, float] = (9.5, 3.4)) -> Figure:
    """A heatmap of flat gradients, one row per sample (B, P) or per output (Y, P), split by layer.

    Colours are diverging and centred at 0: the limits are symmetric, ``±`` the ``percentile`` of
    ``|values|`` (values beyond are clipped; the colour bar says so). Each layer is drawn as its own block
    of columns, separated by vertical lines and labelled with its name and size below the axis.

    Wide results are pooled for display: within each layer, consecutive columns (and, past ``max_rows``,
    rows) are merged into the entry of largest magnitude, keeping its sign, so a single large value is
    never averaged away. Each layer gets display columns in proportion to its share of P, so the total
    stays at most about ``max_cols`` (choose it near the axes' width in pixels); a block never mixes two
    layers, so the boundaries stay exact. Layers smaller than ``min_layer_frac`` of P (biases, a small
    last layer) are widened to that share of the width so that they stay visible; the x axis then runs
    over the display (``0..P`` in widened coordinates) and the labels give the true sizes. With
    ``min_layer_frac=0`` the x coordinate is the parameter index itself.

    Args:
        grads_flat: (B, P) or (Y, P) tensor or array (a 1-D (P,) is one row).
        boundaries: ``{name: (start, stop)}`` or ``[(name, start, stop), ...]`` tiling ``0..P``, e.g.
            :func:`param_boundaries` of the model; default: one block.
        ax: draw into this axes (default: a new figure).
        title, ylabel: text; ``row_labels`` names the rows (e.g. class names of a Jacobian's outputs).
        highlight_row: outline this row (e.g. the sample shown elsewhere).
        max_cols, max_rows: display size budget. percentile: the robust colour limit.
        figsize: of a new figure, in inches.

    Returns:
        The figure. Its axes holds one image per layer (``ax.images``) and the boundary lines.
    """
    data = _to_numpy(grads_flat)
    if data.ndim == 1:
        data = data[None]
    if data.ndim != 2 or data.shape[1] == 0 or data.shape[0] == 0:
        raise ValueError(f"grads_flat must be a non-empty (B, P) or (Y, P) matrix, got shape {data.shape}; "
                         "for a (B, Y, P) Jacobian pass one sample's (Y, P), e.g. J[i]")
    rows, p = data.shape
    segs = _segments(boundaries, p)
    limit = robust_limit(data, percentile)
    largest = 0.0
    row_factor = -(-rows // max_rows)
    widths = _layer_widths([b - a for _, a, b in segs], min_layer_frac)
    edges = np.concatenate([[0.0], np.cumsum(widths)]) * p
    edges[-1] = p

    fig, ax, new = _fixed_axes(ax, figsize)
    image = None
    for (name, a, b), x0, x1, w in zip(segs, edges[:-1], edges[1:], widths, strict=True):
        size = b - a
        cols = max(1, min(size, int(max_cols * w)))
        block = _maxabs_pool(_maxabs_pool(data[:, a:b], -(-size // cols), axis=1), row_factor, axis=0)
        largest = max(largest, float(np.nanmax(np.abs(block))))  # pooling keeps each block's largest |value|
        image = ax.imshow(block, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest",
                          extent=(x0, x1, rows, 0))
        image.set_label(name)
    for x in edges[1:-1]:
        ax.axvline(x, color="black", linewidth=0.9)
    ax.set_xlim(0, p)
    ax.set_ylim(rows, 0)
    centres = (edges[:-1] + edges[1:]) / 2
    crowded = len(segs) > 1 and widths.min() < 0.12
    ticks = [f"{n} ({b - a:,})" if crowded else f"{n}\n{b - a:,}" for n, a, b in segs]
    ax.set_xticks(centres, ticks, fontsize="small", rotation=25 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor")
    ax.tick_params(axis="x", length=0)
    widened = min_layer_frac > 0 and not np.allclose(widths, [(b - a) / p for _, a, b in segs])
    ax.set_xlabel(f"trainable parameters by layer (P = {p:,})"
                  + (f"; layers under {min_layer_frac:.0%} of P widened to stay visible" if widened else ""),
                  fontsize="small")
    labelled = row_labels is not None and len(row_labels) == rows and rows <= 40
    if labelled:
        ax.set_yticks(np.arange(rows) + 0.5, list(row_labels), fontsize="small")
    elif rows <= 16:
        ax.set_yticks(np.arange(rows) + 0.5, [str(k) for k in range(rows)], fontsize="small")
    ax.set_ylabel(ylabel)
    if highlight_row is not None and 0 <= highlight_row < rows:
        # a box around the row, and arrow heads outside the axes on both sides: visible however thin the row is
        ax.axhspan(highlight_row, highlight_row + 1, fill=False, edgecolor="black", linewidth=1.4)
        sides = ax.get_yaxis_transform()  # x in axes fraction, y in data
        ax.tick_params(axis="y", pad=9)  # the row labels clear of the left arrow head
        for x_frac, marker in ((-0.004, ">"), (1.004, "<")):
            ax.plot([x_frac], [highlight_row + 0.5], marker=marker, markersize=7, color="black", transform=sides,
                    clip_on=False, linestyle="none")
    left = 0.35 + (_text_in(row_labels, "small") if labelled else 0.35)
    if title:
        if new:
            title = fit_text(title, fig.get_figwidth() - left - 0.9)
        ax.set_title(title, fontsize="medium")
    if colorbar and image is not None:
        clipped = largest > limit
        fig.colorbar(image, ax=ax, extend="both" if clipped else "neither", pad=0.01, fraction=0.04,
                     label=f"±{limit:.2g} = {percentile:g}th pct of |value|" if clipped else f"±{limit:.2g}")
    if new:
        bottom = 0.3 + (0.45 * _text_in(ticks, "small") + 0.1 if crowded else 0.4)
        _place(fig, left=left, right=0.75 if colorbar else 0.15, bottom=bottom, top=_title_in(title))
    return fig


def first_layer_images(weight_grad: Any, *, image: Any = None, titles: Sequence[str] | None = None,
                       ncols: int = 5, suptitle: str | None = None, image_title: str = "input",
                       cmap: str = DIVERGING, cell: float = 1.6, image_shape: tuple[int, int] | None = None) -> Figure:
    """K small images of first-layer weight gradients (or Jacobian rows), in a diverging colour map.

    Args:
        weight_grad: (K, 784) or (K, 28, 28) (any (K, H*W) with a square H*W, or (K, H, W)): e.g. one row
            of ``fc1.weight``'s gradient per hidden unit, or one image per output class for a Jacobian.
        image: (784,), (28, 28) or (1, 28, 28): the input, shown first in grey; ``image_shape`` (H, W) draws it
            at its own shape where it differs from the gradients' (a convolution's 3x3 kernels of a 28x28 image).
        titles: K titles (default ``"0", "1", ...``).
        ncols: images per row. suptitle: a title over all. cell: each image's side, in inches.

    Colours are symmetric around 0 with one scale for all K images (``±`` the largest ``|value|``), so
    they can be compared; a colour bar gives the scale.

    Returns:
        The figure: one axes per image (the input first), plus the colour bar's.
    """
    grads = _to_numpy(weight_grad)
    if grads.ndim == 2:
        side = math.isqrt(grads.shape[1])
        if side * side != grads.shape[1]:
            raise ValueError(f"weight_grad of shape {grads.shape}: the second dimension must be a square "
                             "number of pixels (784 = 28x28), or pass (K, H, W)")
        grads = grads.reshape(grads.shape[0], side, side)
    if grads.ndim != 3 or grads.shape[0] == 0:
        raise ValueError(f"weight_grad must be (K, H*W) or (K, H, W) with K >= 1, got shape {grads.shape}")
    k, h, w = grads.shape
    if titles is not None and len(titles) != k:
        raise ValueError(f"got {len(titles)} titles for {k} images")
    panels = k + (image is not None)
    ncols = max(1, min(ncols, panels))
    nrows = -(-panels // ncols)
    # a fixed grid (no constrained layout: it costs more than drawing these untitled, tick-free images)
    title_in, bar_in = 0.22, 0.75
    width = cell * ncols + bar_in
    if suptitle:  # wrapped to the figure's width: it must not run off the edges
        suptitle = fit_text(suptitle, width - 0.2)
    top_in = 0.2 + 0.22 * (suptitle.count("\n") + 1) if suptitle else 0.1
    height = (cell + title_in) * nrows + top_in
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.08 / width, right=1 - bar_in / width, bottom=0.05 / height, top=1 - top_in / height,
                        wspace=0.08, hspace=title_in / cell + 0.05)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for extra in axes[panels:]:
        fig.delaxes(extra)
    axes = axes[:panels]
    if image is not None:
        img = _to_numpy(image)
        if image_shape is not None and img.size == image_shape[0] * image_shape[1]:
            h, w = image_shape
        elif img.size != h * w:
            raise ValueError(f"image has {img.size} pixels but the gradients are {h}x{w} images: pass the input "
                             f"sample itself, shape ({h * w},) or ({h}, {w})")
        axes[0].imshow(img.reshape(h, w), cmap="gray", interpolation="nearest")
        axes[0].set_title(image_title, fontsize="small")
        axes = axes[1:]
    limit = float(np.abs(grads).max()) or 1.0
    shown = None
    for j, a in enumerate(axes):
        shown = a.imshow(grads[j], cmap=cmap, vmin=-limit, vmax=limit, interpolation="nearest")
        a.set_title(titles[j] if titles is not None else str(j), fontsize="small")
    for a in fig.axes:
        a.set_xticks([])
        a.set_yticks([])
    if shown is not None:
        bar = fig.add_axes((1 - (bar_in - 0.15) / width, 0.15, 0.12 / width, 1 - top_in / height - 0.2))
        fig.colorbar(shown, cax=bar)
        bar.tick_params(labelsize="small")
    if suptitle:
        fig.suptitle(suptitle, fontsize="medium", y=1 - 0.08 / height, va="top")
    return fig


# --------------------------------------------------------------------------------------------- applications


def image_grid(images: Any, *, titles: Sequence[str] | None = None, ncols: int = 8, suptitle: str | None = None
               ) -> Figure:
    """Input images in grey with a title each (e.g. "given: Shirt / predicted: Coat").

    Args:
        images: (K, 784), (K, 28, 28) or (K, 1, 28, 28).
        titles: K titles.
    """
    imgs = _to_numpy(images)
    k = imgs.shape[0]
    side = math.isqrt(imgs[0].size)
    if k == 0 or side * side != imgs[0].size:
        raise ValueError(f"images must be (K, H*W) or (K, H, W) square images with K >= 1, got {imgs.shape}")
    if titles is not None and len(titles) != k:
        raise ValueError(f"got {len(titles)} titles for {k} images")
    imgs = imgs.reshape(k, side, side)
    ncols = max(1, min(ncols, k))
    nrows = -(-k // ncols)
    fig = Figure(figsize=(1.5 * ncols, 1.75 * nrows + (0.4 if suptitle else 0)), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for j, a in enumerate(axes):
        a.set_axis_off()
        if j < k:
            a.imshow(imgs[j], cmap="gray", interpolation="nearest")
            if titles is not None:
                a.set_title(titles[j], fontsize="x-small")
    if suptitle:
        fig.suptitle(suptitle, fontsize="medium")
    return fig


def aligned_edges(max_value: float, threshold: float, bins: int = 30) -> np.ndarray:
    """Histogram bin edges from 0 to at least ``max_value`` with ``threshold`` on an edge (about ``bins`` bins):
    the bin width is ``threshold / k`` for a whole k, so no bin straddles the threshold."""
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    top = max(float(max_value), threshold) * 1.0001
    k = max(1, round(bins * threshold / top))
    step = threshold / k
    return np.arange(0, math.ceil(top / step) + 1) * step


def right_closed_counts(values: Any, edges: np.ndarray, rtol: float = 1e-5) -> np.ndarray:
    """Counts of ``values`` in right-closed bins (edges[j-1], edges[j]] (the first also takes edges[0]); a value
    within ``rtol`` of an edge counts as on it, so a norm clipped to exactly C (up to rounding) lands in the
    bin that ends at C, left of a line drawn at C."""
    v = _to_numpy(values).ravel().astype(np.float64)
    idx = np.searchsorted(edges, v * (1 - rtol), side="left")
    idx = np.clip(idx, 1, len(edges) - 1) - 1
    return np.bincount(idx, minlength=len(edges) - 1)[: len(edges) - 1]


def norm_histogram(before: Any, after: Any, max_norm: float, *, bins: int = 40) -> Figure:
    """Histograms of per-sample gradient norms (B,) before and after clipping to ``max_norm``.

    The bins are aligned to C = ``max_norm`` (C is a bin edge) and closed on the right, so norms clipped to
    exactly C sit in the bin left of the C line."""
    b, a = _to_numpy(before).ravel(), _to_numpy(after).ravel()
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    edges = aligned_edges(max(float(b.max()), float(a.max())), max_norm, bins)
    widths = np.diff(edges)
    for values, label, color in ((b, "before clipping", "tab:blue"), (a, "after clipping", "tab:orange")):
        ax.bar(edges[:-1], right_closed_counts(values, edges), width=widths, align="edge", alpha=0.6, label=label,
               color=color)
    ax.axvline(max_norm, color="k", linestyle="--", linewidth=1, label=f"max_norm C = {max_norm:g}")
    ax.set_xlim(0, edges[-1])
    ax.set_xlabel("per-sample gradient L2 norm (bins aligned to C)")
    ax.set_ylabel("samples")
    ax.legend(fontsize="small")
    return fig


def clipping_figure(total: Any, layers: Mapping[str, Any], max_norm: float, *, sums: tuple[float, float] | None = None,
                    title: str | None = None, bins: int = 30, width: float = 7.5) -> Figure:
    """The DP-SGD view: per-sample gradient norms and what clipping them to ``max_norm`` does.

    Args:
        total: (B,) norms of the whole per-sample gradients (what DP-SGD clips).
        layers: ``{layer: (B,) norms}`` of each layer's part (their squares add up to ``total**2``).
        max_norm: the clipping threshold C (a bin edge: bins are aligned to it and closed on the right).
        sums: (||sum of the plain gradients||, ||sum of the clipped gradients||), shown under the title.
        title: default names B.
        width: in inches.

    Returns:
        The figure: the total's histogram on top (samples beyond C in orange: they get clipped), the
        layers' histograms (outlines) below, on the same x axis; the C line on both.
    """
    t = _to_numpy(total).ravel()
    if t.size == 0:
        raise ValueError("no norms to plot: pass the (B,) per-sample gradient norms")
    parts = {name: _to_numpy(v).ravel() for name, v in layers.items()}
    edges = aligned_edges(float(np.nanmax(t)), max_norm, bins)
    widths, left = np.diff(edges), edges[:-1]
    fig = Figure(figsize=(width, 4.3))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.3, 1])
    counts = right_closed_counts(t, edges)
    beyond = left >= max_norm * (1 - 1e-9)
    top.bar(left[~beyond], counts[~beyond], width=widths[~beyond], align="edge", color="tab:blue",
            label="kept as they are (norm <= C)")
    top.bar(left[beyond], counts[beyond], width=widths[beyond], align="edge", color="tab:orange",
            label="scaled down to norm C")
    clipped = int((t > max_norm * (1 + 1e-5)).sum())
    for k, (name, values) in enumerate(parts.items()):
        bottom.stairs(right_closed_counts(values, edges), edges, color=_PALETTE[(k + 4) % len(_PALETTE)],
                      linewidth=1.6, label=name)
    for ax in (top, bottom):
        line = ax.axvline(max_norm, color="k", linestyle="--", linewidth=1)
        ax.set_ylabel("samples")
        ax.grid(True, axis="y", alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if ax is top:
            line.set_label(f"the threshold C = {max_norm:.3g}")  # named in the legend, never on a bar
    top.set_ylim(0, max(1, int(counts.max())) * 1.6)  # headroom: the legend sits above the bars
    layer_max = max((int(right_closed_counts(v, edges).max()) for v in parts.values()), default=1)
    bottom.set_ylim(0, max(1, layer_max) * 1.5)
    top.legend(fontsize="small", loc="upper right")
    bottom.legend(fontsize="small", loc="upper right", title="per layer", title_fontsize="small")
    bottom.set_xlim(0, edges[-1])
    bottom.set_xlabel("per-sample gradient L2 norm (bins aligned to C)")
    line = f"clipped: {clipped} of {t.size} samples ({clipped / t.size:.0%})"
    if sums is not None:
        plain, after = sums
        line += f"; ||sum clipped|| = {after:.3g} vs ||sum plain|| = {plain:.3g}"
    head = title if title is not None else f"per-sample gradient norms, B={t.size}"
    text = fit_text(f"{head}\n{line}", width - 0.9)
    top.set_title(text, fontsize="medium")
    _place(fig, left=0.7, right=0.2, bottom=0.55, top=_title_in(text), hspace=0.08)
    return fig


def _inches(fig: Figure, x0: float, y0: float, w: float, h: float) -> Axes:
    """A new axes at (x0, y0) of size (w, h), all in inches from the figure's lower left corner."""
    fw, fh = fig.get_size_inches()
    return fig.add_axes((x0 / fw, y0 / fh, w / fw, h / fh))


def outer_product_figure(a: Any, g: Any, *, gradient_norm: float | None = None, title: str | None = None,
                         image_shape: tuple[int, int] = (28, 28), width: float = 9.0) -> Figure:
    """How the fast rule works for a Linear layer: one sample's input a (the image), the backprop signal g at
    the layer's output (one bar per unit), and their outer product g a^T, which *is* the sample's gradient of
    the layer's weight; with ||g a^T|| = ||g|| ||a|| (the ghost-norm identity) shown with its numbers.

    Args:
        a: (in,) the layer's input for the sample (``in`` = H*W of ``image_shape``).
        g: (out,) the gradient of the sample's loss with respect to the layer's output.
        gradient_norm: the norm of the sample's weight gradient as computed elsewhere (e.g. from
            ``per_sample_grads``): shown next to ||g|| ||a|| to check the identity.
        title: over the three panels. width: in inches (at least 6): from 8.5 the three panels in a row, below
            it the product under the other two.
    """
    a_np, g_np = _to_numpy(a).ravel(), _to_numpy(g).ravel()
    h, w = image_shape
    if a_np.size != h * w:
        raise ValueError(f"a has {a_np.size} values, not an image of {h}x{w}: pass image_shape=")
    if g_np.size == 0:
        raise ValueError("g is empty: pass the (out,) gradient at the layer's output")
    outer = np.outer(g_np, a_np)  # (out, in)
    a_norm, g_norm = float(np.linalg.norm(a_np)), float(np.linalg.norm(g_np))
    width = max(width, 6.0)
    head = fit_text(title, width - 0.3) if title else ""
    head_in = 0.21 * (head.count("\n") + 1) + 0.05 if head else 0
    check = f" (per_sample_grads: {gradient_norm:.5g})" if gradient_norm is not None else ""
    identity = fit_text(f"||g_i a_i^T|| = ||g_i|| ||a_i|| = {g_norm:.5g} x {a_norm:.5g} = {g_norm * a_norm:.5g}"
                        f"{check}: the ghost-norm trick", width - 0.3)
    foot = 0.6 + 0.21 * (identity.count("\n") + 1)  # x label, then the identity
    if width >= 8.5:  # one row: the input, the signal, their product
        top = 0.55 + head_in  # the panels' two-line titles + title
        height = 2.5 + top + foot
        fig = Figure(figsize=(width, height))
        panel = height - top - foot
        ax_a = _inches(fig, 0.15, foot, panel, panel)
        ax_g = _inches(fig, 0.15 + panel + 0.6, foot, 1.8, panel)
        x_o = 0.15 + panel + 0.6 + 1.8 + 0.75
        ax_o = _inches(fig, x_o, foot, width - x_o - 0.95, panel)
        ax_c = _inches(fig, width - 0.8, foot, 0.12, panel)
    else:  # two rows: the input and the signal above, their product below at the whole width
        upper, lower, gap = 1.9, 1.5, 0.95  # gap: the signal's x label, then the product's two-line title
        top = 0.55 + head_in
        height = top + upper + gap + lower + foot
        fig = Figure(figsize=(width, height))
        ax_a = _inches(fig, 0.15, foot + lower + gap, upper, upper)
        x_g = 0.15 + upper + 0.75
        ax_g = _inches(fig, x_g, foot + lower + gap, width - x_g - 0.25, upper)
        ax_o = _inches(fig, 0.6, foot, width - 0.6 - 0.95, lower)
        ax_c = _inches(fig, width - 0.8, foot, 0.12, lower)
    ax_a.imshow(a_np.reshape(h, w), cmap="gray", interpolation="nearest")
    ax_a.set_title(f"the input a_i\n||a_i|| = {a_norm:.5g}", fontsize="small")
    ax_a.set_xticks([])
    ax_a.set_yticks([])
    units = np.arange(g_np.size)
    line_pt = max(0.5, min(8.0, 0.8 * 1.8 * 72 / g_np.size))  # bars as lines: cheap for 512 units
    ax_g.vlines(units, 0, g_np, colors=np.where(g_np >= 0, "tab:red", "tab:blue"), linewidth=line_pt)
    ax_g.axhline(0, color="0.3", linewidth=0.6)
    ax_g.set_xlim(-0.5, g_np.size - 0.5)
    span = float(np.abs(g_np).max()) or 1.0
    ax_g.set_ylim(-1.1 * span, 1.1 * span)
    ax_g.set_xlabel("hidden unit", fontsize="small")
    ax_g.set_title(f"the backprop signal g_i\n||g_i|| = {g_norm:.5g}", fontsize="small")
    ax_g.tick_params(labelsize="x-small")
    limit = float(np.abs(outer).max()) or 1.0
    shown = ax_o.imshow(outer, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax_o.set_xlabel("input pixel (0..783)", fontsize="small")
    ax_o.set_ylabel("hidden unit", fontsize="small")
    ax_o.tick_params(labelsize="x-small")
    ax_o.set_title("their outer product g_i a_i^T\n= the sample's gradient of the weight", fontsize="small")
    fig.colorbar(shown, cax=ax_c).ax.tick_params(labelsize="x-small")
    for axis in (ax_g.xaxis, ax_o.yaxis):  # hidden units are whole numbers
        axis.set_major_locator(MaxNLocator(integer=True, nbins="auto"))
    fig.text(0.15 / width, 0.1 / height, identity, fontsize="medium", va="bottom")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig


def grouped_heatmap(matrix: Any, groups: Any, *, group_names: Sequence[str] | None = None, title: str = "",
                    symmetric: bool = True, cmap: str | None = None, label: str = "") -> Figure:
    """An (N, N) matrix of samples sorted by group (e.g. class), with the group blocks outlined.

    Args:
        matrix: (N, N), e.g. cosine similarities of per-sample gradients or an empirical NTK.
        groups: (N,) group id of each row/column, sorted (rows of one group are adjacent).
        symmetric: colour limits symmetric around 0 (diverging map); else a sequential map from the minimum.
    """
    m, g = _to_numpy(matrix), _to_numpy(groups).ravel()
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] != g.size:
        raise ValueError(f"matrix must be (N, N) and groups (N,), got {m.shape} and {g.shape}")
    if np.any(np.diff(g) < 0):
        raise ValueError("groups must be sorted: order the samples by group first (e.g. torch.argsort(labels))")
    fig = Figure(figsize=(6.2, 5.2), layout="constrained")
    ax = fig.add_subplot()
    if symmetric:
        limit = float(np.abs(m).max()) or 1.0
        shown = ax.imshow(m, cmap=cmap or DIVERGING, vmin=-limit, vmax=limit, interpolation="nearest")
    else:
        shown = ax.imshow(m, cmap=cmap or "viridis", interpolation="nearest")
    starts = [0, *np.flatnonzero(np.diff(g)) + 1, g.size]
    for s in starts[1:-1]:
        ax.axhline(s - 0.5, color="k", linewidth=0.6)
        ax.axvline(s - 0.5, color="k", linewidth=0.6)
    centres = [(a + b - 1) / 2 for a, b in zip(starts[:-1], starts[1:], strict=True)]
    names = [group_names[int(g[s])] if group_names is not None else str(g[s]) for s in starts[:-1]]
    ax.set_xticks(centres, names, rotation=60, ha="right", fontsize="x-small")
    ax.set_yticks(centres, names, fontsize="x-small")
    fig.colorbar(shown, ax=ax, label=label)
    if title:
        ax.set_title(title, fontsize="medium")
    return fig


def _matrix(ax: Axes, m: np.ndarray, title: str, width_in: float) -> Any:
    limit = float(np.abs(m).max()) or 1.0
    shown = ax.imshow(m, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set_title(f"{fit_text(title, width_in, 8.0)}\n{m.shape[0]} x {m.shape[1]}", fontsize="small")
    ax.tick_params(labelsize="x-small")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True, nbins=5))
    return shown


def factor_figure(left: Any, right: Any, product: Any, *, names: Sequence[str] = ("left", "right", "product"),
                  gradient_norm: float | None = None, difference: float | None = None, title: str | None = None,
                  width: float = 6.9) -> Figure:
    """How a layer's fast rule writes one sample's weight gradient as a product of two factors that one batched
    forward and backward provide: ``left @ right = product`` (a convolution: the signal at each output position
    times the unfolded input patches; an embedding: the one-hot rows of the tokens times the signal at each token),
    each drawn as a heatmap, with the check against the per-sample gradient computed elsewhere.

    Args:
        left: (m, k); right: (k, n); product: (m, n), the weight's gradient (flattened to 2-D).
        names: the three panels' titles. gradient_norm: ||the per-sample gradient|| from per_sample_grads;
        difference: max |product - that gradient|. title: over all. width: in inches.
    """
    a, b, c = (_to_numpy(t) for t in (left, right, product))
    if a.ndim != 2 or b.ndim != 2 or c.shape != (a.shape[0], b.shape[1]) or a.shape[1] != b.shape[0]:
        raise ValueError(f"factors of shapes {a.shape} @ {b.shape} do not give the product's {c.shape}")
    head = fit_text(title, width - 0.3) if title else ""
    head_in = 0.21 * (head.count("\n") + 1) + 0.1 if head else 0
    line = f"||product|| = {np.linalg.norm(c):.5g}"
    if gradient_norm is not None:
        line += f" (per_sample_grads: {gradient_norm:.5g})"
    if difference is not None:
        line += f"; max |product - per_sample_grads| = {difference:.1e}"
    line = fit_text(line, width - 0.3)
    foot = 0.45 + 0.21 * (line.count("\n") + 1)
    half = (width - 0.5 - 0.7) / 2
    lines = max(fit_text(n, half - 0.3, 8.0).count("\n") for n in names[:2])  # the upper titles' extra lines
    panel, gap = 1.9, 0.95
    height = head_in + 0.6 + 0.17 * lines + panel + gap + panel + foot
    fig = Figure(figsize=(width, height))
    y_top = foot + panel + gap
    ax_l = _inches(fig, 0.5, y_top, half - 0.1, panel)
    ax_r = _inches(fig, 0.5 + half + 0.6, y_top, half - 0.1, panel)
    ax_p = _inches(fig, 0.5, foot, width - 0.5 - 0.95, panel)
    ax_c = _inches(fig, width - 0.8, foot, 0.12, panel)
    _matrix(ax_l, a, names[0], half - 0.3)
    _matrix(ax_r, b, names[1], half - 0.3)
    fig.text((0.5 + half + 0.25) / width, (y_top + panel / 2) / height, "@", fontsize="x-large", ha="center",
             va="center")
    shown = _matrix(ax_p, c, f"= {names[2]}: the sample's weight gradient", width - 1.2)
    fig.colorbar(shown, cax=ax_c).ax.tick_params(labelsize="x-small")
    fig.text(0.15 / width, 0.1 / height, line, fontsize="medium", va="bottom")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig


def token_figure(tokens: Any, matrix: Any, *, grid: tuple[int, int] | None = None, row_labels: Sequence[str] = (),
                 matrix_title: str = "", xlabel: str = "", title: str | None = None, width: float = 7.4) -> Figure:
    """A token sequence as tokens (left: the ids in reading order on a ``grid``, each cell shaded by its id) next
    to a matrix about them (right: e.g. an embedding's per-sample gradient, one row per token id).

    Args:
        tokens: (T,) integer ids, or None (the matrix alone). grid: (rows, cols) with rows x cols = T (default one
            row). matrix: (R, C). row_labels: R labels (shown up to 40 rows). title: over all. width: in inches.
    """
    m = _to_numpy(matrix)
    if m.ndim != 2:
        raise ValueError(f"matrix must be 2-D, got shape {m.shape}")
    head = fit_text(title, width - 0.3) if title else ""
    head_in = 0.21 * (head.count("\n") + 1) + 0.1 if head else 0
    height = head_in + 0.55 + 2.6 + 0.55
    fig = Figure(figsize=(width, height))
    x0 = 0.3
    if tokens is not None:
        ids = _to_numpy(tokens).astype(int).ravel()
        rows, cols = grid if grid is not None and grid[0] * grid[1] == ids.size else (1, ids.size)
        side = min(2.6, 2.6 * cols / max(rows, cols))
        ax_t = _inches(fig, x0, 0.55, side, 2.6 * rows / max(rows, cols))
        ax_t.imshow(ids.reshape(rows, cols), cmap="gray", vmin=0, vmax=max(1, int(ids.max())), aspect="equal",
                    interpolation="nearest")
        if ids.size <= 64:
            for k, v in enumerate(ids):
                ax_t.text(k % cols, k // cols, str(v), ha="center", va="center", fontsize="small",
                          color="white" if v < ids.max() / 2 else "black")
        ax_t.set_xticks([])
        ax_t.set_yticks([])
        ax_t.set_title(f"the sample's {ids.size} tokens", fontsize="small")
        x0 += side + 0.3
    labelled = 0 < len(row_labels) == m.shape[0] and m.shape[0] <= 40
    left = x0 + (_text_in(row_labels, "x-small") + 0.15 if labelled else 0.35)
    ax_m = _inches(fig, left, 0.55, width - left - 0.95, 2.6)
    limit = float(np.abs(m).max()) or 1.0
    shown = ax_m.imshow(m, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    if labelled:
        ax_m.set_yticks(np.arange(m.shape[0]), list(row_labels), fontsize="x-small")
    ax_m.tick_params(labelsize="x-small")
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax_m.set_title(matrix_title, fontsize="small")
    ax_m.set_xlabel(xlabel, fontsize="small")
    fig.colorbar(shown, cax=_inches(fig, width - 0.8, 0.55, 0.12, 2.6)).ax.tick_params(labelsize="x-small")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig
