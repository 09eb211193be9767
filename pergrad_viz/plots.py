"""Matplotlib figures: runtime curves and bars from benchmark records, gradient heatmaps, first-layer images.

Every function builds on the object API (:class:`matplotlib.figure.Figure`, never ``pyplot``), so no
figure is registered globally and nothing leaks: a figure is freed once the caller drops it. Each
function returns the :class:`~matplotlib.figure.Figure` it drew on; pass ``ax=`` to draw into an
existing axes instead. In a notebook, show a figure by leaving it as a cell's last expression (inline
backend) or with :func:`to_png`; everything works headless (the Agg renderer).

The plots take plain data (benchmark :class:`~pergrad_viz.bench.Record` s, tensors or arrays, names and
shapes) and know nothing of how a strategy computes them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .bench import FORWARD_BACKWARD, MEMORY_FLOOR
from .strategies import STRATEGIES

__all__ = [
    "bar_figure",
    "grouped_heatmap",
    "image_grid",
    "norm_histogram",
    "first_layer_images",
    "gradient_heatmap",
    "param_boundaries",
    "robust_limit",
    "runtime_figure",
    "to_png",
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


def to_png(fig: Figure, *, dpi: float | None = None, close: bool = True) -> bytes:
    """The figure rendered as PNG bytes (e.g. for ``ipywidgets.Image``); with ``close`` its artists are cleared."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    if close:
        fig.clear()
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- runtime


def _fmt_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _skip_text(timed: list[int], skipped: list[int], short: str) -> str:
    if not skipped:
        return ""
    if not timed:
        return f" (skipped at every {short})" if len(skipped) > 1 else f" (skipped at {short}={skipped[0]})"
    if min(skipped) > max(timed):
        return f" (skipped above {short}={max(timed)})"
    return f" (skipped at {short}={', '.join(map(str, skipped))})"


