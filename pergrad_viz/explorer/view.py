"""The explorer's view: ipywidgets only. Controls become a :class:`~.model.Setting`; the model's
:class:`~.model.View` s become images and HTML.

>>> import pergrad_viz as pv
>>> pv.widgets.explorer()          # in a notebook cell: the widget shows itself (a menu of networks)
>>> pv.widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y))     # your own network on your data

The work runs off the kernel's main thread, in one background worker: a control's callback only hands the
new setting over and returns, so the controls and the kernel stay free. A newer setting makes the worker drop
the stale one (the latest wins; nothing queues); a new sample or clipping threshold is drawn in between the
timing's blocks without restarting it. Views arrive progressively (see :meth:`.model.ExplorerModel.stages`):
the gradients' figures and the verdict first, then the bar chart grows tier by tier, the scaling curve last;
the progress line says where it is (``data-state="busy"`` / ``"done"`` / ``"error"`` on its element).

Figures are PNG ``ipywidgets.Image`` s drawn at the size they are shown (``dpi`` pixels per inch, the
image's CSS width equal to its pixel width). The explorer can be driven from code, which is how its tests
work: ``ex.set(batch=8)`` (or ``ex.batch_slider.value = 8``), then ``ex.wait()`` and read ``ex.view``.
"""

from __future__ import annotations

import dataclasses
import html
import math
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import ipywidgets as w
from matplotlib.figure import Figure
from torch import nn

from pergrad_viz import bench
from pergrad_viz.errors import human_bytes
from pergrad_viz.explorer.model import QUANTITIES, QUANTITY_NAMES, ExplorerModel, Setting, Stale, View
from pergrad_viz.explorer.specs import TOKENS_NOTE, menu, user_spec
from pergrad_viz.strategies import STRATEGIES
from pergrad_viz.viz import plots

__all__ = ["Explorer", "explorer"]

QUANTITY_OPTIONS = tuple((QUANTITY_NAMES[q], q) for q in QUANTITIES)
POWERS_OF_TWO_BATCH = tuple(2**k for k in range(9))  # 1 .. 256
POWERS_OF_TWO_HIDDEN = tuple(2**k for k in range(3, 10))  # 8 .. 512
DPI = 96  # CSS pixels per inch: a figure of 8 in shows 768 px wide, drawn at that size
PANELS = ("heatmap", "images", "rule", "clip", "bars", "runtime")
RULE_TEXT = {
    "linear": "For a Linear layer, one sample's weight gradient is the outer product of the backprop signal "
              "g<sub>i</sub> at the layer's output and the layer's input a<sub>i</sub> (summed over positions where "
              "the input is a sequence): one backward pass for the whole batch gives every g<sub>i</sub>, so every "
              "per-sample gradient costs one outer product, and its norm is ||g<sub>i</sub>|| ||a<sub>i</sub>|| "
              "without forming it (the ghost-norm trick).",
    "conv": "For a convolution, one sample's weight gradient is the backprop signal at each output position "
            "G<sub>i</sub> times the input patch that position saw (the unfolded patches U<sub>i</sub>): "
            "G<sub>i</sub> U<sub>i</sub><sup>T</sup>, one matrix product per sample after one backward pass for "
            "the whole batch.",
    "embedding": "For an embedding, one sample's gradient of the table is zero except on the rows of the tokens it "
                 "used: row v is the sum of the backprop signals at the positions holding token v "
                 "(O<sub>i</sub><sup>T</sup> G<sub>i</sub>, O<sub>i</sub> the one-hot rows of its tokens).",
}
HOW = {"rule": "closed-form rule", "call": "rule on the layer's call (its own forward, captured)",
       "fallback": "per-layer fallback (vmap / loop over this layer only)"}
# Figures come in pairs that sit side by side where the page is wide enough (a 1400 px dashboard: each pair at
# most about 13.9 in = 1330 px) and wrap onto two lines where it is not (JupyterLab with its side bar open).
WIDTHS = {"bars": 6.3, "runtime": 7.0, "heatmap": 7.4, "rule": 6.9, "clip": 6.5, "tokens": 6.3}  # inches
SLOW_LIMITS = (256, 1024, 4096, 16384, 65536)  # the slow-methods control's options (and the explorer's default)
BAR_INTERVAL_S = 0.5  # while timing, the bar chart is redrawn at most this often


