"""The interactive explorer: sliders for batch size and hidden width, the quantity, the strategies to compare;
on each change it re-times them (:mod:`pergrad_viz.bench`) and redraws the figures (:mod:`pergrad_viz.plots`).

>>> import pergrad_viz as pv
>>> pv.widgets.explorer()          # in a notebook cell: the widget shows itself

Figures are shown as PNG ``ipywidgets.Image`` s (``<img src="blob:...">`` in JupyterLab and Voila); a new
figure replaces the image's bytes, so the page sees a new ``src``. The explorer can be driven from code,
which is how its tests work: set ``ex.batch_slider.value = 8`` and read ``ex.records`` and ``ex.status``.
"""

from __future__ import annotations

import html
import math
import traceback
from collections.abc import Sequence

import ipywidgets as w
import torch
from matplotlib.figure import Figure

from . import bench, plots
from .api import per_sample_grads, per_sample_jacobian
from .data import CLASS_NAMES
from .errors import MemoryBudgetError, human_bytes
from .memory import available_bytes, result_bytes
from .models import MLP
from .strategies import STRATEGIES

__all__ = ["Explorer", "explorer"]

QUANTITY_OPTIONS = (("per-sample gradients", "grads"), ("output Jacobian", "jacobian"))
POWERS_OF_TWO_BATCH = tuple(2**k for k in range(9))  # 1 .. 256
POWERS_OF_TWO_HIDDEN = tuple(2**k for k in range(3, 10))  # 8 .. 512
BUSY = "computing…"
FIRST_LAYER = "fc1.weight"
MAX_IMAGES = 9  # hidden units shown for a per-sample gradient
OUTPUTS = 10  # the benchmark MLP's classes


def _num_params(hidden: int) -> int:
    return sum(p.numel() for p in MLP(784, hidden, 10).parameters())