def runtime_figure(records: Iterable[Any], *, x: str = "batch_size", ax: Axes | None = None,
                   title: str | None = None, highlight: int | None = None) -> Figure:
    """Median time per call against batch size (or hidden width), log-log, one line per method.

    Args:
        records: benchmark records (:class:`pergrad_viz.bench.Record` or anything with its attributes
            ``strategy, quantity, batch_size, hidden, median_s, iqr_s``). Error bars span the interquartile
            range (median ± IQR/2). The reference rows ``forward+backward`` and ``memory floor`` are drawn
            dashed in grey. Skipped records (``median_s is None``) are not drawn but named in the legend,
            e.g. ``loop (skipped above B=64)``.
        x: ``"batch_size"`` or ``"hidden"``. When the records hold several values of the other one (or
            several quantities), each line is labelled with it.
        ax: draw into this axes (default: a new figure).
        title: default: the quantity and the fixed setting.
        highlight: an x value to mark with a dotted vertical line (e.g. the current batch size).

    Returns:
        The figure.

    Raises:
        ValueError: no records, or an unknown ``x``.
    """
    records = list(records)
    if x not in _X_AXES:
        raise ValueError(f"x must be one of {', '.join(map(repr, _X_AXES))}, got {x!r}")
    if not records:
        raise ValueError("no records to plot: pass the list returned by pergrad_viz.bench.sweep(...)")
    other = "hidden" if x == "batch_size" else "batch_size"
    xlabel, short = _X_AXES[x]
    others = sorted({getattr(r, other) for r in records})
    quantities = sorted({r.quantity for r in records})

    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r.strategy, r.quantity, getattr(r, other)), []).append(r)
    # methods in order of first appearance, references last
    order = sorted(groups, key=lambda k: (k[0] in REFERENCES, REFERENCES.index(k[0]) if k[0] in REFERENCES else 0))

    fig, ax = _new_axes(ax, (7.0, 4.0))
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
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def bar_figure(records: Iterable[Any], *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Horizontal bars of the median time of every method at one setting, annotated with the speed-up vs loop.

    Args:
        records: the records of one (quantity, batch size, hidden width), e.g.
            ``[r for r in records if r.batch_size == 32]``. Skipped methods get no bar but their note;
            where ``loop`` was not timed, the annotation is the time relative to forward+backward.
        ax, title: as in :func:`runtime_figure`.

    Raises:
        ValueError: no records, or records of several settings.
    """
    records = list(records)
    if not records:
        raise ValueError("no records to plot: pass the records of one setting")
    settings = {(r.quantity, r.batch_size, r.hidden) for r in records}
    if len(settings) > 1:
        raise ValueError(f"bar_figure shows one setting, got {len(settings)}: {sorted(settings)}; filter the "
                         "records first, e.g. [r for r in records if r.batch_size == B and r.hidden == H]")
    (quantity, batch, hidden), = settings
    fig, ax = _new_axes(ax, (6.0, 0.45 * len(records) + 1.3))
    timed = [r.median_s for r in records if r.median_s is not None]
    left = min(timed) / 3 if timed else 1e-3
    for k, r in enumerate(records):
        ref = r.strategy in REFERENCES
        if r.median_s is None:
            ax.text(left * 1.1, k, f"skipped: {r.note.removeprefix('skipped: ')}" if r.note else "skipped",
                    va="center", fontsize="small", color="0.3", style="italic")
            continue
        ax.barh(k, r.median_s - left, left=left, color=_REFERENCE_STYLE[r.strategy]["color"] if ref
                else _color(r.strategy), hatch="//" if ref else None, alpha=0.85 if ref else 1.0)
        if r.speedup_vs_loop is not None:
            extra = "loop" if r.strategy == "loop" else f"{r.speedup_vs_loop:.3g}x vs loop"
        elif r.vs_forward_backward is not None and r.strategy != FORWARD_BACKWARD:
            extra = f"{r.vs_forward_backward:.3g}x fwd+bwd time"
        else:
            extra = ""
        ax.text(r.median_s * 1.08, k, f"{_fmt_seconds(r.median_s)}" + (f"  ({extra})" if extra else ""),
                va="center", fontsize="small")
    ax.set_xscale("log")
    ax.set_yticks(range(len(records)), [r.strategy for r in records])
    ax.set_ylim(len(records) - 0.5, -0.5)
    right = max(timed) * 12 if timed else 1.0
    ax.set_xlim(left, right)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_seconds(v)))
    ax.set_xlabel("median time per call (log scale)")
    if title is None:
        title = f"{_QUANTITY_TITLES.get(quantity, quantity)}, B={batch}, hidden={hidden}"
    ax.set_title(title, fontsize="medium")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


# --------------------------------------------------------------------------------------------- heatmaps


def param_boundaries(model_or_named_shapes: Any, *, lead: int = 0) -> list[tuple[str, int, int]]:
    """``[(name, start, stop), ...]``: each trainable parameter's columns in a flat (..., P) result.

    Args:
        model_or_named_shapes: an ``nn.Module`` (its parameters with ``requires_grad``, in
            ``named_parameters()`` order: the layout of ``per_sample_grads(..., flat=True)``), or a mapping
            / iterable of ``(name, shape or tensor)`` in flat order.
        lead: leading dimensions to ignore in the given shapes, e.g. ``lead=1`` for a per-sample gradient
            dict ``{name: (B, *param.shape)}``, ``lead=2`` for a Jacobian dict ``{name: (B, Y, *shape)}``.
    """
    if hasattr(model_or_named_shapes, "named_parameters"):
        named = [(n, p.shape) for n, p in model_or_named_shapes.named_parameters() if p.requires_grad]
    else:
        items = model_or_named_shapes.items() if isinstance(model_or_named_shapes, Mapping) else model_or_named_shapes
        named = [(n, getattr(s, "shape", s)) for n, s in items]
    out, start = [], 0
    for name, shape in named:
        n = math.prod(tuple(shape)[lead:])
        out.append((name, start, start + n))
        start += n
    return out


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
    """Pool ``factor`` consecutive entries along ``axis`` into the one of largest magnitude (sign kept)."""
    if factor <= 1:
        return a
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1]
    bins = -(-n // factor)
    padded = np.zeros((*a.shape[:-1], bins * factor), dtype=a.dtype)
    padded[..., :n] = a
    blocks = padded.reshape(*a.shape[:-1], bins, factor)
    idx = np.abs(blocks).argmax(axis=-1)[..., None]
    return np.moveaxis(np.take_along_axis(blocks, idx, axis=-1)[..., 0], -1, axis)


def robust_limit(values: np.ndarray, percentile: float = 99.0, max_samples: int = 2_000_000) -> float:
    """The ``percentile`` of ``|values|`` (on an even subsample past ``max_samples``); falls back to the max,
    then to 1, so that a colour scale ``(-limit, limit)`` is never empty."""
    flat = np.abs(values.reshape(-1))
    if flat.size > max_samples:
        flat = flat[:: -(-flat.size // max_samples)]
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
                     percentile: float = 99.0, cmap: str = DIVERGING, colorbar: bool = True) -> Figure:
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
    row_factor = -(-rows // max_rows)
    widths = _layer_widths([b - a for _, a, b in segs], min_layer_frac)
    edges = np.concatenate([[0.0], np.cumsum(widths)]) * p
    edges[-1] = p

    fig, ax = _new_axes(ax, (9.5, 3.4))
    image = None
    for (name, a, b), x0, x1, w in zip(segs, edges[:-1], edges[1:], widths, strict=True):
        size = b - a
        cols = max(1, min(size, int(max_cols * w)))
        block = _maxabs_pool(_maxabs_pool(data[:, a:b], -(-size // cols), axis=1), row_factor, axis=0)
        image = ax.imshow(block, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest",
                          extent=(x0, x1, rows, 0))
        image.set_label(name)
    for x in edges[1:-1]:
        ax.axvline(x, color="black", linewidth=0.9)
    ax.set_xlim(0, p)
    ax.set_ylim(rows, 0)
    centres = (edges[:-1] + edges[1:]) / 2
    crowded = len(segs) > 1 and widths.min() < 0.12
    ax.set_xticks(centres, [f"{n} ({b - a:,})" if crowded else f"{n}\n{b - a:,}" for n, a, b in segs],
                  fontsize="small", rotation=25 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor")
    ax.tick_params(axis="x", length=0)
    widened = min_layer_frac > 0 and not np.allclose(widths, [(b - a) / p for _, a, b in segs])
    ax.set_xlabel(f"trainable parameters by layer (P = {p:,})"
                  + (f"; layers under {min_layer_frac:.0%} of P widened to stay visible" if widened else ""),
                  fontsize="small")
    if row_labels is not None and len(row_labels) == rows and rows <= 40:
        ax.set_yticks(np.arange(rows) + 0.5, list(row_labels), fontsize="small")
    elif rows <= 16:
        ax.set_yticks(np.arange(rows) + 0.5, [str(k) for k in range(rows)], fontsize="small")
    ax.set_ylabel(ylabel)
    if highlight_row is not None and 0 <= highlight_row < rows:
        ax.axhspan(highlight_row, highlight_row + 1, fill=False, edgecolor="black", linewidth=1.2)
    if title:
        ax.set_title(title, fontsize="medium")
    if colorbar and image is not None:
        clipped = float(np.nanmax(np.abs(data))) > limit
        fig.colorbar(image, ax=ax, extend="both" if clipped else "neither", pad=0.01,
                     label=f"±{limit:.2g} = {percentile:g}th pct of |value|" if clipped else f"±{limit:.2g}")
    return fig


def first_layer_images(weight_grad: Any, *, image: Any = None, titles: Sequence[str] | None = None,
                       ncols: int = 5, suptitle: str | None = None, image_title: str = "input",
                       cmap: str = DIVERGING) -> Figure:
    """K small images of first-layer weight gradients (or Jacobian rows), in a diverging colour map.

    Args:
        weight_grad: (K, 784) or (K, 28, 28) (any (K, H*W) with a square H*W, or (K, H, W)): e.g. one row
            of ``fc1.weight``'s gradient per hidden unit, or one image per output class for a Jacobian.
        image: (784,), (28, 28) or (1, 28, 28): the input, shown first in grey.
        titles: K titles (default ``"0", "1", ...``).
        ncols: images per row. suptitle: a title over all.

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
    cell, top_in, title_in, bar_in = 1.6, (0.45 if suptitle else 0.1), 0.22, 0.75
    width, height = cell * ncols + bar_in, (cell + title_in) * nrows + top_in
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.08 / width, right=1 - bar_in / width, bottom=0.05 / height, top=1 - top_in / height,
                        wspace=0.08, hspace=title_in / cell + 0.05)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for extra in axes[panels:]:
        fig.delaxes(extra)
    axes = axes[:panels]
    if image is not None:
        img = _to_numpy(image)
        if img.size != h * w:
            raise ValueError(f"image has {img.size} pixels but the gradients are {h}x{w} images: pass the input "
                             f"sample itself, shape ({h * w},) or ({h}, {w})")
        img = img.reshape(h, w)
        axes[0].imshow(img, cmap="gray", interpolation="nearest")
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


def norm_histogram(before: Any, after: Any, max_norm: float, *, bins: int = 40) -> Figure:
    """Histograms of per-sample gradient norms (B,) before and after clipping to ``max_norm``."""
    b, a = _to_numpy(before).ravel(), _to_numpy(after).ravel()
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    edges = np.linspace(0.0, max(float(b.max()), float(a.max()), max_norm) * 1.02, bins + 1)
    ax.hist(b, bins=edges, alpha=0.6, label="before clipping", color="tab:blue")
    ax.hist(a, bins=edges, alpha=0.6, label="after clipping", color="tab:orange")
    ax.axvline(max_norm, color="k", linestyle="--", linewidth=1, label=f"max_norm C = {max_norm:g}")
    ax.set_xlabel("per-sample gradient L2 norm")
    ax.set_ylabel("samples")
    ax.legend(fontsize="small")
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