class _Worker:
    """One daemon thread running the latest submitted job; a newer submission makes ``stale()`` true."""

    def __init__(self, run: Callable[[Setting], None]):
        self._run = run
        self._cond = threading.Condition()
        self._pending: Setting | None = None
        self._busy = False
        self._generation = 0
        self._thread = threading.Thread(target=self._loop, name="pergrad-explorer", daemon=True)
        self._thread.start()

    def submit(self, setting: Setting) -> None:
        with self._cond:
            self._pending = setting
            self._generation += 1
            self._cond.notify_all()

    def peek(self) -> Setting | None:
        with self._cond:
            return self._pending

    def take(self, setting: Setting) -> bool:
        """Take ``setting`` off the queue if it is still the pending one (handled in place)."""
        with self._cond:
            if self._pending is setting:
                self._pending = None
                self._generation += 1
                return True
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or running; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy or self._pending is not None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                setting, self._pending, self._busy = self._pending, None, True
            try:
                self._run(setting)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _image(**layout) -> w.Image:
    return w.Image(format="png", layout=w.Layout(display="none", height="auto", max_width="100%",
                                                 align_self="flex-start", **layout))


class Explorer(w.VBox):
    """The explorer widget (an ``ipywidgets.VBox``); build it with :func:`explorer`.

    Controls: ``model_dropdown`` (the network; hidden when there is one), ``batch_slider``, ``hidden_slider`` (the
    network's width, described for each network; hidden for a user's network) (``SelectionSlider`` s),
    ``quantity_toggle``
    (``"grads"`` / ``"jacobian"``), ``strategy_boxes`` (``{strategy: Checkbox}``), ``sample_slider`` (the sample
    of the sample panels), ``clip_slider`` (DP-SGD's threshold C), ``rerun_button`` (time this setting again),
    ``slow_limit_dropdown`` (the slow baselines are timed up to this many sample-backward passes per call).

    State for code and tests:
        model: the :class:`~.model.ExplorerModel`; view: the latest :class:`~.model.View` shown (None before).
        records, scaling_records: the view's records; status: its verdict line and notes as plain text;
        max_difference: the verdict's max |difference|; error: the last error's text ("" when the last
        setting worked); drawn: {panel: times drawn}; busy: work pending or running.
    """

    def __init__(self, model: ExplorerModel, *, batch_sizes: Sequence[int], hidden_widths: Sequence[int],
                 strategies: Sequence[str], default: Setting, dpi: float = DPI, background: bool = True,
                 compute: bool = True, widths: dict[str, tuple[int, ...]] | None = None):
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
        self.drawn = dict.fromkeys(PANELS, 0)
        self._shown: dict[str, object] = {}  # panel -> what it shows (skip redrawing the same)
        self._suspended = False
        self._rerun = False  # the next job times again even if the setting is shown already
        self._bars_drawn = -math.inf  # when the bar chart was last drawn (time.monotonic)
        self._lock = threading.RLock()  # one job applies its views at a time

        slider = {"continuous_update": False, "style": {"description_width": "initial"},
                  "layout": w.Layout(width="360px")}
        self.batch_slider = w.SelectionSlider(options=list(batch_sizes), value=default.batch,
                                              description="batch size", **slider)
        spec = self.specs[default.model]
        self.model_dropdown = w.Dropdown(options=[(s.title, key) for key, s in self.specs.items()],
                                         value=default.model, description="model",
                                         style={"description_width": "initial"}, layout=w.Layout(width="460px"))
        self.hidden_slider = w.SelectionSlider(options=list(hidden_widths), value=default.hidden,
                                               description=spec.width_name or "width", **slider)
        self.width_help = w.HTML("", layout=w.Layout(margin="0 0 0 12px"))
        self.rule_text = w.HTML("")
        self.layers_html = w.HTML("")
        self.quantity_toggle = w.ToggleButtons(options=list(QUANTITY_OPTIONS), value=default.quantity,
                                               style={"button_width": "auto"},
                                               tooltips=["(B, P): the gradient of each sample's loss",
                                                         "(B, Y, P): each output of each sample"])
        self.strategy_boxes = {name: w.Checkbox(value=name in default.strategies, description=name, indent=False,
                                                layout=w.Layout(width="auto", margin="0 14px 0 0"))
                               for name in strategies}
        self.sample_slider = w.IntSlider(value=default.sample, min=0, max=max(default.batch - 1, 0),
                                         description="sample", **slider)
        self.clip_slider = w.FloatLogSlider(value=default.clip, base=10, min=-1, max=3, step=0.05,
                                            description="clipping threshold C", readout_format=".3g", **slider)
        self.rerun_button = w.Button(description="rerun timings", icon="refresh",
                                     tooltip="time this setting again (noisy numbers are never kept)",
                                     layout=w.Layout(width="auto", margin="0 18px 0 0"))
        limits = sorted({*SLOW_LIMITS, int(model.slow_limit)})
        self.slow_limit_dropdown = w.Dropdown(
            options=[(f"{n:,} backward passes per call", n) for n in limits], value=int(model.slow_limit),
            description="time slow methods up to", style={"description_width": "initial"},
            layout=w.Layout(width="auto"))
        self.progress_html = w.HTML("", layout=w.Layout(margin="0 0 0 12px"))
        self.error_html = w.HTML("")
        self.status_html = w.HTML("")
        self.table_html = w.HTML("")
        self.images = {name: _image() for name in PANELS}
        super().__init__(layout=w.Layout(width="100%"))
        self._build()

        self._fit_width_slider()
        for control in (self.model_dropdown, self.batch_slider, self.hidden_slider, self.quantity_toggle,
                        *self.strategy_boxes.values(),
                        self.sample_slider, self.clip_slider, self.slow_limit_dropdown):
            control.observe(self._on_change, names="value")
        self.rerun_button.on_click(self._on_rerun)
        self._worker = _Worker(self._run) if background else None
        if compute:
            self.refresh()

    # ------------------------------------------------------------------------------------------ layout

    def _build(self) -> None:
        img = self.images

        def heading(text: str) -> w.HTML:
            return w.HTML(f"<h4 style='margin:14px 0 2px 0'>{html.escape(text)}</h4>")

        def pair(*children: w.Widget) -> w.HBox:
            return w.HBox(list(children), layout=w.Layout(flex_flow="row wrap", align_items="flex-start",
                                                          width="100%"))

        def text(html_text: str) -> w.HTML:
            return w.HTML(f"<div style='max-width:640px;line-height:1.4'>{html_text}</div>")

        rule = w.VBox([
            heading("How the fast rule works"),
            self.rule_text,
            img["rule"],
        ], layout=w.Layout(margin="0 24px 0 0"))
        clip = w.VBox([
            heading("The DP-SGD view"),
            text("DP-SGD clips each sample's gradient to norm at most C before summing (then adds noise), so that "
                 "no single example can move the model much."),
            self.clip_slider,
            img["clip"],
        ])
        self.children = [
            self.model_dropdown,
            w.HBox([self.batch_slider, self.hidden_slider, self.width_help],
                   layout=w.Layout(flex_flow="row wrap", align_items="center")),
            w.HBox([self.quantity_toggle, self.progress_html], layout=w.Layout(align_items="center")),
            w.HBox([w.HTML("<b>strategies:</b>&nbsp;"), *self.strategy_boxes.values()],
                   layout=w.Layout(flex_flow="row wrap", align_items="center")),
            self.error_html,
            self.status_html,
            heading("Timing: each strategy at this setting, and how it scales with the batch size"),
            pair(img["bars"], img["runtime"]),
            w.HBox([self.rerun_button, self.slow_limit_dropdown],
                   layout=w.Layout(flex_flow="row wrap", align_items="center", margin="6px 0 2px 0")),
            self.table_html,
            heading("The per-sample gradients"),
            self.sample_slider,
            pair(img["heatmap"], img["images"]),
            pair(rule, clip),
            heading("Which rule computes each layer"),
            self.layers_html,
        ]

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
        self.model.forget(self.setting)
        self._rerun = True
        self.refresh()

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

    def refresh(self) -> None:
        """Work out the current setting: in the background worker (returns at once), or here when the explorer
        was built with ``background=False``. Errors are shown in the widget (and kept in :attr:`error`)."""
        setting = self.setting
        self._progress("busy", setting, f"computing the gradients at {setting.describe()} …")
        if self._worker is not None:
            self._worker.submit(setting)
        else:
            self._run(setting)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker has nothing pending or running (True), or ``timeout`` seconds passed."""
        return True if self._worker is None else self._worker.wait(timeout)

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.busy

    # ------------------------------------------------------------------------------------------ work

    def _run(self, setting: Setting) -> None:
        """The worker's job: the model's stages for ``setting``, each shown as it comes."""
        with self._lock:
            try:
                current, rerun, self._rerun = self.view, self._rerun, False
                if current is not None and current.done and not rerun and _same_work(current.setting, setting):
                    self._show(self.model.with_sample(current, sample=setting.sample, clip=setting.clip))
                    self._progress("done", setting, current.progress)
                    self.error = ""
                    self.error_html.value = ""
                    return
                for view in self.model.stages(setting, check=self._check):
                    self._show(self._keep_panels(view))
                self.error = ""
                self.error_html.value = ""
                self._progress("done", self.view.setting, self.view.progress)
            except Stale:
                pass  # a newer setting is pending: the worker runs it next
            except Exception as exc:  # shown, not swallowed: the UI must survive e.g. a MemoryBudgetError
                self._show_error(setting, exc)

    def _check(self) -> None:
        """Between steps of the model's work: a new sample or threshold is drawn right here (the timing goes
        on); any other change abandons this setting."""
        if self._worker is None:
            return
        newer = self._worker.peek()
        view = self.view
        if newer is None:
            return
        if view is not None and _same_work(newer, view.setting) and self._worker.take(newer):
            self._show(self.model.with_sample(view, sample=newer.sample, clip=newer.clip))
            return
        raise Stale

    def _stale(self) -> None:
        """Raise :class:`Stale` when a setting that needs new gradients or timings is waiting (between two
        figures: drawing the rest of a stale view would only delay the one wanted)."""
        newer = self._worker.peek() if self._worker is not None else None
        view = self.view
        if newer is not None and (view is None or not _same_work(newer, view.setting)):
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

    def _show(self, view: View) -> None:
        """Draw what changed between the shown view and ``view``: each panel names ``view``'s setting."""
        self.view = view
        s = view.setting
        key = s.key
        self._status(view)
        self._layers(view)
        self._draw("heatmap", (key, s.sample), lambda: self._heatmap(view))
        self._draw("images", (key, s.sample), lambda: self._images(view))
        if self._shown.get("runtime", (None,))[0] != key:
            self._hide("runtime")  # the old curve belongs to another setting
        if view.verdict is None:  # the first view of a setting: the heatmap and images first, the rest next
            self._hide("bars")
            self.table_html.value = ""
            self._progress("busy", s, view.progress)
            return
        loss_key = (s.model, s.batch, s.hidden)  # the fast rule and the DP-SGD view use the loss gradients
        rule = view.sample.rule
        self.rule_text.value = (f"<div style='max-width:640px;line-height:1.4'>{RULE_TEXT[rule.kind]} Here: "
                                f"<code>{html.escape(rule.layer)}</code>, the first layer with such a rule.</div>"
                                if rule.kind else
                                f"<div style='max-width:640px;line-height:1.4;color:#8a5300'>{html.escape(rule.note)}"
                                "</div>")
        if rule.kind is None:
            self._hide("rule")
        else:
            self._draw("rule", (loss_key, s.sample), lambda: self._rule(view))
        c = view.clipping
        self._draw("clip", (loss_key, s.clip), lambda: plots.clipping_figure(
            c.total, c.layers, c.max_norm, sums=(c.plain_sum_norm, c.clipped_sum_norm), width=WIDTHS["clip"],
            title=f"per-sample gradient norms at {s.describe()}, C={c.max_norm:.3g}"))
        noisy = tuple(r.strategy for r in view.records if r.noisy)  # this setting's (not the curve's)
        bars = (key, tuple((r.strategy, r.median_s) for r in view.records), view.pending, noisy, view.provisional)
        if not view.records:
            self._hide("bars")  # the old chart belongs to another setting; the progress line says what is timed
        elif view.pending and time.monotonic() - self._bars_drawn < BAR_INTERVAL_S:
            pass  # the chart grows at most this often (drawing it costs more than a tier of cheap methods)
        else:
            self._draw("bars", bars, lambda: plots.bar_figure(
                view.records, pending=view.pending, noisy=noisy, provisional=view.provisional, width=WIDTHS["bars"],
                title=f"{QUANTITY_NAMES[s.quantity]} at {s.describe()}"))
            self._bars_drawn = time.monotonic()
        if view.done:
            self._draw("runtime", (key, tuple((r.strategy, r.batch_size, r.median_s) for r in view.scaling_records)),
                       lambda: plots.runtime_figure(view.scaling_records, highlight=s.batch, width=WIDTHS["runtime"],
                                                    height=3.6, legend="below",
                                                    title=f"time vs batch size, {_width(s)} "
                                                          f"(dotted: B={s.batch})"))
        self.table_html.value = _table_html(view) if view.records else ""
        self._progress("done" if view.done else "busy", s, view.progress)  # last: "done" once all is drawn

    def _images(self, view: View) -> Figure | None:
        """The sample panel: the input (an image, or the tokens) with its first layer's gradients."""
        s, sv = view.setting, view.sample
        spec = self.specs[s.model]
        if sv.first_layer is not None and sv.first_layer.dim() == 3:
            image = sv.image if sv.kind == "image" else None
            shape = None
            if image is not None and image.numel() != sv.first_layer[0].numel():
                side = int(image.numel() ** 0.5)
                shape = (side, side) if image.dim() <= 1 or image.numel() == side * side else tuple(image.shape[-2:])
                if image.dim() == 3 and image.shape[0] == 3:
                    image = image.mean(0)  # a colour image in grey
                    shape = tuple(image.shape)
            return plots.first_layer_images(
                sv.first_layer, image=image, titles=list(sv.first_layer_titles), image_shape=shape,
                ncols=5 if s.quantity == "grads" else 6, cell=1.15 if s.quantity == "grads" else 0.95,
                image_title=f"input ({sv.label})", suptitle=sv.first_layer_title)
        matrix = sv.first_layer if sv.first_layer is not None else view.grads[sv.index:sv.index + 1, :2000]
        tokens = sv.image if sv.kind == "tokens" else None
        title = sv.first_layer_title + (f" ({TOKENS_NOTE})" if tokens is not None and spec.max_batch is None else "")
        rows = list(sv.first_layer_titles) if sv.first_layer is not None else []
        return plots.token_figure(tokens, matrix, grid=spec.token_grid, row_labels=rows, title=title,
                                  width=WIDTHS["tokens"], xlabel="embedding dimension" if tokens is not None
                                  and s.quantity == "grads" else "",
                                  matrix_title="the gradient of the first layer's weight" if s.quantity == "grads"
                                  else "sensitivity of each output")

    def _rule(self, view: View) -> Figure:
        s, rule, sv = view.setting, view.sample.rule, view.sample
        where = f"sample {sv.index} ({sv.label}) at {s.describe()}"
        if rule.a is not None and rule.a.numel() == 784:  # the tutorial's picture: the input is an image
            return plots.outer_product_figure(rule.a, rule.g, gradient_norm=rule.gradient_norm, width=WIDTHS["rule"],
                                              title=f"{where}: {rule.layer}.weight's per-sample gradient is g_i a_i^T")
        return plots.factor_figure(rule.left, rule.right, rule.product, names=rule.names,
                                   gradient_norm=rule.gradient_norm, difference=rule.difference, width=WIDTHS["rule"],
                                   title=f"{where}: {rule.layer}.weight's per-sample gradient is {rule.names[2]}")

    def _layers(self, view: View) -> None:
        rows = "".join(f"<tr><td style='padding:1px 8px'><code>{html.escape(name)}</code></td>"
                       f"<td style='padding:1px 8px'>{html.escape(kind)}</td>"
                       f"<td style='padding:1px 8px;{'color:#8a5300' if how == 'fallback' else ''}' "
                       f"data-how='{how}'>{html.escape(HOW.get(how, how))}</td></tr>"
                       for name, kind, how in view.layers)
        self.layers_html.value = ("<table class='pergrad-layers' style='border-collapse:collapse;font-size:12px'>"
                                  "<thead><tr><th style='text-align:left;padding:1px 8px'>layer</th>"
                                  "<th style='text-align:left;padding:1px 8px'>type</th>"
                                  "<th style='text-align:left;padding:1px 8px'>per-sample gradients by</th></tr>"
                                  f"</thead><tbody>{rows}</tbody></table>")

    def _heatmap(self, view: View) -> Figure:
        s, i = view.setting, view.sample.index
        bounds = _display_bounds(view.boundaries)
        title = f"per-sample gradients at {s.describe()}: B={s.batch} x P={view.grads.shape[1]:,} (sample {i} marked)"
        width = WIDTHS["heatmap"]
        if view.sample.jacobian is None:
            return plots.gradient_heatmap(view.grads, bounds, figsize=(width, 3.4), title=title,
                                          highlight_row=i, max_cols=560)
        fig = Figure(figsize=(width, 6.4))  # margins in inches, no layout engine (it would double the drawing time)
        top, bottom = fig.subplots(2, 1, height_ratios=[1.2, 1])
        fig.subplots_adjust(left=1.0 / width, right=1 - 0.9 / width, top=1 - 0.62 / 6.4, bottom=1.1 / 6.4,
                            hspace=0.8)
        names = view.sample.first_layer_titles
        plots.gradient_heatmap(view.grads, bounds, ax=top, title=plots.fit_text(title, width - 1.9),
                               highlight_row=i, max_cols=560)
        plots.gradient_heatmap(view.sample.jacobian, bounds, ax=bottom, ylabel="output", row_labels=names,
                               max_cols=560, title=f"output Jacobian of sample {i} ({view.sample.label}): "
                                                   f"Y={view.sample.jacobian.shape[0]} x P")
        return fig

    def _draw(self, panel: str, token: object, figure: Callable[[], Figure]) -> None:
        if self._shown.get(panel) == token:
            return
        self._stale()
        png = plots.to_png(figure(), dpi=self.dpi)
        image = self.images[panel]
        image.value = png
        image.layout.width = f"{int.from_bytes(png[16:20], 'big')}px"  # the PNG's own width (its IHDR)
        image.layout.display = ""
        self.drawn[panel] += 1
        self._shown[panel] = token

    def _hide(self, panel: str) -> None:
        self.images[panel].layout.display = "none"
        self._shown.pop(panel, None)

    def _progress(self, state: str, setting: Setting, text: str) -> None:
        icon = {"busy": "⏳", "done": "✓", "error": "⚠"}[state]
        color = {"busy": "#a15c00", "done": "#1b7f3b", "error": "#c62828"}[state]
        self.progress_html.value = (f"<span class='pergrad-progress' data-state='{state}' "
                                    f"data-setting='{setting.model} B={setting.batch} hidden={setting.hidden} "
                                    f"{setting.quantity}' "
                                    f"style='color:{color}'>{icon} {html.escape(text)}</span>")

    def _status(self, view: View) -> None:
        v = view.verdict
        if v is None:
            lines = [f"<div style='margin:4px 0'>checking the per-sample gradients against the loop at "
                     f"{html.escape(view.setting.describe())} …</div>"]
        else:
            verdict = ("<b class='pergrad-verdict' data-ok='true' style='color:#1b7f3b'>agree</b>" if v.ok else
                       "<b class='pergrad-verdict' data-ok='false' style='color:#c62828'>DISAGREE</b>")
            lines = [f"<div style='margin:4px 0'>{verdict} · {html.escape(v.text)}</div>"]
        for note in view.notes:
            if note.startswith("provisional"):  # calm: more rounds are on their way, nothing is wrong
                lines.append(f"<div class='pergrad-note' data-kind='provisional' style='color:#666'>"
                             f"{html.escape(note)}</div>")
            else:
                kind = "noisy" if note.startswith("noisy") else "skipped"
                lines.append(f"<div class='pergrad-note' data-kind='{kind}' style='color:#8a5300'>"
                             f"⚠ {html.escape(note)}</div>")
        self.status_html.value = "".join(lines)

    def _show_error(self, setting: Setting, exc: Exception) -> None:
        where = setting.describe()
        self.error = f"{type(exc).__name__} at {where}: {exc}"
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        shown = self.view.setting.describe() if self.view is not None else "none yet"
        self.error_html.value = (
            "<div class='pergrad-error' style='border-left:4px solid #c62828;background:#fdecea;padding:6px 10px;"
            "margin:4px 0'>"
            f"<b>Could not compute {html.escape(QUANTITY_NAMES[setting.quantity])} at {html.escape(where)}.</b><br>"
            f"<code style='white-space:pre-wrap'>{html.escape(message)}</code><br>"
            f"The figures below are from the previous setting ({html.escape(shown)}); choose another setting to "
            "continue.</div>")
        self._progress("error", setting, f"could not compute {where}")

    # ------------------------------------------------------------------------------------------ for code

    @property
    def records(self) -> list[bench.Record]:
        return list(self.view.records) if self.view is not None else []

    @property
    def scaling_records(self) -> list[bench.Record]:
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
        """Display the current figures as plain PNG images (at the size they are shown), with a caption: a
        picture of the explorer for readers without a kernel (GitHub, a notebook not yet run). Waits for the
        worker first."""
        from IPython.display import HTML, Image, display

        self.wait(timeout)
        where = self.view.setting.describe() if self.view is not None else "-"
        display(HTML(f"<p><i>A picture of the explorer at {html.escape(where)}, as it looked when this notebook "
                     "was built. Run the notebook (or this cell) for the live explorer with its sliders.</i></p>"))
        for panel in ("bars", "runtime", "heatmap", "images", "rule", "clip"):
            image = self.images[panel]
            if image.value and image.layout.display != "none":
                display(Image(data=bytes(image.value), format="png", width=int(image.layout.width[:-2])))

    def close(self) -> None:
        self._worker = None  # the daemon thread idles; nothing more is submitted
        super().close()


