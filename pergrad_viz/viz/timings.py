"""Figures of benchmark timings: runtime curves against batch size or width, bars of one setting, and the
numbers as people read them (``"13.7 ms"``, ``"89.4x"``).

The figures take plain benchmark records (:class:`~pergrad_viz.bench.records.Record` or anything with its
attributes) and know nothing of how a strategy computes them. Each returns the
:class:`~matplotlib.figure.Figure` it drew on; pass ``ax=`` to draw into an existing axes instead.
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from pergrad_viz.bench.records import FORWARD_BACKWARD, fmt_ratio, fmt_seconds
from pergrad_viz.viz.canvas import (
    CHAR_IN,
    REFERENCE_STYLE,
    REFERENCES,
    TITLE_Y,
    fit_text,
    fixed_axes,
    method_color,
    place_margins,
    text_width_in,
    title_height_in,
)

__all__ = ["bar_figure", "dp_cost_figure", "fmt_ratio", "fmt_seconds", "runtime_figure"]

_X_AXES = {"batch_size": ("batch size B", "B"), "hidden": ("hidden width", "hidden")}
_QUANTITY_TITLES = {"grads": "per-sample gradients", "jacobian": "per-sample output Jacobians"}


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
        records: benchmark records (:class:`pergrad_viz.bench.records.Record` or anything with its attributes
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

    if legend not in ("right", "below"):
        raise ValueError(f"legend must be 'right' or 'below', got {legend!r}")
    fig, ax, new = fixed_axes(ax, (width, height))
    labels = _draw_lines(ax, records, x, other, others, quantities, short)
    _log_axes(ax, sorted({getattr(r, x) for r in records}), xlabel, highlight)
    if title is None:
        what = " & ".join(_QUANTITY_TITLES.get(q, q) for q in quantities)
        fixed = f", {_X_AXES[other][1]}={others[0]}" if len(others) == 1 else ""
        title = f"{what}: time vs {xlabel}{fixed}"
    _place_legend(fig, ax, new, labels, title, legend, width, height)
    return fig


def _draw_lines(ax: Axes, records: list, x: str, other: str, others: list, quantities: list, short: str
                ) -> list[str]:
    """One line per (method, quantity, other setting), references last and dashed; returns the legend labels."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r.strategy, r.quantity, getattr(r, other)), []).append(r)
    # methods in order of first appearance, references last
    order = sorted(groups, key=lambda k: (k[0] in REFERENCES, REFERENCES.index(k[0]) if k[0] in REFERENCES else 0))

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
            {**REFERENCE_STYLE[name], "linestyle": "--", "linewidth": 1.2} if name in REFERENCES
            else {"color": method_color(name), "marker": "o", "linestyle": "-", "linewidth": 1.8}
        )
        xs = [getattr(r, x) for r in timed]
        ys = [r.median_s for r in timed]
        if timed:
            half = [(r.iqr_s or 0.0) / 2 for r in timed]
            lower = [min(h, y * 0.95) for h, y in zip(half, ys, strict=True)]  # stay positive on a log axis
            ax.errorbar(xs, ys, yerr=[lower, half], label=label, capsize=3, markersize=5, **style)
        else:  # nothing timed: a legend entry all the same
            ax.plot([], [], label=label, **style)
    return labels


