"""The explorer's page: its output panes (the figures as PNG ``ipywidgets.Image`` s, the HTML lines and tables),
what each shows of a :class:`~pergrad_viz.explorer.state.View` (:class:`Page`, redrawing only what changed), and
where every control and pane sits (:func:`arrange`).

Figures are drawn at the size they are shown (``dpi`` pixels per inch, the image's CSS width equal to its pixel
width).
"""

from __future__ import annotations

import html
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pergrad_viz.core.extras import missing_extra

try:  # an extra: a clear error where it is missing, this module imported directly too
    import ipywidgets as w
    from matplotlib.figure import Figure
except ImportError as e:
    raise missing_extra(e.name or "ipywidgets", "the explorer (pergrad_viz.explorer)", extra="widgets") from e


from pergrad_viz import viz
from pergrad_viz.explorer import panels
from pergrad_viz.explorer.panels import WIDTHS
from pergrad_viz.explorer.specs import ModelSpec
from pergrad_viz.explorer.state import QUANTITY_NAMES, Setting, View
from pergrad_viz.viz.canvas import minor_ticks_as_marks

__all__ = ["PANELS", "Page", "arrange", "close_all"]

PANELS = ("heatmap", "images", "rule", "clip", "bars", "runtime")
BAR_INTERVAL_S = 0.5  # while timing, the bar chart is redrawn at most this often
BAR_FIRST_S = 2.0  # and drawn first this long after its setting was first shown (or once its fast rows are all in):
# a setting within its 2 s target draws it once, when shown (a draw costs 0.1-0.2 s)
PNGS_KEPT = 64  # the figures last drawn, kept as PNGs by their token: a figure seen again, or drawn ahead
# (Page.prerender), is shown without drawing (about 50-150 kB each)


def image_pane(**layout) -> w.Image:
    return w.Image(format="png", layout=w.Layout(display="none", height="auto", max_width="100%",
                                                 align_self="flex-start", **layout))