TABLE_COLUMNS = ("method", "median", "IQR", "vs loop", "vs fwd+bwd", "vs floor", "result", "max |diff| vs loop",
                 "note")


def _table_row(r: bench.Record) -> tuple[str, ...]:
    def ratio(x: float | None) -> str:
        return "-" if x is None else plots.fmt_ratio(x)

    return (r.strategy, "-" if r.median_s is None else plots.fmt_seconds(r.median_s),
            "-" if r.iqr_s is None else plots.fmt_seconds(r.iqr_s), ratio(r.speedup_vs_loop),
            ratio(r.vs_forward_backward), ratio(r.vs_memory_floor), human_bytes(r.result_bytes),
            "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}", r.note)


def _table_html(view: View) -> str:
    """The records of one setting as an HTML table, its caption a paragraph above it (full width)."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = []
    provisional = set(view.provisional)
    for r in view.records:
        grey = r.strategy in plots.REFERENCES or r.skipped or r.strategy in provisional
        style = "color:#8a5300" if r.noisy else ("color:#777" if grey else "")
        cells = "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in _table_row(r))
        body.append(f"<tr style='{style}'>{cells}</tr>")
    s = view.setting
    v = view.verdict
    checked = "" if v is None else (f"all {v.samples} samples" if v.samples == v.batch
                                    else f"{v.samples} of {v.batch} samples, spread evenly over the batch")
    caption = (f"{QUANTITY_NAMES[s.quantity]} at {s.describe()}. median: time per call over interleaved rounds "
               "(more rounds where they varied); IQR: the spread of the rounds; vs loop: speed-up over the loop; "
               "vs fwd+bwd, vs floor: time over one forward+backward of the batch and over writing the result once, "
               "timed in the same rounds; max |diff| vs loop: the largest difference from the loop (the definition)"
               + (f" on {checked}" if checked else "") + ".")
    return (f"<div style='font-size:12px;max-width:1100px;margin:2px 0 4px 0'>{html.escape(caption)}</div>"
            f"<table style='border-collapse:collapse;font-size:12px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def _display_bounds(bounds: Sequence[tuple[str, int, int]], most: int = 6) -> list[tuple[str, int, int]]:
    """The heatmap's blocks: one per parameter where there are at most ``most`` of them (the MLP's fc1.weight,
    fc1.bias, ...), else one per layer (a module's parameters together), named by the last two parts of its name
    (``layers.0.linear1`` -> ``0.linear1``): the labels stay readable under the plot."""
    if len(bounds) <= most:
        return list(bounds)
    merged: list[tuple[str, int, int]] = []
    for name, a, b in bounds:
        layer = name.rsplit(".", 1)[0] if "." in name else name
        if merged and merged[-1][0] == layer and merged[-1][2] == a:
            merged[-1] = (layer, merged[-1][1], b)
        else:
            merged.append((layer, a, b))
    return [(".".join(n.split(".")[-2:]) if n.count(".") > 1 else n, a, b) for n, a, b in merged]


def _width(s: Setting) -> str:
    return s.describe().split(", ", 1)[1] if s.model != "mlp" else f"at hidden width {s.hidden}"


def _same_work(a: Setting, b: Setting) -> bool:
    """Whether two settings need the same gradients and timings (they may differ in sample and threshold)."""
    return a.key == b.key and a.strategies == b.strategies and a.slow_limit == b.slow_limit


def _options(values: Sequence[int], default: int, what: str) -> tuple[int, ...]:
    options = sorted({int(v) for v in values} | {int(default)})
    if options[0] < 1:
        raise ValueError(f"{what} must be positive integers, got {tuple(values)}")
    return tuple(options)


def explorer(*, model: nn.Module | None = None, loss_fn: Callable | None = None, data: object = None,
             class_names: Sequence[str] | None = None, models: Sequence[str] | None = None,
             default_model: str = "mlp", batch_sizes: Sequence[int] = POWERS_OF_TWO_BATCH,
             hidden_widths: Sequence[int] = POWERS_OF_TWO_HIDDEN, strategies: Sequence[str] = STRATEGIES,
             default_batch: int | None = None, default_hidden: int = 20, quantity: str = "grads",
             slow_limit: int = 1024, rounds: int = 5, sweep_batches: int = 3, device: str = "cpu", dpi: float = DPI,
             threads: int | None = None, background: bool = True, compute: bool = True,
             **model_options) -> Explorer:
    """The interactive explorer of the strategies: on a menu of networks (the tutorial ``MLP(784, hidden, 10)``
    first, a small CNN, a transformer encoder, an LSTM classifier), or on your own network and data.

    Args:
        model, loss_fn, data: your own network, its loss (``loss_fn(model(inputs), targets)``, summed over the
            samples) and data: ``(inputs, targets)`` (inputs as ``per_sample_grads`` takes them: a tensor, a tuple,
            a dict; the samples first), a Dataset of ``(input, target)`` pairs or a DataLoader. The batch-size slider
            runs over the first samples (up to 256); the network is used as it is: never trained, moved or changed.
        class_names: names of your targets' classes (targets that are class indices or one-hot rows).
        models: the menu's networks to offer (default all: ``"mlp", "cnn", "transformer", "lstm"``);
            default_model: the one shown first.
        batch_sizes, hidden_widths: the sliders' options (default powers of two, 1..256 and, for the MLP, 8..512;
            each other network has its own widths, see :data:`~.specs.MENU`).
        strategies: one checkbox each (names from :data:`pergrad_viz.STRATEGIES`, or ``"auto"``).
        default_batch, default_hidden: the sliders' start values (added to the options where absent: the
            tutorial's hidden width 20 sits between 16 and 32; default_hidden is the MLP's).
        quantity: ``"grads"`` (per-sample gradients, (B, P)) or ``"jacobian"`` (output Jacobians, (B, Y, P)).
        slow_limit: ``loop``, ``autograd_stack`` and ``batched_grad`` are skipped, with a visible note, where
            they would push more than this many samples through backward passes per call (the loop: B for
            gradients, B x Y for Jacobians; the other two B times that, see ``bench.backward_work``); the
            explorer's "time slow methods up to" control starts here.
        rounds: interleaved timing rounds per method (fewer, down to 3, for expensive ones).
        sweep_batches: how many batch sizes (up to the current one) are timed for the scaling curve.
        device: where to compute the menu's networks (yours stays where it is). dpi: pixels per inch of the figures.
        threads: intra-op threads while computing (default: all cores but one).
        background: work in a background thread (False: in the control's callback, e.g. for tests).
        compute: start on the default setting now.
        model_options: more :class:`~.model.ExplorerModel` options (``min_block_s``, ``tier_budget_s`` ...).

    Returns:
        The :class:`Explorer`; as a cell's last expression it shows itself.
    """
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {', '.join(map(repr, QUANTITIES))}, got {quantity!r}")
    if model is not None:
        if loss_fn is None or data is None:
            raise ValueError("explorer(model=...) needs loss_fn= and data=(inputs, targets) (or a Dataset / "
                             "DataLoader) too")
        spec = user_spec(model, loss_fn, data, max_batch=max(batch_sizes), class_names=class_names)
        specs = {spec.key: spec}
        batch_sizes = tuple(b for b in batch_sizes if b <= spec.max_batch) or (spec.max_batch,)
        default_model, default_hidden = spec.key, 0
        default_batch = default_batch if default_batch is not None else min(spec.default_batch, max(batch_sizes))
    else:
        if loss_fn is not None or data is not None:
            raise ValueError("loss_fn= and data= go with model=: pass your network too")
        specs = dict(menu(models))
        if default_model not in specs:
            raise ValueError(f"default_model {default_model!r} is not among the models {list(specs)}")
        default_batch = default_batch if default_batch is not None else 32
        if default_model != "mlp":
            default_hidden = specs[default_model].default_width
    batch_sizes = _options(batch_sizes, default_batch, "batch_sizes")
    widths = {key: spec.widths for key, spec in specs.items()}
    if "mlp" in specs:
        widths["mlp"] = _options(hidden_widths, default_hidden if default_model == "mlp" else 20, "hidden_widths")
    unknown = [s for s in strategies if s != "auto" and s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
    if rounds < 1 or sweep_batches < 1:
        raise ValueError(f"rounds and sweep_batches must be at least 1, got {rounds} and {sweep_batches}")
    if not (math.isfinite(dpi) and dpi > 0):
        raise ValueError(f"dpi must be a positive number, got {dpi!r}")
    explorer_model = ExplorerModel(batch_options=batch_sizes, slow_limit=slow_limit, rounds=rounds,
                                   sweep_batches=sweep_batches, device=device, threads=threads, models=specs,
                                   **model_options)
    default = Setting(model=default_model, batch=default_batch, hidden=default_hidden, quantity=quantity,
                      strategies=tuple(strategies))
    return Explorer(explorer_model, batch_sizes=batch_sizes, hidden_widths=widths[default_model],
                    strategies=tuple(strategies), default=default, dpi=dpi, background=background, compute=compute,
                    widths=widths)
