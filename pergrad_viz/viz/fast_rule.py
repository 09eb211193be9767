"""Figures of how a layer's fast rule builds one sample's gradient from what a single batched forward and
backward provide: a Linear layer's outer product g a^T (with the ghost-norm identity), a convolution's or an
embedding's product of two factors, and a sample's tokens next to a matrix about them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pergrad_viz.viz.canvas import DIVERGING, TITLE_Y, axes_at_inches, fit_text, text_width_in, to_numpy

__all__ = ["factor_figure", "outer_product_figure", "token_figure"]


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
    a_np, g_np = to_numpy(a).ravel(), to_numpy(g).ravel()
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
        ax_a = axes_at_inches(fig, 0.15, foot, panel, panel)
        ax_g = axes_at_inches(fig, 0.15 + panel + 0.6, foot, 1.8, panel)
        x_o = 0.15 + panel + 0.6 + 1.8 + 0.75
        ax_o = axes_at_inches(fig, x_o, foot, width - x_o - 0.95, panel)
        ax_c = axes_at_inches(fig, width - 0.8, foot, 0.12, panel)
    else:  # two rows: the input and the signal above, their product below at the whole width
        upper, lower, gap = 1.9, 1.5, 0.95  # gap: the signal's x label, then the product's two-line title
        top = 0.55 + head_in
        height = top + upper + gap + lower + foot
        fig = Figure(figsize=(width, height))
        ax_a = axes_at_inches(fig, 0.15, foot + lower + gap, upper, upper)
        x_g = 0.15 + upper + 0.75
        ax_g = axes_at_inches(fig, x_g, foot + lower + gap, width - x_g - 0.25, upper)
        ax_o = axes_at_inches(fig, 0.6, foot, width - 0.6 - 0.95, lower)
        ax_c = axes_at_inches(fig, width - 0.8, foot, 0.12, lower)
    ax_a.imshow(a_np.reshape(h, w), cmap="gray", interpolation="nearest")
    ax_a.set_title(f"the input a_i\n||a_i|| = {a_norm:.5g}", fontsize="small", y=TITLE_Y)
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
    ax_g.set_title(f"the backprop signal g_i\n||g_i|| = {g_norm:.5g}", fontsize="small", y=TITLE_Y)
    ax_g.tick_params(labelsize="x-small")
    limit = float(np.abs(outer).max()) or 1.0
    shown = ax_o.imshow(outer, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax_o.set_xlabel("input pixel (0..783)", fontsize="small")
    ax_o.set_ylabel("hidden unit", fontsize="small")
    ax_o.tick_params(labelsize="x-small")
    ax_o.set_title("their outer product g_i a_i^T\n= the sample's gradient of the weight", fontsize="small", y=TITLE_Y)
    fig.colorbar(shown, cax=ax_c).ax.tick_params(labelsize="x-small")
    for axis in (ax_g.xaxis, ax_o.yaxis):  # hidden units are whole numbers
        axis.set_major_locator(MaxNLocator(integer=True, nbins="auto"))
    fig.text(0.15 / width, 0.1 / height, identity, fontsize="medium", va="bottom")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig


def _matrix(ax: Axes, m: np.ndarray, title: str, width_in: float) -> Any:
    limit = float(np.abs(m).max()) or 1.0
    shown = ax.imshow(m, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set_title(f"{fit_text(title, width_in, 8.0)}\n{m.shape[0]} x {m.shape[1]}", fontsize="small", y=TITLE_Y)
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
    a, b, c = (to_numpy(t) for t in (left, right, product))
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
    ax_l = axes_at_inches(fig, 0.5, y_top, half - 0.1, panel)
    ax_r = axes_at_inches(fig, 0.5 + half + 0.6, y_top, half - 0.1, panel)
    ax_p = axes_at_inches(fig, 0.5, foot, width - 0.5 - 0.95, panel)
    ax_c = axes_at_inches(fig, width - 0.8, foot, 0.12, panel)
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
    m = to_numpy(matrix)
    if m.ndim != 2:
        raise ValueError(f"matrix must be 2-D, got shape {m.shape}")
    head = fit_text(title, width - 0.3) if title else ""
    head_in = 0.21 * (head.count("\n") + 1) + 0.1 if head else 0
    height = head_in + 0.55 + 2.6 + 0.55
    fig = Figure(figsize=(width, height))
    x0 = 0.3
    if tokens is not None:
        ids = to_numpy(tokens).astype(int).ravel()
        rows, cols = grid if grid is not None and grid[0] * grid[1] == ids.size else (1, ids.size)
        side = min(2.6, 2.6 * cols / max(rows, cols))
        ax_t = axes_at_inches(fig, x0, 0.55, side, 2.6 * rows / max(rows, cols))
        ax_t.imshow(ids.reshape(rows, cols), cmap="gray", vmin=0, vmax=max(1, int(ids.max())), aspect="equal",
                    interpolation="nearest")
        if ids.size <= 64:
            for k, v in enumerate(ids):
                ax_t.text(k % cols, k // cols, str(v), ha="center", va="center", fontsize="small",
                          color="white" if v < ids.max() / 2 else "black")
        ax_t.set_xticks([])
        ax_t.set_yticks([])
        ax_t.set_title(f"the sample's {ids.size} tokens", fontsize="small", y=TITLE_Y)
        x0 += side + 0.3
    labelled = 0 < len(row_labels) == m.shape[0] and m.shape[0] <= 40
    left = x0 + (text_width_in(row_labels, "x-small") + 0.15 if labelled else 0.35)
    ax_m = axes_at_inches(fig, left, 0.55, width - left - 0.95, 2.6)
    limit = float(np.abs(m).max()) or 1.0
    shown = ax_m.imshow(m, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    if labelled:
        ax_m.set_yticks(np.arange(m.shape[0]), list(row_labels), fontsize="x-small")
    ax_m.tick_params(labelsize="x-small")
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax_m.set_title(matrix_title, fontsize="small", y=TITLE_Y)
    ax_m.set_xlabel(xlabel, fontsize="small")
    fig.colorbar(shown, cax=axes_at_inches(fig, width - 0.8, 0.55, 0.12, 2.6)).ax.tick_params(labelsize="x-small")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig
