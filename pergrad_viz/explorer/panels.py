"""The explorer's panels: figures (matplotlib ``Figure`` s, drawn by :mod:`pergrad_viz.viz`) and HTML
strings from a :class:`~pergrad_viz.explorer.state.View`. Pure: a view in, a figure or a string out; the widget
(:mod:`.view`) puts them on the page.
"""

from __future__ import annotations

import html
import traceback
from collections.abc import Sequence

from pergrad_viz.core.extras import missing_extra

try:  # an extra: a clear error where it is missing, this module imported directly too
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as e:
    raise missing_extra(e.name or "matplotlib", "the explorer (pergrad_viz.explorer)", extra="widgets") from e


from pergrad_viz import viz
from pergrad_viz.bench.records import Record
from pergrad_viz.errors import human_bytes
from pergrad_viz.explorer.specs import TOKENS_NOTE, ModelSpec
from pergrad_viz.explorer.state import QUANTITY_NAMES, RuleView, Setting, View
from pergrad_viz.viz.canvas import DIVERGING, TITLE_Y, axes_at_inches, fit_text, text_width_in, to_numpy

__all__ = ["DP_TEXT", "HOW", "RULE_TEXT", "WIDTHS", "display_bounds", "error_html", "heatmap_figure", "images_figure",
           "image_matrix_figure", "layers_html", "progress_html", "rule_figure", "rule_html", "runtime_title",
           "short_names", "status_html", "table_html", "width_text"]

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
DP_TEXT = ("DP-SGD clips each sample's gradient g<sub>i</sub> to norm at most C before summing (then adds noise), so "
           "that no single example can move the model much. This view holds every g<sub>i</sub> to draw them; "
           "training does not: <code>pv.clipped_grad_sum</code> (and <code>pv.dp_step</code>, which puts it in "
           "<code>.grad</code>) runs one forward and one backward, takes each layer's ghost norms from the inputs "
           "A and output gradients G it captured, then the sum as one weighted product per layer, "
           "&Sigma;<sub>i</sub> c<sub>i</sub> g<sub>i</sub> = G<sup>T</sup> diag(c) A with c<sub>i</sub> = "
           "min(1, C / ||g<sub>i</sub>||): never the (B, P) matrix.")
HOW = {"rule": "closed-form rule", "call": "rule on the layer's call (its own forward, captured)",
       "fallback": "per-layer fallback (vmap / loop over this layer only)"}
# Figures come in pairs that sit side by side where the page is wide enough (a 1400 px dashboard: each pair at
# most about 13.9 in = 1330 px) and wrap onto two lines where it is not (JupyterLab with its side bar open).
WIDTHS = {"bars": 6.3, "runtime": 7.0, "heatmap": 7.4, "rule": 6.9, "clip": 6.5, "tokens": 6.3}  # inches


def images_figure(view: View, spec: ModelSpec) -> Figure | None:
    """The sample panel: the input (an image, or the tokens) with its first layer's gradients."""
    s, sv = view.setting, view.sample
    if sv.first_layer is not None and sv.first_layer.dim() == 3:
        image = sv.image if sv.kind == "image" else None
        shape = None
        if image is not None and image.numel() != sv.first_layer[0].numel():
            side = int(image.numel() ** 0.5)
            shape = (side, side) if image.dim() <= 1 or image.numel() == side * side else tuple(image.shape[-2:])
            if image.dim() == 3 and image.shape[0] == 3:
                image = image.mean(0)  # a colour image in grey
                shape = tuple(image.shape)
        return viz.first_layer_images(
            sv.first_layer, image=image, titles=list(sv.first_layer_titles), image_shape=shape,
            ncols=5 if s.quantity == "grads" else 6, cell=1.15 if s.quantity == "grads" else 0.95,
            image_title=f"input ({sv.label})", suptitle=sv.first_layer_title)
    matrix = sv.first_layer if sv.first_layer is not None else view.grads[sv.index:sv.index + 1, :2000]
    tokens = sv.image if sv.kind == "tokens" else None
    title = sv.first_layer_title + (f" ({TOKENS_NOTE})" if tokens is not None and spec.max_batch is None else "")
    rows = list(sv.first_layer_titles) if sv.first_layer is not None else []
    matrix_title = ("the gradient of the first layer's weight" if s.quantity == "grads"
                    else "sensitivity of each output")
    if sv.kind == "image" and sv.image is not None:  # an image into a layer whose rows are no images (a ViT's)
        return image_matrix_figure(sv.image, matrix, row_labels=rows, title=title, image_title=f"input ({sv.label})",
                                   matrix_title=matrix_title, width=WIDTHS["tokens"])
    return viz.token_figure(tokens, matrix, grid=spec.token_grid, row_labels=rows, title=title,
                              width=WIDTHS["tokens"], xlabel="embedding dimension" if tokens is not None
                              and s.quantity == "grads" else "",
                              matrix_title=matrix_title)


