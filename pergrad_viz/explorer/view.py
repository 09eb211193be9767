"""The explorer widget: ipywidgets only. Controls become a :class:`~.state.Setting`; the model's
:class:`~.state.View` s are drawn by its :class:`~.page.Page`. Build it with :func:`.factory.explorer`
(``pv.widgets.explorer()``).

The work runs off the kernel's main thread, in one background worker (:mod:`.worker`): a control's callback only
hands the new setting over and returns, so the controls and the kernel stay free. A newer setting makes the worker
drop the stale one (the latest wins; nothing queues); a new sample or clipping threshold is drawn in between the
timing's blocks without restarting it. Views arrive progressively (see :meth:`.model.ExplorerModel.stages`):
the gradients' figures and the verdict first, then the bar chart grows tier by tier, the scaling curve last;
the progress line says where it is (``data-state="busy"`` / ``"done"`` / ``"error"`` on its element). While the
learner looks, the worker computes the menu's other networks ahead and draws their figures (:meth:`_ahead`).

The explorer can be driven from code, which is how its tests work: ``ex.set(batch=8)`` (or
``ex.batch_slider.value = 8``), then ``ex.wait()`` and read ``ex.view``.
"""

from __future__ import annotations

import dataclasses
import html
import sys
import threading
from collections.abc import Callable, Sequence

from pergrad_viz.bench.records import Record
from pergrad_viz.core.extras import require
from pergrad_viz.explorer import prefetch
from pergrad_viz.explorer.model import ExplorerModel
from pergrad_viz.explorer.page import Page, arrange, close_all
from pergrad_viz.explorer.state import QUANTITIES, QUANTITY_NAMES, Setting, Stale, View
from pergrad_viz.explorer.worker import Job, Worker

w = require("ipywidgets", "the explorer (pergrad_viz.explorer)", extra="widgets")

__all__ = ["Explorer"]

QUANTITY_OPTIONS = tuple((QUANTITY_NAMES[q], q) for q in QUANTITIES)
DPI = 96  # CSS pixels per inch: a figure of 8 in shows 768 px wide, drawn at that size
SLOW_LIMITS = (256, 1024, 4096, 16384, 65536)  # the slow-methods control's options (and the explorer's default)
CLOSE_TIMEOUT_S = 60.0  # close() waits this long at most for the worker (it stops between two timed blocks)