class Explorer(w.VBox):
    """The explorer widget (an ``ipywidgets.VBox``); build it with :func:`explorer`.

    Attributes for code and tests:
        batch_slider, hidden_slider: ``SelectionSlider`` s ("batch size", "hidden width").
        quantity_toggle: ``ToggleButtons``, value ``"grads"`` or ``"jacobian"``.
        strategy_boxes: ``{strategy: Checkbox}``.
        sample_slider: ``IntSlider`` ("sample"), the sample whose first-layer gradients are shown.
        records: the latest :class:`bench.Record` s of the current setting (batch size, hidden width).
        scaling_records: the latest records of the whole sweep (the batch sizes of the scaling curve).
        figures_drawn: how many times a new runtime chart was drawn.
        status: plain text of the verification line and the skip note (the verification line first).
        max_difference: the largest |difference| between the strategies' results at the current setting.
        error: the text of the last error shown ("" when the last refresh succeeded).
        busy: the label that reads "computing…" while a refresh runs.

    Methods: :meth:`refresh` recomputes now; :meth:`set` changes several controls and refreshes once.

    Each change re-times the selected strategies at the current setting (one ``bench.sweep``). The smaller
    batch sizes of the scaling curve are timed once per (quantity, batch size, hidden width) and reused while
    the selected strategies are among those timed, so that moving a slider stays quick.
    """

    def __init__(self, *, batch_sizes: Sequence[int], hidden_widths: Sequence[int], strategies: Sequence[str],
                 default_batch: int, default_hidden: int, quantity: str, slow_limit: int, min_run_time: float,
                 sweep_batches: int, device: str = "cpu", dpi: float = 80, compute: bool = True):
        self.slow_limit = slow_limit
        self.min_run_time = min_run_time
        self.sweep_batches = sweep_batches
        self.device = device
        self.dpi = dpi
        self.dtype = torch.float32
        self.records: list[bench.Record] = []
        self.scaling_records: list[bench.Record] = []
        self.figures_drawn = 0
        self.status = ""
        self.error = ""
        self.max_difference: float | None = None
        self._computing = False
        self._suspended = False
        # (quantity, batch, hidden) -> (strategies timed, records): scaling-curve points already timed
        self._cache: dict[tuple[str, int, int], tuple[frozenset[str], list[bench.Record]]] = {}
        self._setting: tuple | None = None  # (batch, hidden, model, x, labels, grads (B, P), boundaries)

        slider = {"continuous_update": False, "style": {"description_width": "initial"},
                  "layout": w.Layout(width="380px")}
        self.batch_slider = w.SelectionSlider(options=list(batch_sizes), value=default_batch,
                                              description="batch size", **slider)
        self.hidden_slider = w.SelectionSlider(options=list(hidden_widths), value=default_hidden,
                                               description="hidden width", **slider)
        self.quantity_toggle = w.ToggleButtons(options=list(QUANTITY_OPTIONS), value=quantity,
                                               style={"button_width": "auto"},
                                               tooltips=["(B, P): the gradient of each sample's loss",
                                                         "(B, Y, P): each output of each sample"])
        self.strategy_boxes = {name: w.Checkbox(value=True, description=name, indent=False,
                                                layout=w.Layout(width="auto", margin="0 14px 0 0"))
                               for name in strategies}
        self.sample_slider = w.IntSlider(value=0, min=0, max=max(default_batch - 1, 0), description="sample",
                                         continuous_update=False, style={"description_width": "initial"})
        self.busy = w.HTML("", layout=w.Layout(margin="0 0 0 12px"))
        self.error_html = w.HTML("")
        self.status_html = w.HTML("")
        self.table_html = w.HTML("")
        self.runtime_image = w.Image(format="png")
        self.bar_image = w.Image(format="png")
        self.heatmap_image = w.Image(format="png")
        self.images_image = w.Image(format="png")
        super().__init__(layout=w.Layout(width="100%"))
        self._build()

        for control in (self.batch_slider, self.hidden_slider, self.quantity_toggle, *self.strategy_boxes.values()):
            control.observe(self._on_change, names="value")
        self.sample_slider.observe(self._on_sample, names="value")
        if compute:
            self.refresh()

    # ------------------------------------------------------------------------------------------ layout

    def _build(self) -> None:
        self._charts = w.HBox(layout=w.Layout(flex_flow="row wrap", align_items="flex-start"))
        self._sample_figures = w.VBox()
        self.children = [
            w.HBox([self.batch_slider, self.hidden_slider], layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.quantity_toggle, self.busy], layout=w.Layout(align_items="center")),
            w.HBox([w.HTML("<b>strategies:</b>&nbsp;"), *self.strategy_boxes.values()],
                   layout=w.Layout(flex_flow="row wrap", align_items="center")),
            self.error_html,
            self.status_html,
            self._charts,
            self.table_html,
            self.sample_slider,
            self._sample_figures,
        ]

    def _layout(self) -> None:
        """An image joins the page once it holds a figure (an empty <img> would show as broken)."""
        charts = tuple(img for img in (self.runtime_image, self.bar_image) if img.value)
        figures = tuple(img for img in (self.heatmap_image, self.images_image) if img.value)
        if self._charts.children != charts:
            self._charts.children = charts
        if self._sample_figures.children != figures:
            self._sample_figures.children = figures

    # ------------------------------------------------------------------------------------------ callbacks

    def _on_change(self, change: dict) -> None:
        if not self._suspended:
            self.refresh()

    def set(self, *, batch: int | None = None, hidden: int | None = None, quantity: str | None = None,
            strategies: Sequence[str] | None = None) -> bool:
        """Change several controls at once, then refresh once if anything changed (setting the controls one
        by one refreshes after each). Returns whether it refreshed."""
        if strategies is not None:
            unknown = set(strategies) - set(self.strategy_boxes)
            if unknown:
                raise ValueError(f"no checkbox for {sorted(unknown)}; the explorer has {list(self.strategy_boxes)}")
        before = self._state()
        self._suspended = True
        try:
            if batch is not None:
                self.batch_slider.value = batch
            if hidden is not None:
                self.hidden_slider.value = hidden
            if quantity is not None:
                self.quantity_toggle.value = quantity
            if strategies is not None:
                for name, box in self.strategy_boxes.items():
                    box.value = name in strategies
        finally:
            self._suspended = False
        if self._state() == before:
            return False
        self.refresh()
        return True

    def _state(self) -> tuple:
        return (self.batch_slider.value, self.hidden_slider.value, self.quantity_toggle.value, tuple(self.selected))

    def _on_sample(self, change: dict) -> None:
        if self._computing or self._setting is None:
            return  # a refresh in progress draws the sample figures itself
        self._guarded(self._draw_sample)

    def refresh(self) -> None:
        """Re-time the selected strategies at the current setting and redraw everything, now.

        Errors are shown in the widget (and kept in :attr:`error`), never raised: the controls keep working.
        """
        if self._computing:
            return
        self._guarded(self._compute)

    def _guarded(self, work) -> None:
        self._computing = True
        self.busy.value = f"<b style='color:#a15c00'>{BUSY}</b>"
        try:
            work()
            self.error = ""
            self.error_html.value = ""
        except Exception as exc:  # shown, not swallowed: the UI must survive e.g. a MemoryBudgetError
            self._show_error(exc)
        finally:
            self._computing = False
            self.busy.value = ""

    def _show_error(self, exc: Exception) -> None:
        setting = f"batch size {self.batch_slider.value}, hidden width {self.hidden_slider.value}"
        self.error = f"{type(exc).__name__} at {setting}: {exc}"
        where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.error_html.value = (
            "<div style='border-left:4px solid #c62828;background:#fdecea;padding:6px 10px;margin:4px 0'>"
            f"<b>Could not compute this setting ({html.escape(setting)}).</b><br>"
            f"<code style='white-space:pre-wrap'>{html.escape(where)}</code><br>"
            "The figures below are from the previous setting; choose another setting to continue.</div>"
        )

    # ------------------------------------------------------------------------------------------ compute

    @property
    def selected(self) -> list[str]:
        """The ticked strategies, in order."""
        return [name for name, box in self.strategy_boxes.items() if box.value]

    def scaling_batches(self, batch: int) -> list[int]:
        """The batch sizes timed for the scaling curve: up to ``sweep_batches`` of the slider's options
        up to ``batch``, evenly spread on a log scale, always ending with ``batch``."""
        options = sorted(b for b in self.batch_slider.options if b <= batch) or [batch]
        n = min(self.sweep_batches, len(options))
        if n <= 1:
            return [batch]
        picks = {options[round(k * (len(options) - 1) / (n - 1))] for k in range(n)}
        return sorted(picks | {batch})

    def _check_memory(self, quantity: str, batch: int, hidden: int) -> None:
        """Refuse, with the estimate, a setting that would not fit in memory (before allocating anything)."""
        p = _num_params(hidden)
        outputs = OUTPUTS if quantity == "jacobian" else 1
        one = result_bytes(batch, p, self.dtype, outputs)
        # while timing: the reference result, a fresh result and a strategy's working copy; plus the
        # (B, P) per-sample gradients of the heatmap
        need = 3 * one + result_bytes(batch, p, self.dtype)
        free = available_bytes(torch.device(self.device))
        if need > 0.9 * free:
            raise MemoryBudgetError(
                f"the explorer at batch size {batch}, hidden width {hidden} ({quantity}) would hold about "
                f"{human_bytes(need)} (three copies of the {human_bytes(one)} result while timing), more than "
                f"the {human_bytes(free)} available. Choose a smaller batch size or hidden width, or the per-sample "
                "gradients instead of the Jacobian."
            )

    def _compute(self) -> None:
        batch, hidden, quantity = self.batch_slider.value, self.hidden_slider.value, self.quantity_toggle.value
        selected = self.selected
        self._check_memory(quantity, batch, hidden)
        records = self._sweep(quantity, batch, hidden, selected)
        current = [r for r in records if r.batch_size == batch and r.hidden == hidden]

        model, loss_fn, x, y = bench.setting(batch, hidden, device=self.device, dtype=self.dtype)
        grads = per_sample_grads(model, loss_fn, x, y, flat=True)  # (B, P)
        self._setting = (batch, hidden, model, x, y.argmax(dim=1), grads, plots.param_boundaries(model))
        self.records, self.scaling_records = current, records
        self._update_status(quantity, batch, hidden, selected, current, records)

        self.runtime_image.value = plots.to_png(
            plots.runtime_figure(records, highlight=batch, ax=_axes(5.8, 3.5)), dpi=self.dpi)
        self.bar_image.value = plots.to_png(plots.bar_figure(current, ax=_axes(4.6, 0.4 * len(current) + 1.2)),
                                            dpi=self.dpi)
        self.figures_drawn += 1
        self.table_html.value = _table_html(current, quantity, batch, hidden)

        self.sample_slider.unobserve(self._on_sample, names="value")
        try:
            self.sample_slider.max = batch - 1
            self.sample_slider.value = min(self.sample_slider.value, batch - 1)
        finally:
            self.sample_slider.observe(self._on_sample, names="value")
        self._draw_sample()
        self._layout()

    def _sweep(self, quantity: str, batch: int, hidden: int, selected: list[str]) -> list[bench.Record]:
        """Records of the scaling curve: the current setting always re-timed, in one ``bench.sweep`` with
        the smaller batch sizes that were not timed before (with at least the selected strategies)."""
        reused, todo = [], []
        for b in self.scaling_batches(batch)[:-1]:
            hit = self._cache.get((quantity, b, hidden))
            if hit is not None and set(selected) <= hit[0]:
                reused += [r for r in hit[1] if r.strategy in selected or r.strategy in plots.REFERENCES]
            else:
                todo.append(b)
        fresh = bench.sweep(quantity, [*todo, batch], [hidden], strategies=selected, slow_limit=self.slow_limit,
                            min_run_time=self.min_run_time, device=self.device, dtype=self.dtype, progress=False)
        for b in (*todo, batch):
            self._cache[(quantity, b, hidden)] = (frozenset(selected), [r for r in fresh if r.batch_size == b])
        return sorted([*reused, *fresh], key=lambda r: r.batch_size)  # stable: method order kept per setting

    def _update_status(self, quantity: str, batch: int, hidden: int, selected: list[str],
                       current: list[bench.Record], records: list[bench.Record]) -> None:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f"batch size B={batch}, hidden width {hidden}"
        computed = [r for r in current if r.strategy in selected and not r.skipped]
        diffs = [r.max_abs_diff for r in computed if r.max_abs_diff is not None]
        self.max_difference = max(diffs) if len(computed) > 1 and diffs else None
        if self.max_difference is not None:
            others = ", ".join(r.strategy for r in computed[1:])
            check = (f"max |difference| between strategies: {self.max_difference:.1e} ({dtype}; {others} vs "
                     f"{computed[0].strategy}, at {where})")
            ok = self.max_difference <= 1e-4 * max(1.0, float(self._setting[5].abs().max()))
            verdict = "<b style='color:#1b7f3b'>agree</b>" if ok else "<b style='color:#c62828'>DISAGREE</b>"
            check_html = f"{verdict}: {html.escape(check)}"
        elif not selected:
            check = check_html = f"no strategy selected: tick at least one to compare (at {where})"
        else:
            check = f"only one strategy computed at {where}: nothing to compare its result with"
            check_html = html.escape(check)

        skipped: dict[tuple[tuple[int, ...], str], list[str]] = {}  # (batch sizes, reason) -> strategies
        for name in selected:
            rows = [r for r in records if r.skipped and r.strategy == name]
            if rows:
                reason = rows[-1].note.removeprefix("skipped: ") or "skipped"
                skipped.setdefault((tuple(r.batch_size for r in rows), reason), []).append(name)
        lines = [check]
        notes_html = ""
        if skipped:
            parts = [f"{', '.join(names)} at B={', '.join(map(str, batches))} ({reason} at B={batches[-1]})"
                     for (batches, reason), names in skipped.items()]
            note = ("skipped as too slow: " + "; ".join(parts) + ". Lower the batch size, or pass a larger "
                    "slow_limit= to explorer() to time them.")
            lines.append(note)
            notes_html = f"<div style='color:#8a5300'>⚠ {html.escape(note)}</div>"
        self.status = "\n".join(lines)
        what = dict((v, k) for k, v in QUANTITY_OPTIONS)[quantity]
        self.status_html.value = (f"<div style='margin:4px 0'><b>{html.escape(what)}</b> · {check_html}</div>"
                                  + notes_html)

    def _draw_sample(self) -> None:
        """The heatmap (with the chosen sample outlined) and the chosen sample's first-layer images."""
        batch, hidden, model, x, labels, grads, bounds = self._setting
        i = min(self.sample_slider.value, batch - 1)
        names = CLASS_NAMES["fashion-mnist"]
        start, stop = next((a, b) for n, a, b in bounds if n == FIRST_LAYER)
        label = names[int(labels[i])]
        heat_title = f"per-sample gradients, B={batch} x P={grads.shape[1]:,} (sample {i} outlined)"
        if self.quantity_toggle.value == "jacobian":
            jac = per_sample_jacobian(model, x[i:i + 1], flat=True)[0]  # (Y, P)
            fig = Figure(figsize=(9.5, 6.0), layout="constrained")
            top, bottom = fig.subplots(2, 1, height_ratios=[1.2, 1])
            plots.gradient_heatmap(grads, bounds, ax=top, title=heat_title, highlight_row=i, max_cols=600)
            plots.gradient_heatmap(jac, bounds, ax=bottom, ylabel="output", row_labels=names, max_cols=600,
                                   title=f"output Jacobian of sample {i} ({label}): Y={jac.shape[0]} x P")
            first = jac[:, start:stop].reshape(jac.shape[0], hidden, 784)  # (Y, hidden, 784)
            unit = int(first.square().sum(dim=(0, 2)).argmax())
            images = plots.first_layer_images(
                first[:, unit], image=x[i], titles=list(names), ncols=6, image_title=f"input ({label})",
                suptitle=f"sample {i}: d output_c / d fc1.weight[{unit}, :] for each class c (hidden unit {unit}, "
                         "the most sensitive)")
        else:
            fig = plots.gradient_heatmap(grads, bounds, title=heat_title, highlight_row=i, max_cols=600)
            first = grads[i, start:stop].reshape(hidden, 784)  # (hidden, 784)
            units = first.norm(dim=1).topk(min(MAX_IMAGES, hidden)).indices.tolist()
            images = plots.first_layer_images(
                first[units], image=x[i], titles=[f"unit {j}" for j in units], ncols=5,
                image_title=f"input ({label})",
                suptitle=f"sample {i}: gradient of its loss w.r.t. fc1.weight, the {len(units)} hidden units with "
                         "the largest gradient (each is the input times one number)")
        self.heatmap_image.value = plots.to_png(fig, dpi=self.dpi)
        self.images_image.value = plots.to_png(images, dpi=self.dpi)
        self._layout()


