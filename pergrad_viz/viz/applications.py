"""Figures of what per-sample gradients are for: the samples they single out (a grid of images), gradient norms
before and after clipping (DP-SGD), and similarity or NTK matrices of samples grouped by class.

The histograms' bins are aligned to the clipping threshold C and closed on the right, so a norm clipped to
exactly C sits left of the C line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pergrad_viz.viz.canvas import DIVERGING, PALETTE, TITLE_Y, fit_text, place_margins, title_height_in, to_numpy

__all__ = ["aligned_edges", "clipping_figure", "grouped_heatmap", "image_grid", "norm_histogram",
           "right_closed_counts"]


def image_grid(images: Any, *, titles: Sequence[str] | None = None, ncols: int = 8, suptitle: str | None = None
               ) -> Figure:
    """Input images in grey with a title each (e.g. "given: Shirt / predicted: Coat").

    Args:
        images: (K, 784), (K, 28, 28) or (K, 1, 28, 28).
        titles: K titles.
    """
    imgs = to_numpy(images)
    k = imgs.shape[0] if imgs.ndim else 0
    side = math.isqrt(imgs[0].size) if k else 0
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
                a.set_title(titles[j], fontsize="x-small", y=TITLE_Y)
    if suptitle:
        fig.suptitle(suptitle, fontsize="medium")
    return fig


def aligned_edges(max_value: float, threshold: float, bins: int = 30) -> np.ndarray:
    """Histogram bin edges from 0 to at least ``max_value`` with ``threshold`` on an edge (about ``bins`` bins):
    the bin width is ``threshold / k`` for a whole k, so no bin straddles the threshold."""
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    if not math.isfinite(float(max_value)):
        raise ValueError(f"the norms are not all finite (largest {max_value}): some sample's gradient holds inf or NaN "
                         "(an input or target holding them, or a loss that overflows)")
    top = max(float(max_value), threshold) * 1.0001
    k = max(1, round(bins * threshold / top))
    step = threshold / k
    if top / step > 4 * bins:  # norms far above the threshold: the threshold on an edge, the rest in ~bins bins
        return np.concatenate([[0.0, threshold], threshold + np.linspace(0, top - threshold, bins + 1)[1:]])
    return np.arange(0, math.ceil(top / step) + 1) * step


def right_closed_counts(values: Any, edges: np.ndarray, rtol: float = 1e-5) -> np.ndarray:
    """Counts of ``values`` in right-closed bins (edges[j-1], edges[j]] (the first also takes edges[0]); a value
    within ``rtol`` of an edge counts as on it, so a norm clipped to exactly C (up to rounding) lands in the
    bin that ends at C, left of a line drawn at C."""
    v = to_numpy(values).ravel().astype(np.float64)
    idx = np.searchsorted(edges, v * (1 - rtol), side="left")
    idx = np.clip(idx, 1, len(edges) - 1) - 1
    return np.bincount(idx, minlength=len(edges) - 1)[: len(edges) - 1]


def norm_histogram(before: Any, after: Any, max_norm: float, *, bins: int = 40) -> Figure:
    """Histograms of per-sample gradient norms (B,) before and after clipping to ``max_norm``.

    The bins are aligned to C = ``max_norm`` (C is a bin edge) and closed on the right, so norms clipped to
    exactly C sit in the bin left of the C line."""
    b, a = to_numpy(before).ravel(), to_numpy(after).ravel()
    if b.size == 0 or a.size == 0:
        raise ValueError("no norms to plot: pass the (B,) per-sample gradient norms before and after clipping")
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
    t = to_numpy(total).ravel()
    if t.size == 0:
        raise ValueError("no norms to plot: pass the (B,) per-sample gradient norms")
    parts = {name: to_numpy(v).ravel() for name, v in layers.items()}
    edges = aligned_edges(float(np.max(t)), max_norm, bins)
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
        bottom.stairs(right_closed_counts(values, edges), edges, color=PALETTE[(k + 4) % len(PALETTE)],
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
    top.set_title(text, fontsize="medium", y=TITLE_Y)
    place_margins(fig, left=0.7, right=0.2, bottom=0.55, top=title_height_in(text), hspace=0.08)
    return fig


def grouped_heatmap(matrix: Any, groups: Any, *, group_names: Sequence[str] | None = None, title: str = "",
                    symmetric: bool = True, cmap: str | None = None, label: str = "") -> Figure:
    """An (N, N) matrix of samples sorted by group (e.g. class), with the group blocks outlined.

    Args:
        matrix: (N, N), e.g. cosine similarities of per-sample gradients or an empirical NTK.
        groups: (N,) group id of each row/column, sorted (rows of one group are adjacent).
        symmetric: colour limits symmetric around 0 (diverging map); else a sequential map from the minimum.
    """
    m, g = to_numpy(matrix), to_numpy(groups).ravel()
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
        ax.set_title(title, fontsize="medium", y=TITLE_Y)
    return fig