class Page:
    """The output panes and what they show.

    Attributes:
        images: {panel: PNG image} (:data:`PANELS`); progress_html, error_html, status_html, table_html,
        rule_text, layers_html: the HTML panes. drawn: {panel: times shown anew (drawn, or its PNG kept from
        the same figure drawn before: :data:`PNGS_KEPT`)}; rendered: {panel: times drawn}.
        stale: called before each figure is drawn; raises :class:`~pergrad_viz.explorer.state.Stale` when
        drawing the rest of this view would only delay the one wanted.
    """

    def __init__(self, specs: Mapping[str, ModelSpec], dpi: float, stale: Callable[[], None]):
        self.specs = specs
        self.dpi = dpi
        self.stale = stale
        self.drawn = dict.fromkeys(PANELS, 0)
        self.rendered = dict.fromkeys(PANELS, 0)
        self._pngs: OrderedDict[tuple[str, object], bytes] = OrderedDict()  # (panel, token) -> PNG
        self._shown: dict[str, object] = {}  # panel -> what it shows (skip redrawing the same)
        self._bars_drawn = -math.inf  # when the bar chart was last drawn (time.monotonic)
        self._measuring: object = None  # the setting whose shown (measuring) view the bar chart was drawn for
        self._timing: tuple[object, float] = (None, 0.0)  # the setting being timed, since when (time.monotonic)
        self.rule_text = w.HTML("")
        self.layers_html = w.HTML("")
        self.progress_html = w.HTML("", layout=w.Layout(margin="0 0 0 12px"))
        self.error_html = w.HTML("")
        self.status_html = w.HTML("")
        self.table_html = w.HTML("")
        self.images = {name: image_pane() for name in PANELS}

    def show(self, view: View) -> None:
        """Draw what changed between the shown view and ``view``: each panel names ``view``'s setting."""
        s = view.setting
        key = s.key
        self.status_html.value = panels.status_html(view)
        self.layers_html.value = panels.layers_html(view)
        kept = {panel: (token, figure) for panel, token, figure in self.figures(view)}
        self.draw("heatmap", *kept["heatmap"])
        self.draw("images", *kept["images"])
        if self._shown.get("runtime", (None,))[0] != key:
            self.hide("runtime")  # the old curve belongs to another setting
        if view.verdict is None and view.stage == "gradients":  # a setting's first view: these first, the rest next
            self.hide("bars")
            self.table_html.value = ""
            self.progress("busy", s, view.progress)
            return
        rule = view.sample.rule
        self.rule_text.value = panels.rule_html(rule)
        if rule.kind is None:
            self.hide("rule")
        else:
            self.draw("rule", *kept["rule"])
        self.draw("clip", *kept["clip"])
        now = time.monotonic()
        if self._timing[0] != key:
            self._timing = (key, now)
        if not view.records:
            self.hide("bars")  # the old chart belongs to another setting; the progress line says what is timed
        elif view.stage == "timing" and now - self._timing[1] < BAR_FIRST_S:
            pass  # the fast methods are timed in well under a second, most often: the chart is drawn once, shown
        elif (view.pending and now - self._bars_drawn < BAR_INTERVAL_S
              and not (view.stage == "measuring" and self._measuring != key)):
            pass  # the chart grows at most this often (drawing it costs more than a tier of cheap methods), but
            # it is drawn as soon as the view is shown (measuring): the rows shown then are final
        else:
            self.draw("bars", *kept["bars"])
            self._bars_drawn = time.monotonic()
            self._measuring = key if view.shown else None
        if "runtime" in kept:
            self.draw("runtime", *kept["runtime"])
        self.table_html.value = panels.table_html(view) if view.records else ""
        self.progress(view.stage if view.shown else "busy", s, view.progress)  # last: once all is drawn

    def figures(self, view: View) -> Iterator[tuple[str, object, Callable[[], Figure]]]:
        """The figures of ``view`` (the rule's where the network has one, the bar chart once there are records, the
        scaling curve once shown): (panel, token, figure), the token naming all that the figure shows."""
        s = view.setting
        loss_key = (s.model, s.batch, s.hidden)  # the fast rule and the DP-SGD view use the loss gradients
        yield "heatmap", (s.key, s.sample), lambda: panels.heatmap_figure(view)
        yield "images", (s.key, s.sample), lambda: panels.images_figure(view, self.specs[s.model])
        if view.sample.rule.kind is not None:
            yield "rule", (loss_key, s.sample), lambda: panels.rule_figure(view)
        c = view.clipping

        def clip() -> Figure:
            named = dict(zip(panels.short_names(list(c.layers)), c.layers.values(), strict=True))  # readable labels
            return viz.clipping_figure(
                c.total, named, c.max_norm, sums=(c.plain_sum_norm, c.clipped_sum_norm), width=WIDTHS["clip"],
                title=f"per-sample gradient norms at {s.describe()}, C={c.max_norm:.3g}")

        yield "clip", (loss_key, s.clip), clip
        noisy = tuple(r.strategy for r in view.records if r.noisy)  # this setting's (not the curve's)
        if view.records:
            yield "bars", (s.key, tuple((r.strategy, r.median_s, r.iqr_s) for r in view.records), view.pending, noisy,
                           view.provisional), lambda: viz.bar_figure(
                view.records, pending=view.pending, noisy=noisy, provisional=view.provisional, width=WIDTHS["bars"],
                title=f"{QUANTITY_NAMES[s.quantity]} at {s.describe()}")
        if view.shown and view.scaling_records:  # redrawn once the slow baselines are done (its title says so),
            # not for each of them done before: a drawing costs more than timing a tier of cheap methods
            yield "runtime", (s.key, tuple((r.strategy, r.batch_size, r.median_s) for r in view.scaling_records),
                              view.stage == "measuring"), lambda: viz.runtime_figure(
                view.scaling_records, highlight=s.batch, width=WIDTHS["runtime"], height=3.6, legend="below",
                title=panels.runtime_title(view))

    def prerender(self, view: View) -> None:
        """Draw ``view``'s figures into the kept PNGs without showing them (a setting computed ahead: its visit
        shows them without drawing); :attr:`stale` is asked before each."""
        for panel, token, figure in self.figures(view):
            if (panel, token) not in self._pngs:
                self.stale()
                self._keep(panel, token, self._render(panel, figure))

    def forget(self) -> None:
        """Drop the kept PNGs (each figure is drawn again when next shown)."""
        self._pngs.clear()

    def _render(self, panel: str, figure: Callable[[], Figure]) -> bytes:
        fig = figure()
        minor_ticks_as_marks(fig)  # the log axes' dozens of minor ticks drawn as marks: no figure is changed later
        self.rendered[panel] += 1
        return viz.to_png(fig, dpi=self.dpi, close=False)  # dropped, not cleared: clearing costs 10% more

    def _keep(self, panel: str, token: object, png: bytes) -> None:
        self._pngs[(panel, token)] = png
        while len(self._pngs) > PNGS_KEPT:
            self._pngs.popitem(last=False)

    def draw(self, panel: str, token: object, figure: Callable[[], Figure]) -> None:
        if self._shown.get(panel) == token:
            return
        png = self._pngs.get((panel, token))
        if png is None:
            self.stale()
            png = self._render(panel, figure)
            self._keep(panel, token, png)
        else:
            self._pngs.move_to_end((panel, token))
        image = self.images[panel]
        image.value = png
        image.layout.width = f"{int.from_bytes(png[16:20], 'big')}px"  # the PNG's own width (its IHDR)
        image.layout.display = ""
        self.drawn[panel] += 1
        self._shown[panel] = token

    def hide(self, panel: str) -> None:
        self.images[panel].layout.display = "none"
        self._shown.pop(panel, None)

    def progress(self, state: str, setting: Setting, text: str) -> None:
        self.progress_html.value = panels.progress_html(state, setting, text)

    def error(self, setting: Setting, exc: Exception, shown: View | None) -> None:
        """Say that ``setting`` could not be computed; the figures stay those of ``shown``."""
        where = shown.setting.describe() if shown is not None else "none yet"
        self.error_html.value = panels.error_html(setting, exc, where)
        self.progress("error", setting, f"could not compute {setting.describe()}")

    def snapshot(self, view: View | None) -> None:
        """Display the current figures as plain PNG images (at the size they are shown), with a caption."""
        from IPython.display import HTML, Image, display

        where = view.setting.describe() if view is not None else "-"
        display(HTML(f"<p><i>A picture of the explorer at {html.escape(where)}, as it looked when this notebook "
                     "was built. Run the notebook (or this cell) for the live explorer with its sliders.</i></p>"))
        for panel in ("bars", "runtime", "heatmap", "images", "rule", "clip"):
            image = self.images[panel]
            if image.value and image.layout.display != "none":
                display(Image(data=bytes(image.value), format="png", width=int(image.layout.width[:-2])))