class Explorer(w.VBox):
    """The explorer widget (an ``ipywidgets.VBox``); build it with :func:`.factory.explorer`.

    Controls: ``model_dropdown`` (the network; hidden when there is one), ``batch_slider``, ``hidden_slider`` (the
    network's width; hidden for a user's network) (``SelectionSlider`` s), ``quantity_toggle`` (``"grads"`` /
    ``"jacobian"``), ``strategy_boxes`` (``{strategy: Checkbox}``), ``sample_slider`` (the sample of the sample
    panels), ``clip_slider`` (DP-SGD's threshold C), ``rerun_button`` (time this setting again),
    ``slow_limit_dropdown`` (the slow baselines are timed up to this many sample-backward passes per call).

    State for code and tests:
        model: the :class:`~.model.ExplorerModel`; view: the latest :class:`~.state.View` shown (None before).
        records, scaling_records: the view's records; status: its verdict line and notes as plain text;
        max_difference: the verdict's max |difference|; error: the last error's text ("" when the last
        setting worked); drawn: {panel: times shown anew} (:class:`.page.Page`); busy: work pending or running.

    Threads: the kernel's thread writes the controls only; the worker's computes, times (it alone touches the
    timing cache: "rerun timings" hands it a job) and writes the output panes. :meth:`close` stops the worker,
    joins it and closes every widget: a closed explorer is garbage collected.
    """

    def __init__(self, model: ExplorerModel, *, batch_sizes: Sequence[int], hidden_widths: Sequence[int],
                 strategies: Sequence[str], default: Setting, dpi: float = DPI, background: bool = True,
                 compute: bool = True, widths: dict[str, tuple[int, ...]] | None = None, ahead: bool = True):
        self.model = model
        self.specs = model.models
        # each network's width options (the MLP's: hidden_widths) and the width last chosen for it
        self.widths = {key: tuple(spec.widths) for key, spec in self.specs.items()} | dict(widths or {})
        if default.model in self.widths:
            self.widths[default.model] = tuple(hidden_widths)
        self._chosen = {key: spec.default_width for key, spec in self.specs.items()} | {default.model: default.hidden}
        self.dpi = dpi
        self.view: View | None = None
        self.error = ""
        self.page = Page(self.specs, dpi, stale=self._stale)
        self.drawn = self.page.drawn
        self._suspended = False
        self._closed = False
        self._lock = threading.RLock()  # one job applies its views at a time

        def slider() -> dict:  # a layout of its own each: hiding the width slider hides no other
            return {"continuous_update": False, "style": {"description_width": "initial"},
                    "layout": w.Layout(width="360px")}

        self.batch_slider = w.SelectionSlider(options=list(batch_sizes), value=default.batch,
                                              description="batch size", **slider())
        spec = self.specs[default.model]
        self.model_dropdown = w.Dropdown(options=[(s.title, key) for key, s in self.specs.items()],
                                         value=default.model, description="model",
                                         style={"description_width": "initial"}, layout=w.Layout(width="460px"))
        self.hidden_slider = w.SelectionSlider(options=list(hidden_widths), value=default.hidden,
                                               description=spec.width_name or "width", **slider())
        self.width_help = w.HTML("", layout=w.Layout(margin="0 0 0 12px"))
        self.quantity_toggle = w.ToggleButtons(options=list(QUANTITY_OPTIONS), value=default.quantity,
                                               style={"button_width": "auto"},
                                               tooltips=["(B, P): the gradient of each sample's loss",
                                                         "(B, Y, P): each output of each sample"])
        self.strategy_boxes = {name: w.Checkbox(value=name in default.strategies, description=name, indent=False,
                                                layout=w.Layout(width="auto", margin="0 14px 0 0"))
                               for name in strategies}
        self.sample_slider = w.IntSlider(value=default.sample, min=0, max=max(default.batch - 1, 0),
                                         description="sample", **slider())
        self.clip_slider = w.FloatLogSlider(value=default.clip, base=10, min=-1, max=3, step=0.05,
                                            description="clipping threshold C", readout_format=".3g", **slider())
        self.rerun_button = w.Button(description="rerun timings", icon="refresh",
                                     tooltip="time this setting again (noisy numbers are never kept)",
                                     layout=w.Layout(width="auto", margin="0 18px 0 0"))
        limits = sorted({*SLOW_LIMITS, int(model.slow_limit)})
        self.slow_limit_dropdown = w.Dropdown(
            options=[(f"{n:,} backward passes per call", n) for n in limits], value=int(model.slow_limit),
            description="time slow methods up to", style={"description_width": "initial"},
            layout=w.Layout(width="auto"))
        page = self.page  # the output panes, here under their names too
        self.images, self.progress_html, self.error_html = page.images, page.progress_html, page.error_html
        self.status_html, self.table_html = page.status_html, page.table_html
        self.rule_text, self.layers_html = page.rule_text, page.layers_html
        super().__init__(arrange(self), layout=w.Layout(width="100%"))

        self._fit_width_slider()
        for control in (self.model_dropdown, self.batch_slider, self.hidden_slider, self.quantity_toggle,
                        *self.strategy_boxes.values(),
                        self.sample_slider, self.clip_slider, self.slow_limit_dropdown):
            control.observe(self._on_change, names="value")
        self.rerun_button.on_click(self._on_rerun)
        self._ahead_left = [key for key in self.specs if key != default.model] if ahead else []
        self._warm = ahead
        self._worker = Worker(self._run, idle=self._ahead if self._ahead_left else None) if background else None
        if compute:
            self.refresh()

    # ------------------------------------------------------------------------------------------ controls

    @property
    def selected(self) -> list[str]:
        """The ticked strategies, in order."""
        return [name for name, box in self.strategy_boxes.items() if box.value]

    @property
    def setting(self) -> Setting:
        """What the controls say now."""
        return Setting(model=self.model_dropdown.value, batch=self.batch_slider.value, hidden=self.hidden_slider.value,
                       quantity=self.quantity_toggle.value, strategies=tuple(self.selected),
                       sample=min(self.sample_slider.value, self.batch_slider.value - 1),
                       clip=float(self.clip_slider.value), slow_limit=int(self.slow_limit_dropdown.value))

    def _on_change(self, change: dict) -> None:
        if self._suspended:
            return
        if change["owner"] is self.batch_slider:
            self._fit_sample_slider()
        if change["owner"] is self.hidden_slider:
            self._chosen[self.model_dropdown.value] = change["new"]
        if change["owner"] is self.model_dropdown:
            self._fit_width_slider()
        self.refresh()

    def _fit_width_slider(self) -> None:
        """The width slider for the chosen network: its options, the width last chosen for it, a description
        saying what the width means; hidden where the width is fixed (a user's network), as is a one-item menu."""
        spec = self.specs[self.model_dropdown.value]
        suspended, self._suspended = self._suspended, True
        try:
            options = self.widths[spec.key]
            value = self._chosen.get(spec.key, spec.default_width)
            self.hidden_slider.options = list(options)
            self.hidden_slider.value = value if value in options else options[0]
            self.hidden_slider.description = spec.width_name or "width"
        finally:
            self._suspended = suspended
        fixed = not spec.width_name
        self.hidden_slider.layout.display = "none" if fixed else ""
        self.model_dropdown.layout.display = "none" if len(self.specs) == 1 else ""
        self.width_help.value = (f"<span style='color:#555'>{html.escape(spec.width_help)}</span>"
                                 if not fixed else f"<span style='color:#555'>{html.escape(spec.title)}</span>")

    def _fit_sample_slider(self) -> None:
        suspended, self._suspended = self._suspended, True
        try:
            self.sample_slider.max = max(self.batch_slider.value - 1, 0)
        finally:
            self._suspended = suspended

    def _on_rerun(self, _button) -> None:
        self.refresh(rerun=True)  # the worker forgets the timings: it alone touches the cache

    def set(self, *, batch: int | None = None, hidden: int | None = None, quantity: str | None = None,
            strategies: Sequence[str] | None = None, sample: int | None = None, clip: float | None = None,
            model: str | None = None) -> None:
        """Change several controls at once, then refresh once (setting them one by one refreshes after each);
        ``model`` first (its width slider follows), then ``hidden`` for it."""
        if strategies is not None:
            unknown = set(strategies) - set(self.strategy_boxes)
            if unknown:
                raise ValueError(f"no checkbox for {sorted(unknown)}; the explorer has {list(self.strategy_boxes)}")
        if model is not None and model != self.model_dropdown.value:
            if model not in self.specs:
                raise ValueError(f"unknown model {model!r}; the menu has {', '.join(self.specs)}")
            self._suspended = True
            try:
                self.model_dropdown.value = model
            finally:
                self._suspended = False
            self._fit_width_slider()
        self._suspended = True
        try:
            for control, value in ((self.batch_slider, batch), (self.hidden_slider, hidden),
                                   (self.quantity_toggle, quantity), (self.clip_slider, clip)):
                if value is not None:
                    control.value = value
            self._chosen[self.model_dropdown.value] = self.hidden_slider.value
            self.sample_slider.max = max(self.batch_slider.value - 1, 0)
            if sample is not None:
                self.sample_slider.value = sample
            if strategies is not None:
                for name, box in self.strategy_boxes.items():
                    box.value = name in strategies
        finally:
            self._suspended = False
        self.refresh()

    def refresh(self, *, rerun: bool = False) -> None:
        """Work out the current setting (``rerun``: time it again) in the background worker (returns at once), or here
        with ``background=False``; errors are shown in the widget (and kept in :attr:`error`)."""
        if self._closed:
            return
        job = Job(self.setting, rerun=rerun)
        if self._worker is not None:
            self._worker.submit(job)
        else:
            self._run(job)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker has nothing pending or running (True), or ``timeout`` seconds passed."""
        return True if self._worker is None else self._worker.wait(timeout)

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.busy

    # ------------------------------------------------------------------------------------------ work

    def _run(self, job: Job) -> None:
        """The worker's job: the model's stages for its setting, each shown as it comes (rerun: timings forgotten)."""
        setting = job.setting
        with self._lock:
            try:
                self._check_closed()
                self.page.progress("busy", setting, f"computing the gradients at {setting.describe()} …")
                current = self.view
                if job.rerun:
                    self.model.forget(setting)
                elif current is not None and current.done and _same_work(current.setting, setting):
                    self._show(self.model.with_sample(current, sample=setting.sample, clip=setting.clip))
                    self.page.progress("done", setting, current.progress)
                    self.error = self.error_html.value = ""
                    return
                ahead = self._worker is not None and bool(self._ahead_left)
                for view in self.model.stages(setting, check=self._check):
                    self._show(self._keep_panels(view))
                    if ahead and view.stage == "measuring":  # settled: the next network first, then the slow rows
                        ahead = False
                        self._ahead(self._check, settled=True)
                self.error = self.error_html.value = ""
                self.page.progress("done", self.view.setting, self.view.progress)
                if self._worker is not None:  # the first setting shown: import ahead what the menu needs
                    prefetch.start([*prefetch.TORCH_LAZY, *(m for spec in self.specs.values() for m in spec.imports)])
            except Stale:
                pass  # a newer setting is pending (the worker runs it next), or the explorer was closed
            except Exception as exc:  # shown, not swallowed: the UI must survive e.g. a MemoryBudgetError
                self._show_error(setting, exc)

    def _ahead(self, check: Callable[[], None], settled: bool = False) -> bool:
        """The next network of the menu not yet shown, at the setting the menu would show it at now
        (:meth:`.model.ExplorerModel.ahead`: its first visit then shows at once): the worker's idle work once the shown
        setting is done, after one network waiting for the imports (:mod:`.prefetch`, paused while anyone holds the
        turn); and (``settled``) once a setting's figures are settled, before its slow baselines, not waiting."""
        shown = self.view
        if not settled and (shown is None or not shown.done or self._closed):
            return not self._closed  # the shown setting first
        if not settled and not self._ahead_left and self._warm:  # last: the largest result's memory (prefetch)
            s, top = shown.setting, max(self.widths.get(shown.setting.model) or (0,))
            if top and self.model.device == "cpu" and s.quantity == "grads":  # gives way to any input (Stale)
                prefetch.warm_results((max(self.batch_slider.options), self.model.spec(s).num_params(top)),
                                      self.model.dtype, check=check)
            self._warm = False
        if shown.setting.model in self._ahead_left:  # visited: its later visits are no first ones
            self._ahead_left.remove(shown.setting.model)
        ready = [k for k in self._ahead_left if all(m in sys.modules for m in self.specs[k].imports)]
        importing = prefetch.STARTED and not prefetch.STARTED[0].done.is_set()
        if ready and not (not settled and importing and len(self._ahead_left) < len(self.specs) - 1):
            key, options = ready[0], self.widths[ready[0]]
            hidden = self._chosen.get(key, self.specs[key].default_width)
            setting = dataclasses.replace(self.setting, model=key, hidden=hidden if hidden in options else options[0])
            try:
                if (view := self.model.ahead(setting, check)) is not None:
                    self.page.prerender(view)  # its gradients' figures drawn ahead too (Page.stale asked)
            except Stale:
                return True
            except Exception:  # noqa: S110 - computed ahead only: the network's visit shows what is wrong
                pass
            self._ahead_left.remove(key)
        return bool(self._ahead_left) or self._warm

    def _check(self) -> None:
        """Between steps of the model's work: a new sample or threshold is drawn right here (the timing goes
        on); any other change, a rerun or :meth:`close` abandons this setting."""
        self._check_closed()
        if self._worker is not None and self._worker.outranked():
            raise Stale  # another explorer's newer job runs first; this one runs again after it
        newer = self._worker.peek() if self._worker is not None else None
        if newer is None:
            return
        view, s = self.view, newer.setting
        if view is not None and not newer.rerun and _same_work(s, view.setting) and self._worker.take(newer):
            self._show(self.model.with_sample(view, sample=s.sample, clip=s.clip))
            return
        raise Stale

    def _stale(self) -> None:
        """Raise :class:`Stale` (asked before each figure) when a setting needing new work waits, or on close."""
        self._check_closed()
        newer = self._worker.peek() if self._worker is not None else None
        view = self.view
        if newer is not None and (newer.rerun or view is None or not _same_work(newer.setting, view.setting)):
            raise Stale

    def _check_closed(self) -> None:
        if self._closed:
            raise Stale

    def _keep_panels(self, view: View) -> View:
        """A view from the model carries the sample and threshold its setting started with: keep the ones
        chosen since (drawn by :meth:`_check`)."""
        shown = self.view
        if shown is None or shown.setting.key != view.setting.key:
            return view
        s = shown.setting
        if (s.sample, s.clip) == (view.setting.sample, view.setting.clip):
            return view
        return dataclasses.replace(view, setting=dataclasses.replace(view.setting, sample=s.sample, clip=s.clip),
                                   sample=shown.sample, clipping=shown.clipping)

    # ------------------------------------------------------------------------------------------ drawing

    def _show(self, view: View) -> None:  # draw what changed (Page.show)
        self.view = view
        self.page.show(view)

    def _show_error(self, setting: Setting, exc: Exception) -> None:
        self.error = f"{type(exc).__name__} at {setting.describe()}: {exc}"
        self.page.error(setting, exc, self.view)

    # ------------------------------------------------------------------------------------------ for code

    @property
    def records(self) -> list[Record]:
        return list(self.view.records) if self.view is not None else []

    @property
    def scaling_records(self) -> list[Record]:
        return list(self.view.scaling_records) if self.view is not None else []

    @property
    def max_difference(self) -> float | None:
        return self.view.verdict.max_abs_diff if self.view is not None and self.view.verdict else None

    @property
    def status(self) -> str:
        if self.view is None:
            return ""
        verdict = self.view.verdict.text if self.view.verdict else "checking the per-sample gradients against the loop"
        return "\n".join([verdict, *self.view.notes])

    def snapshot(self, timeout: float | None = 600) -> None:
        """Display the current figures as plain PNG images with a caption (for readers without a kernel: GitHub, a
        notebook not yet run), once the worker is done."""
        self.wait(timeout)
        self.page.snapshot(self.view)

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Close the explorer: stop its worker (its job gives up at its next check) and wait up to ``timeout`` s for
        it, close every widget (an open one stays alive, with its callbacks), let go of the arrays shown: a closed
        explorer is garbage collected like any object (its model keeps only its timings)."""
        if getattr(self, "_closed", True):  # closed already (ipywidgets closes again on disposal), or never built
            super().close()
            return
        self._closed = True
        worker, self._worker = getattr(self, "_worker", None), None
        if worker is not None:
            worker.stop(timeout)
        close_all(self)
        super().close()
        self.view = None
        self.model.release()


def _same_work(a: Setting, b: Setting) -> bool:
    """Whether two settings need the same gradients and timings (they may differ in sample and threshold)."""
    return a.key == b.key and a.strategies == b.strategies and a.slow_limit == b.slow_limit
