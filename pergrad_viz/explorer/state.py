"""The explorer's plain records: what goes in (:class:`Setting`), what comes out (:class:`View` and its parts:
:class:`Verdict`, :class:`SampleView` with its :class:`RuleView`, :class:`ClipView`), what one setting computed
(:class:`Computed`) and what a timing depends on (:class:`TimingKey`). No computation here; no ipywidgets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR, Record
from pergrad_viz.explorer.specs import describe_width
from pergrad_viz.strategies import STRATEGIES

__all__ = ["ANCHOR", "QUANTITIES", "QUANTITY_NAMES", "REFERENCES", "Budget", "ClipView", "Computed", "RuleView",
           "SampleView", "Setting", "Stale", "TimingKey", "Verdict", "View", "Visit"]

QUANTITIES = ("grads", "jacobian")
QUANTITY_NAMES = {"grads": "per-sample gradients", "jacobian": "output Jacobian"}
REFERENCES = (FORWARD_BACKWARD, MEMORY_FLOOR)
ANCHOR = FORWARD_BACKWARD  # timed in every tier: ratios within a tier, drift between tiers


class Stale(Exception):
    """Raised by a ``check`` callback to abandon work for a setting that is no longer wanted."""


@dataclass(frozen=True)
class Setting:
    """What the controls say. ``model, quantity, batch, hidden`` decide the computation and the timings (``model``:
    a key of the explorer's specs; ``hidden``: the network's width); ``strategies`` which methods are timed,
    ``slow_limit`` which of them are skipped as too slow (None: the model's default); ``sample`` and ``clip`` only
    the sample panels and the DP-SGD view."""

    batch: int = 32
    hidden: int = 20
    quantity: str = "grads"
    strategies: tuple[str, ...] = STRATEGIES
    sample: int = 0
    clip: float = 20.0
    slow_limit: int | None = None
    model: str = "mlp"

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model, self.quantity, self.batch, self.hidden)

    def describe(self) -> str:
        """``"batch size B=32, hidden width 20"`` (``"batch size B=32, LSTM, hidden size 32"`` ...): how every title
        and line names the setting."""
        return f"batch size B={self.batch}, {describe_width(self.model, self.hidden)}"

    @property
    def short(self) -> str:
        if self.model == "mlp":
            return f"B={self.batch}, hidden {self.hidden}"
        return f"B={self.batch}, {describe_width(self.model, self.hidden)}"


@dataclass(frozen=True)
class Verdict:
    """Whether the results shown agree with the loop (the definition) at the setting, on ``samples`` of the
    ``batch`` samples (all of them up to a limit, else evenly spread over the batch).

    ``checked``: the strategies compared so far (the heatmap's first); ``failed``: those beyond ``tolerance``;
    ``max_abs_diff``: the largest difference of any of them; ``text``: one line saying all that."""

    ok: bool
    max_abs_diff: float
    tolerance: float
    samples: int
    batch: int
    text: str
    checked: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuleView:
    """How the fast rule gives the chosen sample's gradient of one layer's weight in closed form, as a product of
    two factors that one forward and one backward pass of the whole batch provide.

    ``kind``: ``"linear"`` (g a^T: the backprop signal g at the layer's output times its input a, summed over
    positions where the input has them), ``"conv"`` (G U^T: G (C_out, L) the signal at each output position, U
    (C_in k k, L) the unfolded input patches), ``"embedding"`` (O^T G: O (T, V) the one-hot rows of the sample's
    tokens, G (T, d) the signal at each token: only the rows of the used tokens are non-zero), or None (``note``
    says why no panel is drawn).

    Shapes: left (m, k), right (k, n), product (m, n) = left @ right = the weight's gradient (flattened to 2-D);
    a (in,) and g (out,): the Linear case on a vector input (the tutorial MLP), else None.
    ``gradient_norm``: ||the weight's per-sample gradient|| from per_sample_grads; ``difference``: max |product -
    that gradient| (the rule checked on the numbers).
    """

    layer: str
    kind: str | None
    note: str = ""
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    product: torch.Tensor | None = None
    names: tuple[str, str, str] = ("", "", "")
    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    gradient_norm: float = math.nan
    difference: float = math.nan


@dataclass(frozen=True)
class SampleView:
    """The chosen sample i: its input, its first-layer gradients as small images and the fast rule's parts.

    ``kind``: ``"image"`` (image: (784,) or (C, H, W)), ``"tokens"`` (image: the (T,) token ids) or ``"other"``
    (image None). first_layer: (K, h, w) images of the first rule layer's weight gradient (rows of a Linear as
    28x28 images, a convolution's kernels), (K, n) rows otherwise, or None; jacobian (Y, P) or None.
    """

    index: int
    label: str
    image: torch.Tensor | None
    first_layer: torch.Tensor | None
    first_layer_titles: tuple[str, ...]
    first_layer_title: str
    jacobian: torch.Tensor | None
    rule: RuleView
    kind: str = "image"

    @property
    def a(self) -> torch.Tensor | None:
        return self.rule.a

    @property
    def g(self) -> torch.Tensor | None:
        return self.rule.g

    @property
    def gradient_norm(self) -> float:
        return self.rule.gradient_norm


@dataclass(frozen=True)
class ClipView:
    """Per-sample gradient norms and clipping at ``max_norm`` (the DP-SGD view). Shapes: total (B,),
    layers {layer: (B,)}."""

    max_norm: float
    total: torch.Tensor
    layers: dict[str, torch.Tensor]
    clipped: int
    plain_sum_norm: float
    clipped_sum_norm: float

    @property
    def fraction_clipped(self) -> float:
        return self.clipped / max(1, self.total.numel())


@dataclass(frozen=True)
class View:
    """Everything the front end shows for one setting, at one stage.

    Attributes:
        setting: the setting every array and record here belongs to.
        stage: ``"gradients"``, ``"timing"``, ``"measuring"`` (:attr:`shown`: every figure is this setting's and
            final, the timed rows too; the slow baselines' rows are still being timed, in ``pending``) or
            ``"done"``.
        grads: (B, P) per-sample gradients of the loss (MSE, reduction='sum'); boundaries: the layers' columns.
        labels: (B,) class of each sample. verdict: hooks vs torch_func (None in the very first view, drawn
        before they are compared). sample, clipping: the panels.
        records: the current setting's records so far (cheapest tier first, skipped ones last).
        pending: methods still to be timed. scaling_records: every record of the scaling curve (at "done").
        provisional: methods whose numbers are from the first rounds, more being measured (not a warning).
        noisy: methods whose timing was noisy (not cached: rerun). notes: lines to show (skips, noise).
        reused: records taken from the cache. layers: which layer runs on which rule or on the per-layer
        fallback (``pergrad_viz.strategies.hooks.describe``): (layer, module type, ``"rule"`` | ``"call"`` |
        ``"fallback"``) in the model's order.
    """

    setting: Setting
    stage: str
    grads: torch.Tensor
    boundaries: list[tuple[str, int, int]]
    labels: torch.Tensor
    verdict: Verdict | None
    sample: SampleView
    clipping: ClipView
    records: tuple[Record, ...] = ()
    pending: tuple[str, ...] = ()
    scaling_records: tuple[Record, ...] = ()
    provisional: tuple[str, ...] = ()
    noisy: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    reused: int = 0
    scaling_pending: tuple[int, ...] = field(default=())
    layers: tuple[tuple[str, str, str], ...] = ()  # (layer, module type, how: rule / call rule / fallback)

    @property
    def done(self) -> bool:
        return self.stage == "done"

    @property
    def shown(self) -> bool:
        """Whether the view is shown in full: done, or measuring (only the slow baselines' rows are still coming,
        marked as such)."""
        return self.stage in ("measuring", "done")

    @property
    def progress(self) -> str:
        """One line: ``"timed 3 of 7 methods at batch size B=64, hidden width 20"``, then what is left."""
        timed = sum(1 for r in self.records if not r.skipped)
        total = timed + len(self.pending)
        skipped = sum(1 for r in self.records if r.skipped)
        line = f"timed {timed} of {total} methods at {self.setting.describe()}"
        if skipped:
            line += f" ({skipped} skipped as too slow)"
        if self.reused:
            line += f"; {self.reused} reused from earlier"
        if self.stage == "done":
            return "done: " + line
        batches = f"B={', '.join(map(str, self.scaling_pending))}"
        if self.stage == "measuring":  # the rest is shown: the slow baselines' rows are coming
            where = ", ".join(self.pending) if self.pending else f"at {batches} (the scaling curve)"
            return f"shown; {line}; still timing the slower methods {where} …"
        if not self.pending and self.scaling_pending:
            line += f"; scaling curve at {batches}"
        return line + " …"


@dataclass
class Computed:
    """What one setting (model, quantity, batch, width) computed once: kept for sample and clip changes, and the
    reference every timed method is compared with."""

    model: nn.Module
    loss_fn: nn.Module
    x: object  # the inputs, as per_sample_grads takes them (B first)
    y: object
    labels: torch.Tensor
    grads: torch.Tensor  # (B, P)
    boundaries: list[tuple[str, int, int]]
    total: torch.Tensor  # (B,)
    layers: dict[str, torch.Tensor]  # {layer: (B,)}
    verdict: Verdict | None
    checked: torch.Tensor | None = None  # (n,) the samples compared with the loop
    reference: torch.Tensor | None = None  # (n, P) or (n, Y * P): the loop's result on them, for max |diff|
    reference_scale: float | None = None  # max |reference|: the scale of the verdict's tolerance (read once)
    hooks_s: float | None = None  # how long the hooks call for ``grads`` took
    # methods timed before the loop ran (a large result: its verdict comes after the figures): {method: its rows of
    # the checked samples, None where they are the heatmap's}, their differences from the loop still to be taken
    unchecked: dict[str, torch.Tensor | None] | None = None
    how: tuple[tuple[str, str, str], ...] = ()  # (layer, type, rule / call / fallback)
    output: Callable[[object], torch.Tensor] | None = None  # the network's output tensor (ModelSpec.output)
    weights: tuple = ()  # the network's state when computed (a user's network trained or changed since: again)


def weights_version(model: nn.Module) -> tuple:
    """What a user's training or changes move: the parameters' version counters and ``requires_grad`` (an optimiser's
    step, ``load_state_dict``, a frozen layer), the buffers' (running statistics) and the modules' training flags."""
    return (tuple((id(p), p._version, p.requires_grad) for p in model.parameters()),
            tuple((id(b), b._version) for b in model.buffers()), tuple(m.training for m in model.modules()))


@dataclass
class Budget:
    """The seconds of extra timing rounds left for one setting (its phases share them)."""

    left_s: float


@dataclass
class Visit:
    """What one visit of a setting has timed so far, phase by phase (the fast strategies first, the slow baselines
    next), by batch size (the setting's and the scaling curve's smaller ones): the records, how many of them came
    from the cache, the extra rounds' budget left; and the smaller batches' gradients (computed once)."""

    records: dict[int, list[Record]] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    budgets: dict[int, Budget] = field(default_factory=dict)
    subs: dict[int, Computed] = field(default_factory=dict)


@dataclass(frozen=True)
class TimingKey:
    """Everything a timing depends on."""

    model: str
    quantity: str
    batch: int
    hidden: int
    method: str
    dtype: str
    device: str
    threads: int