def arrange(ex: Any) -> list[w.Widget]:
    """The explorer's children, top to bottom: the controls, the progress line, the figures in pairs (``ex``: the
    :class:`~pergrad_viz.explorer.view.Explorer` whose widgets these are; not imported: it stands on this module)."""
    img = ex.images

    def heading(text: str) -> w.HTML:
        return w.HTML(f"<h4 style='margin:14px 0 2px 0'>{html.escape(text)}</h4>")

    def pair(*children: w.Widget) -> w.HBox:
        return w.HBox(list(children), layout=w.Layout(flex_flow="row wrap", align_items="flex-start",
                                                      width="100%"))

    def text(html_text: str) -> w.HTML:
        return w.HTML(f"<div style='max-width:640px;line-height:1.4'>{html_text}</div>")

    rule = w.VBox([
        heading("How the fast rule works"),
        ex.rule_text,
        img["rule"],
    ], layout=w.Layout(margin="0 24px 0 0"))
    clip = w.VBox([
        heading("The DP-SGD view"),
        text(panels.DP_TEXT),
        ex.clip_slider,
        img["clip"],
    ])
    return [
        ex.model_dropdown,
        w.HBox([ex.batch_slider, ex.hidden_slider, ex.width_help],
               layout=w.Layout(flex_flow="row wrap", align_items="center")),
        w.HBox([ex.quantity_toggle, ex.progress_html], layout=w.Layout(align_items="center")),
        w.HBox([w.HTML("<b>strategies:</b>&nbsp;"), *ex.strategy_boxes.values()],
               layout=w.Layout(flex_flow="row wrap", align_items="center")),
        ex.error_html,
        ex.status_html,
        heading("Timing: each strategy at this setting, and how it scales with the batch size"),
        pair(img["bars"], img["runtime"]),
        w.HBox([ex.rerun_button, ex.slow_limit_dropdown],
               layout=w.Layout(flex_flow="row wrap", align_items="center", margin="6px 0 2px 0")),
        ex.table_html,
        heading("The per-sample gradients"),
        ex.sample_slider,
        pair(img["heatmap"], img["images"]),
        pair(rule, clip),
        heading("Which rule computes each layer"),
        ex.layers_html,
    ]


def close_all(root: w.Widget) -> None:
    """Close every widget under ``root`` (its children, theirs, their layouts and styles), not ``root`` itself:
    ipywidgets keeps each open widget, and the callbacks it holds, alive until it is closed."""
    seen, stack = {id(root)}, [root]
    while stack:
        widget = stack.pop()
        for name in widget.keys:
            value = getattr(widget, name, None)
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, w.Widget) and id(item) not in seen:
                    seen.add(id(item))
                    stack.append(item)
                    item.close()