def image_matrix_figure(image: object, matrix: object, *, row_labels: Sequence[str] = (), title: str = "",
                        image_title: str = "input", matrix_title: str = "", width: float = 6.3) -> Figure:
    """The sample's image (left, in grey; (H, W), (1, H, W), (3, H, W) or a square number of pixels) next to a
    (R, C) matrix about it (right, diverging colours around 0): a first layer whose weight's rows are no images."""
    img = to_numpy(image).astype(float)
    if img.ndim == 3:
        img = img.mean(0)  # one channel, or a colour image in grey
    elif img.ndim <= 1:
        side = int(img.size ** 0.5)
        img = img.reshape(side, -1)
    m = to_numpy(matrix)
    head = fit_text(title, width - 0.3) if title else ""
    head_in = 0.21 * (head.count("\n") + 1) + 0.1 if head else 0
    side = 2.2
    height = head_in + 0.55 + side + 0.5
    fig = Figure(figsize=(width, height))
    ax_i = axes_at_inches(fig, 0.3, 0.55, side * min(1.0, img.shape[1] / img.shape[0]), side)
    ax_i.imshow(img, cmap="gray", interpolation="nearest")
    ax_i.set_xticks([])
    ax_i.set_yticks([])
    ax_i.set_title(image_title, fontsize="small", y=TITLE_Y)
    labelled = 0 < len(row_labels) == m.shape[0] and m.shape[0] <= 40
    left = 0.3 + side + 0.3 + (text_width_in(row_labels, "x-small") + 0.15 if labelled else 0.35)
    ax_m = axes_at_inches(fig, left, 0.55, width - left - 0.95, side)
    limit = float(abs(m).max()) or 1.0
    shown = ax_m.imshow(m, cmap=DIVERGING, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    if labelled:
        ax_m.set_yticks(range(m.shape[0]), list(row_labels), fontsize="x-small")
    ax_m.tick_params(labelsize="x-small")
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax_m.set_title(matrix_title, fontsize="small", y=TITLE_Y)
    fig.colorbar(shown, cax=axes_at_inches(fig, width - 0.8, 0.55, 0.12, side)).ax.tick_params(labelsize="x-small")
    if head:
        fig.suptitle(head, fontsize="medium", y=1 - 0.06 / height, va="top")
    return fig


def rule_figure(view: View) -> Figure:
    s, rule, sv = view.setting, view.sample.rule, view.sample
    where = f"sample {sv.index} ({sv.label}) at {s.describe()}"
    if rule.a is not None and rule.a.numel() == 784:  # the tutorial's picture: the input is an image
        return viz.outer_product_figure(rule.a, rule.g, gradient_norm=rule.gradient_norm, width=WIDTHS["rule"],
                                          title=f"{where}: {rule.layer}.weight's per-sample gradient is g_i a_i^T")
    return viz.factor_figure(rule.left, rule.right, rule.product, names=rule.names,
                               gradient_norm=rule.gradient_norm, difference=rule.difference, width=WIDTHS["rule"],
                               title=f"{where}: {rule.layer}.weight's per-sample gradient is {rule.names[2]}")


def heatmap_figure(view: View) -> Figure:
    s, i = view.setting, view.sample.index
    bounds = display_bounds(view.boundaries)
    title = f"per-sample gradients at {s.describe()}: B={s.batch} x P={view.grads.shape[1]:,} (sample {i} marked)"
    width = WIDTHS["heatmap"]
    if view.sample.jacobian is None:
        return viz.gradient_heatmap(view.grads, bounds, figsize=(width, 3.4), title=title,
                                      highlight_row=i, max_cols=560)
    fig = Figure(figsize=(width, 6.4))  # margins in inches, no layout engine (it would double the drawing time)
    top, bottom = fig.subplots(2, 1, height_ratios=[1.2, 1])
    fig.subplots_adjust(left=1.0 / width, right=1 - 0.9 / width, top=1 - 0.62 / 6.4, bottom=1.1 / 6.4,
                        hspace=0.8)
    names = view.sample.first_layer_titles
    viz.gradient_heatmap(view.grads, bounds, ax=top, title=viz.fit_text(title, width - 1.9),
                           highlight_row=i, max_cols=560)
    viz.gradient_heatmap(view.sample.jacobian, bounds, ax=bottom, ylabel="output", row_labels=names,
                           max_cols=560, title=f"output Jacobian of sample {i} ({view.sample.label}): "
                                               f"Y={view.sample.jacobian.shape[0]} x P")
    return fig


def rule_html(rule: RuleView) -> str:
    """The text above the fast rule's figure (or why there is none)."""
    return (f"<div style='max-width:640px;line-height:1.4'>{RULE_TEXT[rule.kind]} Here: "
            f"<code>{html.escape(rule.layer)}</code>, the first layer with such a rule.</div>"
            if rule.kind else
            f"<div style='max-width:640px;line-height:1.4;color:#8a5300'>{html.escape(rule.note)}</div>")


def layers_html(view: View) -> str:
    """The table of which rule computes each layer."""
    rows = "".join(f"<tr><td style='padding:1px 8px'><code>{html.escape(name)}</code></td>"
                   f"<td style='padding:1px 8px'>{html.escape(kind)}</td>"
                   f"<td style='padding:1px 8px;{'color:#8a5300' if how == 'fallback' else ''}' "
                   f"data-how='{how}'>{html.escape(HOW.get(how, how))}</td></tr>"
                   for name, kind, how in view.layers)
    return ("<table class='pergrad-layers' style='border-collapse:collapse;font-size:12px'>"
            "<thead><tr><th style='text-align:left;padding:1px 8px'>layer</th>"
            "<th style='text-align:left;padding:1px 8px'>type</th>"
            "<th style='text-align:left;padding:1px 8px'>per-sample gradients by</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>")


def status_html(view: View) -> str:
    """The verdict line and the notes."""
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
            kind = "noisy" if note.startswith("noisy") else "failed" if note.startswith("failed") else "skipped"
            lines.append(f"<div class='pergrad-note' data-kind='{kind}' style='color:#8a5300'>"
                         f"⚠ {html.escape(note)}</div>")
    return "".join(lines)


def progress_html(state: str, setting: Setting, text: str) -> str:
    """The progress line: ``data-state`` busy / measuring (all is shown; the slow baselines' rows are coming) /
    done / error, ``data-setting`` the setting it is about."""
    icon = {"busy": "⏳", "measuring": "✓ ⏳", "done": "✓", "error": "⚠"}[state]
    color = {"busy": "#a15c00", "measuring": "#1b7f3b", "done": "#1b7f3b", "error": "#c62828"}[state]
    return (f"<span class='pergrad-progress' data-state='{state}' "
            f"data-setting='{setting.model} B={setting.batch} hidden={setting.hidden} "
            f"{setting.quantity}' "
            f"style='color:{color}'>{icon} {html.escape(text)}</span>")


def error_html(setting: Setting, exc: Exception, shown: str) -> str:
    """The error box: what could not be computed at ``setting``, and that the figures are from ``shown``."""
    where = setting.describe()
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if "randomness='different'" in message:  # an option of the package's calls, not of the explorer's
        message += ("\n(The explorer has no randomness option: call model.eval() on your network before you open "
                    "the explorer on it.)")
    return (
        "<div class='pergrad-error' style='border-left:4px solid #c62828;background:#fdecea;padding:6px 10px;"
        "margin:4px 0'>"
        f"<b>Could not compute {html.escape(QUANTITY_NAMES[setting.quantity])} at {html.escape(where)}.</b><br>"
        f"<code style='white-space:pre-wrap'>{html.escape(message)}</code><br>"
        f"The figures below are from the previous setting ({html.escape(shown)}); choose another setting to "
        "continue.</div>")


TABLE_COLUMNS = ("method", "median", "IQR", "vs loop", "vs fwd+bwd", "vs floor", "result", "max |diff| vs loop",
                 "note")


def table_row(r: Record) -> tuple[str, ...]:
    def ratio(x: float | None) -> str:
        return "-" if x is None else viz.fmt_ratio(x)

    return (r.strategy, "-" if r.median_s is None else viz.fmt_seconds(r.median_s),
            "-" if r.iqr_s is None else viz.fmt_seconds(r.iqr_s), ratio(r.speedup_vs_loop),
            ratio(r.vs_forward_backward), ratio(r.vs_memory_floor), human_bytes(r.result_bytes),
            "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}", r.note)


def table_html(view: View) -> str:
    """The records of one setting as an HTML table, its caption a paragraph above it (full width)."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = []
    provisional = set(view.provisional)
    for r in view.records:
        grey = r.strategy in viz.REFERENCES or r.skipped or r.strategy in provisional
        style = "color:#8a5300" if r.noisy else ("color:#777" if grey else "")
        cells = "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in table_row(r))
        body.append(f"<tr style='{style}'>{cells}</tr>")
    for name in view.pending:  # rows still coming: marked, so that nobody reads the table as complete
        body.append(f"<tr class='pergrad-coming' data-method='{html.escape(name)}' style='color:#777;"
                    f"font-style:italic'><td style='padding:2px 8px'>{html.escape(name)}</td>"
                    f"<td style='padding:2px 8px' colspan='{len(TABLE_COLUMNS) - 1}'>being timed …</td></tr>")
    s = view.setting
    v = view.verdict
    checked = "" if v is None else (f"all {v.samples} samples" if v.samples == v.batch
                                    else f"{v.samples} of {v.batch} samples, spread evenly over the batch")
    caption = (f"{QUANTITY_NAMES[s.quantity]} at {s.describe()}. median: time per call over interleaved rounds "
               "(more rounds where they varied); IQR: the spread of the rounds; vs loop: speed-up over the loop; "
               "vs fwd+bwd, vs floor: time over one forward+backward of the batch and over writing the result once; "
               "each ratio from times of the same rounds (fast and slow methods are timed in separate rounds, each "
               "against its own forward+backward), so it can differ from the ratio of two medians shown when the "
               "machine's load changed between them; max |diff| vs loop: the largest difference from the loop (the "
               "definition)"
               + (f" on {checked}" if checked else "") + ".")
    return (f"<div style='font-size:12px;max-width:1100px;margin:2px 0 4px 0'>{html.escape(caption)}</div>"
            f"<table style='border-collapse:collapse;font-size:12px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def display_bounds(bounds: Sequence[tuple[str, int, int]], most: int = 6) -> list[tuple[str, int, int]]:
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
    return list(zip(short_names([n for n, _, _ in merged]), [a for _, a, _ in merged], [b for _, _, b in merged],
                    strict=True))


WRAPPERS = frozenset({"default", "modules_to_save", "original_module"})
"""Parts of a parameter's name that name no layer: peft's adapter name and the wrapper of a trained head."""


def short_names(names: Sequence[str]) -> list[str]:
    """Layer names as labels: the last two parts (``layers.0.linear1`` -> ``0.linear1``), more where two would name
    another layer too (peft's adapters: ``...layers.0.attention.q_proj.lora_A.default`` -> ``0.attention.q_proj.
    lora_A``), without the parts that name no layer (:data:`WRAPPERS`)."""
    parts = [[p for p in n.split(".") if p not in WRAPPERS] or n.split(".") for n in names]
    shown = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i]
        keep = next((k for k in range(2, len(mine) + 1) if all(p[-k:] != mine[-k:] for p in others)), None)
        shown.append(".".join(mine[-keep:]) if keep is not None else names[i])
    return shown


def runtime_title(view: View) -> str:
    """The scaling curve's title; while the slow baselines are still being timed, it says so (their lines come)."""
    s = view.setting
    title = f"time vs batch size, {width_text(s)} (dotted: B={s.batch})"
    if view.stage != "measuring":
        return title
    return f"{title}; still timing the slower methods{': ' + ', '.join(view.pending) if view.pending else ''}"


def width_text(s: Setting) -> str:
    return s.describe().split(", ", 1)[1] if s.model != "mlp" else f"at hidden width {s.hidden}"
