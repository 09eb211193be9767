"""Figures of gradients themselves: flat per-sample gradients (or Jacobian rows) as a heatmap split by layer,
and a first layer's weight gradients as small images.

The figures take plain data (tensors or arrays, names and column ranges, e.g.
:func:`pergrad_viz.core.layout.param_boundaries` of a model) and know nothing of how a strategy computes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pergrad_viz.viz.canvas import (
    DIVERGING,
    TITLE_Y,
    fit_text,
    fixed_axes,
    place_margins,
    text_width_in,
    title_height_in,
    to_numpy,
)

__all__ = ["Boundaries", "first_layer_images", "gradient_heatmap", "robust_limit"]

Boundaries = Mapping[str, tuple[int, int]] | Sequence[tuple[str, int, int]]


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
    data = to_numpy(grads_flat)
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

    fig, ax, new = fixed_axes(ax, figsize)
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
    left = 0.35 + (text_width_in(row_labels, "small") if labelled else 0.35)
    if title:
        if new:
            title = fit_text(title, fig.get_figwidth() - left - 0.9)
        ax.set_title(title, fontsize="medium", y=TITLE_Y)
    if colorbar and image is not None:
        clipped = largest > limit
        fig.colorbar(image, ax=ax, extend="both" if clipped else "neither", pad=0.01, fraction=0.04,
                     label=f"±{limit:.2g} = {percentile:g}th pct of |value|" if clipped else f"±{limit:.2g}")
    if new:
        bottom = 0.3 + (0.45 * text_width_in(ticks, "small") + 0.1 if crowded else 0.4)
        place_margins(fig, left=left, right=0.75 if colorbar else 0.15, bottom=bottom, top=title_height_in(title))
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
    grads = to_numpy(weight_grad)
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
        img = to_numpy(image)
        if image_shape is not None and img.size == image_shape[0] * image_shape[1]:
            h, w = image_shape
        elif img.size != h * w:
            raise ValueError(f"image has {img.size} pixels but the gradients are {h}x{w} images: pass the input "
                             f"sample itself, shape ({h * w},) or ({h}, {w})")
        axes[0].imshow(img.reshape(h, w), cmap="gray", interpolation="nearest")
        axes[0].set_title(image_title, fontsize="small", y=TITLE_Y)
        axes = axes[1:]
    limit = float(np.abs(grads).max()) or 1.0
    shown = None
    for j, a in enumerate(axes):
        shown = a.imshow(grads[j], cmap=cmap, vmin=-limit, vmax=limit, interpolation="nearest")
        a.set_title(titles[j] if titles is not None else str(j), fontsize="small", y=TITLE_Y)
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