def _axes(width: float, height: float):
    """A new axes on a new figure of this size (inches), laid out with constrained layout."""
    return Figure(figsize=(width, height), layout="constrained").add_subplot()


def _table_html(records: list[bench.Record], quantity: str, batch: int, hidden: int) -> str:
    """The records of one setting as an HTML table (bench.COLUMNS without the constant first three)."""
    keep = [k for k, c in enumerate(bench.COLUMNS) if c not in ("quantity", "batch", "hidden")]
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(bench.COLUMNS[k])}</th>" for k in keep)
    body = []
    for r, row in zip(records, bench.table_rows(records), strict=True):
        style = "color:#777" if r.strategy in plots.REFERENCES or r.skipped else ""
        cells = "".join(f"<td style='padding:2px 8px'>{html.escape(row[k])}</td>" for k in keep)
        body.append(f"<tr style='{style}'>{cells}</tr>")
    what = dict((v, k) for k, v in QUANTITY_OPTIONS)[quantity]
    caption = (f"{what} at batch size B={batch}, hidden width {hidden}: median time per call; "
               "vs loop = speed-up over the loop; result = memory of the result")
    return (f"<table style='border-collapse:collapse;font-size:12px'><caption style='text-align:left'>"
            f"{html.escape(caption)}</caption><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def _options(values: Sequence[int], default: int, what: str) -> tuple[int, ...]:
    options = sorted({int(v) for v in values} | {int(default)})
    if options[0] < 1:
        raise ValueError(f"{what} must be positive integers, got {tuple(values)}")
    return tuple(options)


def explorer(*, batch_sizes: Sequence[int] = POWERS_OF_TWO_BATCH, hidden_widths: Sequence[int] = POWERS_OF_TWO_HIDDEN,
             strategies: Sequence[str] = STRATEGIES, default_batch: int = 32, default_hidden: int = 20,
             quantity: str = "grads", slow_limit: int = 1024, min_run_time: float = 0.05, sweep_batches: int = 3,
             device: str = "cpu", dpi: float = 80, compute: bool = True) -> Explorer:
    """The interactive explorer of the strategies on the tutorial ``MLP(784, hidden, 10)``; computes once now.

    Args:
        batch_sizes, hidden_widths: the sliders' options (default powers of two, 1..256 and 8..512).
        strategies: one checkbox each (names from :data:`pergrad_viz.STRATEGIES`, or ``"auto"``).
        default_batch, default_hidden: the sliders' start values (added to the options where absent: the
            tutorial's hidden width 20 sits between 16 and 32).
        quantity: ``"grads"`` (per-sample gradients, (B, P)) or ``"jacobian"`` (output Jacobians, (B, Y, P)).
        slow_limit: ``loop``, ``autograd_stack`` and ``batched_grad`` are skipped, with a visible note, where
            they would push more than this many samples through backward passes per call (the loop: B for
            gradients, B x 10 for Jacobians; the other two B times that, see ``bench.backward_work``).
        min_run_time: seconds of timing per method and setting (``torch.utils.benchmark``); small keeps the
            explorer responsive, at the price of noisier timings.
        sweep_batches: how many batch sizes (up to the current one) are timed for the scaling curve.
        device: where to compute. dpi: resolution of the figures. compute: run the first sweep now.

    Returns:
        The :class:`Explorer`; as a cell's last expression it shows itself.
    """
    if quantity not in bench.QUANTITIES:
        raise ValueError(f"quantity must be one of {', '.join(map(repr, bench.QUANTITIES))}, got {quantity!r}")
    batch_sizes = _options(batch_sizes, default_batch, "batch_sizes")
    hidden_widths = _options(hidden_widths, default_hidden, "hidden_widths")
    unknown = [s for s in strategies if s != "auto" and s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
    if not math.isfinite(min_run_time) or min_run_time < 0:
        raise ValueError(f"min_run_time must be a non-negative number of seconds, got {min_run_time!r}")
    if sweep_batches < 1:
        raise ValueError(f"sweep_batches must be at least 1, got {sweep_batches}")
    return Explorer(batch_sizes=batch_sizes, hidden_widths=hidden_widths, strategies=tuple(strategies),
                    default_batch=default_batch, default_hidden=default_hidden, quantity=quantity,
                    slow_limit=slow_limit, min_run_time=min_run_time, sweep_batches=sweep_batches, device=device,
                    dpi=dpi, compute=compute)