def _log_axes(ax: Axes, xs_all: list, xlabel: str, highlight: int | None) -> None:
    """Log-log axes with the measured x values as ticks, times as people read them."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs_all)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_seconds(v)))
    if len(xs_all) == 1:
        ax.set_xlim(xs_all[0] / 1.5, xs_all[0] * 1.5)
    if highlight is not None:
        ax.axvline(highlight, color="0.2", linestyle=":", linewidth=1, zorder=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median time per call")
    ax.grid(True, which="major", alpha=0.3)


def _place_legend(fig: Figure, ax: Axes, new: bool, labels: list[str], title: str, legend: str, width: float,
                  height: float) -> None:
    """The title, and the legend right of the axes or below them in columns, inside the figure."""
    if legend == "right" or not new:
        right = min(text_width_in(labels, "small") + 0.6, width * 0.45)
        if new:  # wrapped to the axes' width: a title centred over the axes stays inside the figure
            title = fit_text(title, width - 0.85 - right)
        ax.set_title(title, fontsize="medium", y=TITLE_Y)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        if new:
            place_margins(fig, left=0.85, right=right, bottom=0.55, top=title_height_in(title))
        return
    entry = text_width_in(labels, "small") + 0.55  # a line sample and its label
    ncol = max(1, min(len(labels), int((width - 0.3) // entry)))
    rows = -(-len(labels) // ncol)
    bottom = 0.55 + 0.2 * rows + 0.12
    title = fit_text(title, width - 0.3)  # the whole width: centred over the axes it stays inside
    ax.set_title(title, fontsize="medium", y=TITLE_Y)
    top = title_height_in(title)
    place_margins(fig, left=0.85, right=0.2, bottom=bottom, top=top)
    axes_h = height - bottom - top
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.5 / axes_h), ncol=ncol,
              frameon=False, columnspacing=1.2, handlelength=1.8, borderaxespad=0.0)


def bar_figure(records: Iterable[Any], *, ax: Axes | None = None, title: str | None = None,
               pending: Sequence[str] = (), noisy: Collection[str] | None = None,
               provisional: Collection[str] = (), width: float = 6.0) -> Figure:
    """Horizontal bars of the median time of every method at one setting, annotated with the speed-up vs loop.

    Args:
        records: the :class:`~pergrad_viz.bench.records.Record` s of one (quantity, batch size, hidden width), e.g.
            ``[r for r in records if r.batch_size == 32]``. Skipped methods get no bar but their note;
            where ``loop`` was not timed, the annotation is the time relative to forward+backward. A thin line
            spans each bar's interquartile range (median ± IQR/2).
        ax, title: as in :func:`runtime_figure` (default title: the quantity and the setting).
        pending: methods still being timed: a row each, reading "timing…", so the chart keeps its size while
            it fills in.
        noisy: methods whose measurement was noisy: their annotation says "⚠ noisy" (default: the records
            whose field :attr:`~pergrad_viz.bench.records.Record.noisy` is set).
        provisional: methods whose numbers are from the first rounds, more rounds on their way: annotated
            "provisional", in grey (not a warning).
        width: figure width in inches (a new figure only).

    The annotations sit to the right of the axes, inside the figure (its margins make room).

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
        noisy = {r.strategy for r in records if r.noisy}
    fig, ax, new = fixed_axes(ax, (width, 0.32 * rows + 1.05))
    timed = [r.median_s for r in records if r.median_s is not None]
    left = min(timed) / 3 if timed else 1e-4
    right = max(timed) * 3 if timed else 1.0
    beside = ax.get_yaxis_transform()  # x in axes fraction, y in data
    names = [r.strategy for r in records] + list(pending)
    annotations = [_bar_label(r, r.strategy in noisy, r.strategy in provisional) for r in records
                   if r.median_s is not None]
    margin_left = text_width_in(names, "medium") + 0.2
    margin_right = text_width_in(annotations, "small") + 0.25
    axes_in = fig.get_figwidth() - margin_left - margin_right if new else fig.get_figwidth() * 0.45
    note_chars = max(16, int(axes_in * 0.97 / CHAR_IN["small"]))
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
        ax.barh(k, r.median_s - left, left=left, color=REFERENCE_STYLE[r.strategy]["color"] if ref
                else method_color(r.strategy), hatch="//" if ref else None, alpha=0.85 if ref else 1.0, height=0.7)
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
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_seconds(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("median time per call (log scale; line: IQR)", fontsize="small")
    if title is None and settings:
        (quantity, batch, hidden), = settings
        title = f"{_QUANTITY_TITLES.get(quantity, quantity)}, B={batch}, hidden={hidden}"
    left, right = margin_left, margin_right
    if title:
        title = fit_text(title, fig.get_figwidth() - left - right + 2 * min(left, right)) if new else title
        ax.set_title(title, fontsize="medium", y=TITLE_Y)
    ax.grid(True, axis="x", alpha=0.3)
    if new:
        place_margins(fig, left=left, right=right, bottom=0.5, top=title_height_in(title))
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


def dp_cost_figure(rows: Sequence[Mapping[str, Any]], *, title: str | None = None, width: float = 11.0) -> Figure:
    """Two panels of horizontal bars, one bar per method of a DP-SGD step: its median time (left; a thin line spans
    the interquartile range) and the peak memory it added (right), each annotated with its ratio to the first row
    (the plain step).

    Args:
        rows: ``{method, median_s, iqr, peak, note}`` dicts, the first the reference (what
            :func:`pergrad_viz.bench.dp.dp_rows` returns: ``iqr`` relative to the median, ``peak`` in bytes or None
            where it could not be read). A row without a time (a peer that failed) gets its note instead of a bar.
        title: above both panels.
        width: figure width in inches.

    Raises:
        ValueError: no rows, or a first row without a time.
    """
    rows = list(rows)
    if not rows or rows[0].get("median_s") is None:
        raise ValueError("dp_cost_figure needs rows whose first (the plain step, the reference) has a time")
    fig = Figure(figsize=(width, 0.42 * len(rows) + 1.3), layout="constrained")
    panels = fig.subplots(1, 2, sharey=True)
    names = [r["method"] for r in rows]
    scales = (("median_s", 1e3, "median time per step (ms; line: IQR)"),
              ("peak", 2.0 ** -20, "peak memory added by the step (MB)"))
    for ax, (key, scale, label) in zip(panels, scales, strict=True):
        base = rows[0].get(key)

        def half(r: Mapping[str, Any], key: str = key, scale: float = scale) -> float:  # half the drawn IQR
            return r[key] * scale * (r.get("iqr") or 0.0) / 2 if key == "median_s" else 0.0

        top = max((r[key] * scale + half(r) for r in rows if r.get(key) is not None), default=1.0)
        for k, r in enumerate(rows):
            value = r.get(key)
            if value is None:
                note = r.get("note") or "not measured"
                ax.text(0.0, k, textwrap.shorten(note, 60, placeholder=" …"), va="center", fontsize="small",
                        color="0.35")
                continue
            ax.barh(k, value * scale, color="0.6" if k == 0 else method_color(r["method"]), height=0.7)
            if half(r):
                ax.plot([value * scale - half(r), value * scale + half(r)], [k, k], color="black", linewidth=1.0)
            ratio = f" ({fmt_ratio(value / base)})" if base else ""
            shown = fmt_seconds(value) if key == "median_s" else f"{value * scale:.1f} MB"
            ax.text(value * scale + half(r) + 0.02 * top, k, shown + ratio, va="center", fontsize="small")
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel(label, fontsize="small")
        ax.grid(True, axis="x", alpha=0.3)
    panels[0].set_yticks(range(len(rows)), names)
    panels[0].set_ylim(len(rows) - 0.5, -0.5)
    if title:
        fig.suptitle(title, fontsize="medium")
    return fig
