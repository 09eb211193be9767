"""The explorer's model: pure and widget-free. A :class:`Setting` goes in, :class:`View` s come out.

>>> from pergrad_viz.explorer.model import ExplorerModel, Setting
>>> model = ExplorerModel()
>>> view = model.update(Setting(batch=32, hidden=20))     # everything at this setting, timed
>>> view.verdict.ok, [r.strategy for r in view.records], view.grads.shape    # True, [...], (32, P)
>>> view = model.update(Setting(model="lstm", batch=16, hidden=32))     # another network of the menu

The network is described by a :class:`~.specs.ModelSpec` (how to build it at a width, its inputs, what a sample
looks like, its first layer with a closed-form rule): the built-in menu (:data:`~.specs.MENU`: the tutorial MLP, a
small CNN, a transformer encoder, an LSTM classifier) or a user's own network and data (:func:`~.specs.user_spec`).
``Setting.hidden`` is the network's width (hidden units, channels, d_model, hidden size).

:meth:`ExplorerModel.stages` yields the views progressively, as a responsive front end wants them:

1. ``"gradients"``: everything that needs one call at the setting: the (B, P) per-sample gradients (the
   heatmap), the chosen sample's first-layer gradients and the fast rule's parts (a_i, g_i), the norms for the
   DP-SGD view; then (a second view) the verdict: the heatmap's gradients against the loop (the definition,
   written out here: ``torch.autograd.grad`` of each checked sample's loss, run alone);
2. ``"timing"``: per tier of methods timed (cheapest first; methods of a tier interleaved in rounds with
   ``forward+backward`` as the anchor), the records so far: first *provisional* (the first pass of rounds) where
   a median is still uncertain, then settled after more rounds (:func:`pergrad_viz.bench.timing.time_adaptive`); every
   strategy's result is compared with the loop on the checked samples (its ``max |diff|``, and the verdict);
3. ``"done"``: the scaling curve's records (the smaller batch sizes) too.

Timings are cached by everything that affects them (quantity, batch size, hidden width, method, dtype, device,
threads); a noisy one (its median still uncertain after the extra rounds, or the anchor drifted between tiers)
is flagged (``Record.noisy``) and never cached. The model knows nothing of ipywidgets (``explorer/view.py`` maps
controls to settings and views to images).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pergrad_viz import bench
from pergrad_viz.api import per_sample_grads, per_sample_jacobian, resolve_strategy
from pergrad_viz.bench import timing
from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.memory import check_held, result_bytes
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.errors import human_bytes
from pergrad_viz.explorer.specs import MENU, ModelSpec, describe_width
from pergrad_viz.strategies import STRATEGIES
from pergrad_viz.strategies.hooks import describe as describe_layers

__all__ = ["ClipView", "ExplorerModel", "RuleView", "SampleView", "Setting", "Stale", "Verdict", "View"]

QUANTITIES = ("grads", "jacobian")
QUANTITY_NAMES = {"grads": "per-sample gradients", "jacobian": "output Jacobian"}
MAX_IMAGES = 9  # hidden units shown as images for a per-sample gradient
REFERENCES = (bench.FORWARD_BACKWARD, bench.MEMORY_FLOOR)
ANCHOR = bench.FORWARD_BACKWARD  # timed in every tier: ratios within a tier, drift between tiers


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
        stage: ``"gradients"``, ``"timing"`` or ``"done"``.
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
    records: tuple[bench.Record, ...] = ()
    pending: tuple[str, ...] = ()
    scaling_records: tuple[bench.Record, ...] = ()
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
        if not self.pending and self.scaling_pending:
            line += f"; scaling curve at B={', '.join(map(str, self.scaling_pending))}"
        return line + " …"


@dataclass
class _Data:
    """What one (quantity, batch, hidden) computed once: kept for sample and clip changes."""

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
    hooks_s: float | None = None  # how long the hooks call for ``grads`` took
    how: tuple[tuple[str, str, str], ...] = ()  # (layer, type, rule / call / fallback)


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


class ExplorerModel:
    """The explorer's computations for the networks of ``models`` (default the built-in menu, the tutorial
    ``MLP(784, hidden, 10)`` first; each with its loss, MSE ``reduction='sum'`` for the menu's).

    Args:
        models: {key: :class:`~.specs.ModelSpec`}; ``Setting.model`` picks one.
        batch_options: the batch sizes of the slider (the scaling curve picks among those up to the current).
        slow_limit: the slow baselines are skipped (with a note) above this many sample-backward passes per
            call (see :func:`pergrad_viz.bench.sweeps.backward_work`).
        rounds, min_rounds: rounds of a tier's first pass (:func:`pergrad_viz.bench.timing.time_adaptive`): ``rounds``,
            fewer (down to ``min_rounds``) where they would take more than ``tier_budget_s`` seconds.
        max_rounds, patience_s: while a median is uncertain, more rounds are timed, up to ``max_rounds`` per tier
            and about ``patience_s`` seconds per setting in all (half that for each of the scaling curve's smaller
            batches); the first numbers are shown meanwhile, as provisional.
        round_budget_s: one round of a tier costs about this much (cheap methods share a tier; a costly one gets
            its own). prior_min_s: a first call at least this long counts as a round.
        min_block_s: a timed block lasts at least this long (many calls of a fast method).
        noise_threshold: a median is settled when the half-width of its 95% confidence interval is at most this
            fraction of it (:attr:`pergrad_viz.bench.timing.Timing.uncertainty`); still above after the extra rounds:
            noisy. drift: the anchor's median may move by this factor between tiers before the later tier counts
            as noisy.
        sweep_batches: batch sizes on the scaling curve (up to the current one).
        threads: intra-op threads while computing (default: one core left free, see
            :func:`pergrad_viz.bench.timing.headroom_threads`).
        verdict_samples, verdict_samples_jacobian: the results are compared with the loop on all samples up to
            this many (for gradients / for Jacobians), else on this many spread evenly over the batch.
    """

    def __init__(self, *, batch_options: Sequence[int] = tuple(2**k for k in range(9)), slow_limit: int = 1024,
                 rounds: int = 5, min_rounds: int = 3, max_rounds: int = 15, patience_s: float = 1.0,
                 tier_budget_s: float = 1.0, round_budget_s: float = 0.05, prior_min_s: float = 0.1,
                 min_block_s: float = timing.MIN_BLOCK_S, noise_threshold: float = 0.15, drift: float = 1.5,
                 sweep_batches: int = 3, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 threads: int | None = None, verdict_samples: int = 64, verdict_samples_jacobian: int = 8,
                 models: dict[str, ModelSpec] | None = None):
        self.models = dict(MENU if models is None else models)
        if not self.models:
            raise ValueError("models is empty: pass at least one ModelSpec")
        self._outputs: dict[str, int] = {}
        self.batch_options = tuple(sorted(batch_options))
        self.slow_limit = slow_limit
        self.rounds = rounds
        self.min_rounds = min(min_rounds, rounds)
        self.max_rounds = max(max_rounds, rounds)
        self.patience_s = patience_s
        self.tier_budget_s = tier_budget_s
        self.round_budget_s = round_budget_s
        self.prior_min_s = prior_min_s
        self.min_block_s = min_block_s
        self.noise_threshold = noise_threshold
        self.drift = drift
        self.sweep_batches = sweep_batches
        self.device = device
        self.dtype = dtype
        self.threads = threads if threads is not None else timing.headroom_threads()
        self.verdict_samples = verdict_samples
        self.verdict_samples_jacobian = verdict_samples_jacobian
        self.cache: dict[TimingKey, bench.Record] = {}
        self._data: dict[tuple[str, str, int, int], _Data] = {}  # the latest setting's only: bounded memory

    # ------------------------------------------------------------------------------------------ checks

    def check(self, setting: Setting) -> None:
        """Refuse a setting that is malformed or would not fit in memory, before allocating anything."""
        if setting.quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {QUANTITIES}, got {setting.quantity!r}")
        spec = self.spec(setting)
        if setting.batch < 1 or (setting.hidden < 1 and spec.width_name):
            raise ValueError(f"batch size and width must be positive, got {setting.batch}, {setting.hidden}")
        if spec.max_batch is not None and setting.batch > spec.max_batch:
            raise ValueError(f"batch size {setting.batch} is more than the {spec.max_batch} samples of the data")
        unknown = [s for s in setting.strategies if s != "auto" and s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
        if not (setting.clip > 0 and math.isfinite(setting.clip)):
            raise ValueError(f"the clipping threshold must be a positive number, got {setting.clip!r}")
        if setting.slow_limit is not None and setting.slow_limit < 0:
            raise ValueError(f"slow_limit must be a number of sample-backward passes >= 0, got {setting.slow_limit}")
        p = spec.num_params(setting.hidden)
        grads = result_bytes(setting.batch, p, self.dtype)
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        one = result_bytes(setting.batch, p, self.dtype, outputs)
        # the heatmap's (B, P) gradients, plus while timing: the reference result, a fresh one, a working copy
        held = grads + 3 * one
        check_held(what=f"the explorer at {setting.describe()} ({QUANTITY_NAMES[setting.quantity]})", held=held,
                   detail=f"the {human_bytes(grads)} gradients of the heatmap and three copies of the "
                          f"{human_bytes(one)} result while timing",
                   fix="Choose a smaller batch size or width, or the per-sample gradients instead of the "
                       "Jacobian.", device=torch.device(self.device))

    def spec(self, setting: Setting) -> ModelSpec:
        """The network ``setting.model`` names."""
        if setting.model not in self.models:
            raise ValueError(f"unknown model {setting.model!r}; this explorer has {', '.join(self.models)}")
        return self.models[setting.model]

    def outputs(self, setting: Setting) -> int:
        """Y, the outputs of one sample (10 for the menu's networks; a user's network: from one forward of one
        sample, without gradients)."""
        key = setting.model
        if key not in self._outputs:
            spec = self.spec(setting)
            if spec.max_batch is None:
                self._outputs[key] = 10
            else:
                model, _, x, _, _ = spec.problem(1, setting.hidden)
                with torch.no_grad():
                    out = Batch.of(x)(model)
                self._outputs[key] = int(out.numel()) if isinstance(out, torch.Tensor) else 1
        return self._outputs[key]

    def problem(self, setting: Setting) -> tuple[nn.Module, nn.Module, object, object, torch.Tensor]:
        """(model, loss_fn, inputs, targets, labels) at ``setting``: a menu network built on the explorer's device
        and dtype; a user's network as it is."""
        spec = self.spec(setting)
        model, loss_fn, x, y, labels = spec.problem(setting.batch, setting.hidden)
        if spec.max_batch is None:
            model = model.to(device=self.device, dtype=self.dtype)
            x, y = (t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device) for t in (x, y))
        return model, loss_fn, x, y, labels

    def scaling_batches(self, batch: int) -> list[int]:
        """The batch sizes of the scaling curve: up to ``sweep_batches`` of the options up to ``batch``, evenly
        spread on a log scale, always ending with ``batch``."""
        options = sorted(b for b in self.batch_options if b <= batch) or [batch]
        n = min(self.sweep_batches, len(options))
        if n <= 1:
            return [batch]
        picks = {options[round(k * (len(options) - 1) / (n - 1))] for k in range(n)}
        return sorted(picks | {batch})

    # ------------------------------------------------------------------------------------------ stages

    def update(self, setting: Setting) -> View:
        """Everything at ``setting``, timed: the last of :meth:`stages`."""
        *_, last = self.stages(setting)
        return last

    def stages(self, setting: Setting, check: Callable[[], None] | None = None) -> Iterator[View]:
        """Views of ``setting``, progressively: ``"gradients"`` first, a ``"timing"`` view per tier of methods
        timed, ``"done"`` last. ``check`` is called between steps (and between timed blocks): raise
        :class:`Stale` from it to abandon the setting."""
        poll = check or (lambda: None)
        self.check(setting)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            data = self._gradients(setting)
            view = View(setting, "gradients", data.grads, data.boundaries, data.labels, data.verdict,
                        self._sample(setting, data), self._clipping(setting, data),
                        pending=tuple(self._methods(setting)), layers=data.how)
            yield view
            poll()
            if data.verdict is None:
                data.verdict = self._verdict(setting, data)
                view = dataclasses.replace(view, verdict=data.verdict)
                yield view
                poll()
            records: list[bench.Record] = []
            for records, pending, reused, provisional in self._time_setting(setting, data, poll):
                view = self._with_records(view, data, records, pending, reused, provisional, stage="timing")
                yield view
            scaling = self.scaling_batches(setting.batch)[:-1]
            others: list[bench.Record] = []
            for k, b in enumerate(scaling):
                view = dataclasses.replace(view, scaling_pending=tuple(scaling[k:]))
                yield view
                poll()
                sub = dataclasses.replace(setting, batch=b)
                *_, (last, *_rest) = self._time_setting(sub, self._gradients(sub, keep=False), poll,
                                                         rounds=self.min_rounds)
                others += last
            view = dataclasses.replace(view, stage="done", scaling_pending=(),
                                       scaling_records=tuple(sorted([*others, *records], key=lambda r: r.batch_size)))
            view = dataclasses.replace(view, noisy=_noisy(view.scaling_records))
            yield view
        finally:
            torch.set_num_threads(previous)

    def with_sample(self, view: View, *, sample: int | None = None, clip: float | None = None) -> View:
        """``view`` with another sample or clipping threshold: no gradients computed again, nothing timed.

        Raises KeyError when the setting's data is no longer kept (then call :meth:`stages` again)."""
        setting = dataclasses.replace(view.setting, sample=view.setting.sample if sample is None else sample,
                                      clip=view.setting.clip if clip is None else clip)
        self.check(setting)
        data = self._data[setting.key]
        changes = {"setting": setting}
        if setting.sample != view.setting.sample:
            changes["sample"] = self._sample(setting, data)
        if setting.clip != view.setting.clip:
            changes["clipping"] = self._clipping(setting, data)
        return dataclasses.replace(view, **changes)

    def forget(self, setting: Setting) -> None:
        """Drop the cached timings of ``setting``'s batch sizes (the scaling curve's too): time them again."""
        batches = set(self.scaling_batches(setting.batch))
        for key in [k for k in self.cache if (k.model, k.quantity, k.hidden) == (setting.model, setting.quantity,
                                                                                  setting.hidden)
                    and k.batch in batches]:
            del self.cache[key]

    # ------------------------------------------------------------------------------------------ gradients

    def _gradients(self, setting: Setting, keep: bool = True) -> _Data:
        """The per-sample gradients at ``setting`` (the verdict comes next, see :meth:`stages`); with ``keep`` (the
        current setting) they are kept for sample and clip changes, replacing the previous setting's."""
        cached = self._data.get(setting.key)
        if cached is not None:
            return cached
        model, loss_fn, x, y, labels = self.problem(setting)
        start = time.perf_counter()
        grads = per_sample_grads(model, loss_fn, x, y, strategy="hooks", flat=True)  # (B, P)
        hooks_s = time.perf_counter() - start
        bounds = _boundaries(model)
        squares: dict[str, torch.Tensor] = {}  # {layer: (B,)} squared norms, weight and bias together
        for name, a, b in bounds:
            layer = name.rsplit(".", 1)[0]
            sq = torch.linalg.vector_norm(grads[:, a:b], dim=1).square()  # no (B, P) temporary
            squares[layer] = squares[layer] + sq if layer in squares else sq
        layers = {k: v.sqrt() for k, v in squares.items()}
        total = torch.stack(list(squares.values())).sum(0).sqrt()
        data = _Data(model, loss_fn, x, y, labels, grads, bounds, total, layers, None, hooks_s=hooks_s,
                     how=_how(model, x))
        if keep:
            self._data = {setting.key: data}
        return data

    def _checked(self, setting: Setting) -> torch.Tensor:
        """(n,) the samples compared with the loop: all of them up to the limit, else evenly spread over the batch
        (the first and the last included)."""
        most = self.verdict_samples if setting.quantity == "grads" else self.verdict_samples_jacobian
        if setting.batch <= most:
            return torch.arange(setting.batch)
        return torch.linspace(0, setting.batch - 1, most).round().long().unique()

    @staticmethod
    def _which(n: int, batch: int) -> str:
        return f"all {n} samples" if n == batch else f"{n} of {batch} samples, spread evenly over the batch,"

    def _verdict(self, setting: Setting, data: _Data) -> Verdict:
        """The heatmap's per-sample gradients (``hooks``) against the loop on the checked samples; the loop's
        result for the setting's quantity is kept as the reference of every method timed next."""
        idx = data.checked = self._checked(setting)
        loop = _loop_rows(data.model, data.loss_fn, data.x, data.y, idx, "grads")
        if setting.quantity == "grads":
            data.reference = loop
        else:
            data.reference = _loop_rows(data.model, data.loss_fn, data.x, data.y, idx, "jacobian")
        diff = float(torch.linalg.vector_norm(data.grads[idx] - loop, ord=math.inf))
        return self._judge(setting, data, {"hooks": diff}, tolerance_of=loop, quantity="grads")

    def _judge(self, setting: Setting, data: _Data, diffs: dict[str, float], *, tolerance_of: torch.Tensor,
               quantity: str, before: Verdict | None = None) -> Verdict:
        """A verdict on ``diffs`` ({strategy: max |difference| from the loop}), together with ``before``'s."""
        tolerance = 1e-4 * max(1.0, float(torch.linalg.vector_norm(tolerance_of, ord=math.inf)))
        failed = [m for m, d in diffs.items() if not d <= tolerance]  # NaN fails
        checked = list(diffs)
        worst = max(diffs.values(), default=0.0)
        if before is not None:
            checked = [*before.checked, *(m for m in checked if m not in before.checked)]
            failed = [*before.failed, *(m for m in failed if m not in before.failed)]
            worst = max(worst, before.max_abs_diff) if math.isfinite(worst) else worst
        n = int(data.checked.numel())
        dtype = str(self.dtype).removeprefix("torch.")
        what = QUANTITY_NAMES[quantity]
        where = f"{what} at {setting.describe()}"
        details = (f"max |difference| {worst:.1e} ({dtype}; {self._which(n, setting.batch)} checked against the "
                   f"loop; tolerance {tolerance:.0e})")
        if failed:
            text = f"{', '.join(failed)} DISAGREE with the loop (the definition) on the {where}: {details}"
        elif len(checked) == 1:
            text = f"{checked[0]} agrees with the loop (the definition) on the {where}: {details}"
        else:
            text = f"{', '.join(checked)} agree with the loop (the definition) on the {where}: {details}"
        return Verdict(not failed, worst, tolerance, n, setting.batch, text, tuple(checked), tuple(failed))

    def _sample(self, setting: Setting, data: _Data) -> SampleView:
        """The chosen sample ``setting.sample`` (clamped to B-1): its input, its first-layer gradients as small
        images (or rows), its output Jacobian for that quantity, and the fast rule's parts."""
        spec = self.spec(setting)
        i = max(0, min(setting.sample, setting.batch - 1))
        label = spec.label(int(data.labels[i]))
        one = Batch.of(data.x).sample(i)
        image = _drawn(one, spec.sample_kind)
        layer = spec.first_layer
        module = dict(data.model.named_modules()).get(layer) if layer is not None else None
        jac = None
        if setting.quantity == "jacobian":
            jac = per_sample_jacobian(data.model, _inputs_of(one), flat=True)[0]  # (Y, P)
        bounds = {n: (a, b) for n, a, b in data.boundaries}
        if module is None or f"{layer}.weight" not in bounds:
            rule = RuleView(layer or "-", None, note="this network has no Linear, Conv2d or Embedding layer with "
                                                     "trainable weights: no closed-form panel to draw")
            return SampleView(i, label, image, None, (), f"sample {i} ({label}) at {setting.short}", jac, rule,
                              spec.sample_kind)
        start, stop = bounds[f"{layer}.weight"]
        grad = data.grads[i, start:stop].reshape(module.weight.shape)
        rule = _rule(data, one, i, layer, module, grad)
        images, titles, title = _first_layer_panel(setting, spec, i, label, layer, grad, jac, start, stop)
        return SampleView(i, label, image, images, titles, title, jac, rule, spec.sample_kind)

    @staticmethod
    def _clipping(setting: Setting, data: _Data) -> ClipView:
        c = setting.clip
        factors = (c / data.total.clamp_min(1e-12)).clamp(max=1.0)  # (B,): DP-SGD's per-sample scale
        plain = data.grads.sum(dim=0)
        clipped_sum = factors @ data.grads  # (P,) without a (B, P) temporary
        clipped = int((data.total > c * (1 + 1e-5)).sum())
        return ClipView(c, data.total, data.layers, clipped, float(plain.norm()), float(clipped_sum.norm()))

    def _with_records(self, view: View, data: _Data, records: Sequence[bench.Record], pending: tuple[str, ...],
                      reused: int, provisional: tuple[str, ...], stage: str) -> View:
        verdict = view.verdict
        order = {name: k for k, name in enumerate(view.setting.strategies)}
        diffs = {r.strategy: r.max_abs_diff for r in sorted(records, key=lambda r: order.get(r.strategy, len(order)))
                 if r.max_abs_diff is not None and r.strategy not in REFERENCES}
        if verdict is not None and diffs and data.reference is not None:
            quantity = view.setting.quantity
            verdict = self._judge(view.setting, data, diffs, tolerance_of=data.reference, quantity=quantity,
                                  before=data.verdict if quantity == "grads" else None)
            if quantity != "grads" and not data.verdict.ok:  # the heatmap's gradients disagree: say so first
                verdict = dataclasses.replace(verdict, ok=False, text=f"{data.verdict.text}; {verdict.text}")
        return dataclasses.replace(view, stage=stage, records=tuple(records), pending=pending, reused=reused,
                                   verdict=verdict, provisional=provisional, noisy=_noisy(records),
                                   notes=_notes(view.setting, records, provisional))

    # ------------------------------------------------------------------------------------------ timing

    def _methods(self, setting: Setting) -> list[str]:
        """Methods to time (not skipped), in the order given, then the references."""
        return [s for s in setting.strategies if self._skip_note(setting, s) is None] + list(REFERENCES)

    def _skip_note(self, setting: Setting, name: str) -> str | None:
        if name in REFERENCES:
            return None
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        strategy = "hooks" if name == "auto" else name
        work = bench.backward_work(strategy, setting.quantity, setting.batch, outputs)
        limit = self.slow_limit if setting.slow_limit is None else setting.slow_limit
        if work > limit:
            return f"skipped: {work:,} sample-backward passes > slow_limit={limit:,}"
        return None

    def _key(self, setting: Setting, method: str) -> TimingKey:
        return TimingKey(setting.model, setting.quantity, setting.batch, setting.hidden, method, str(self.dtype),
                         str(self.device), self.threads)

    def _calls(self, setting: Setting, data: _Data) -> dict[str, Callable[[], object]]:
        model, loss_fn, x, y = data.model, data.loss_fn, data.x, data.y
        params = [p for p in model.parameters() if p.requires_grad]
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        p = self.spec(setting).num_params(setting.hidden)
        shape = (setting.batch, p) if outputs == 1 else (setting.batch, outputs, p)
        batch = Batch.of(x)

        def forward_backward() -> object:
            return torch.autograd.grad(loss_fn(batch(model), y), params)

        floor = torch.zeros(shape, dtype=self.dtype, device=self.device)  # its pages touched now, not when timed
        calls: dict[str, Callable[[], object]] = {bench.FORWARD_BACKWARD: forward_backward,
                                                  bench.MEMORY_FLOOR: lambda: floor.fill_(0.5)}
        for name in setting.strategies:
            if setting.quantity == "grads":
                calls[name] = (lambda s=name: per_sample_grads(model, loss_fn, x, y, strategy=s, flat=True))
            else:
                calls[name] = (lambda s=name: per_sample_jacobian(model, x, strategy=s, flat=True))
        return calls

    def _time_setting(self, setting: Setting, data: _Data, poll: Callable[[], None], rounds: int | None = None
                      ) -> Iterator[tuple[list[bench.Record], tuple[str, ...], int, tuple[str, ...]]]:
        """Time the setting's methods tier by tier; yields (records so far, methods pending, records reused,
        methods provisional). ``rounds``: a first pass of at most this many (default: the model's; the scaling
        curve's smaller batches use fewer, and fewer extra rounds)."""
        most = self.rounds if rounds is None else rounds
        methods = self._methods(setting)
        skipped = [bench.Record(s, setting.quantity, setting.batch, setting.hidden, None, None,
                                self._result_size(setting), note=note)
                   for s in setting.strategies if (note := self._skip_note(setting, s)) is not None]
        done: dict[str, bench.Record] = {}
        for name in methods:
            hit = self.cache.get(self._key(setting, name))
            if hit is not None:
                done[name] = dataclasses.replace(hit)
        reused = len(done)
        todo = [m for m in methods if m not in done]
        if not todo:
            yield _ordered(done, skipped), (), reused, ()
            return
        calls = self._calls(setting, data)
        warm = [*todo, *([ANCHOR] if ANCHOR not in todo else [])]
        estimates, diffs, prior = self._warm_up(setting, data, calls, warm, poll)
        anchor_ref: timing.Timing | None = None
        if ANCHOR in done:
            anchor_ref = timing.summarize([done[ANCHOR].median_s])
        tiers = timing.plan_tiers({m: estimates[m] for m in todo}, round_budget_s=self.round_budget_s,
                                  first=[m for m in REFERENCES if m in todo])
        pending = list(todo)
        ratios: dict[str, float] = {}  # method -> its median / the anchor of its tier
        for r in done.values():
            if r.vs_forward_backward is not None:
                ratios[r.strategy] = r.vs_forward_backward
        auto = "auto = " + resolve_strategy("auto", data.model, data.x) if "auto" in todo else ""
        patience_left = self.patience_s if rounds is None else self.patience_s / 2  # for the extra rounds, in all
        for tier in tiers:
            fns = {m: calls[m] for m in tier}
            fns.setdefault(ANCHOR, calls[ANCHOR])
            cost = sum(max(estimates[m], self.min_block_s) for m in fns)
            first = max(self.min_rounds, min(most, int(self.tier_budget_s / cost)))
            patience = timing.Patience(rounds=first, max_rounds=max(first, self.max_rounds if rounds is None
                                                                    else 2 * first),
                                       budget_s=max(0.0, patience_left), threshold=self.noise_threshold)
            extra_since: float | None = None
            for result, final in timing.time_adaptive(fns, patience=patience, estimates=estimates,
                                                      min_block_s=self.min_block_s, check=poll,
                                                      prior={m: prior[m] for m in fns if m in prior}):
                if not final and extra_since is None:
                    extra_since = time.perf_counter()
                elif final and extra_since is not None:
                    patience_left -= time.perf_counter() - extra_since
                anchor = result[ANCHOR]
                drift = final and anchor_ref is not None and timing.drifted(anchor_ref, anchor, self.drift)
                for m in tier:
                    t = result[m]
                    ratios[m] = t.median_s / anchor.median_s
                    note = auto if m == "auto" else ""
                    noisy = final and (t.noisy or drift)
                    if noisy:
                        why = (f"median ±{t.uncertainty:.0%} after {len(t.samples)} rounds" if t.noisy
                               else "the load changed while timing (forward+backward moved)")
                        note = "; ".join(filter(None, [note, f"noisy: {why}"]))
                    record = bench.Record(m, setting.quantity, setting.batch, setting.hidden, t.median_s, t.iqr_s,
                                          self._result_size(setting), max_abs_diff=diffs.get(m), note=note,
                                          noisy=noisy)
                    record.vs_forward_backward = ratios[m]
                    done[m] = record
                _ratios(done, ratios)
                if not final:
                    yield _ordered(done, skipped), tuple(p for p in methods if p in pending), reused, tuple(tier)
                    continue
                if anchor_ref is None:
                    anchor_ref = anchor
                for m in tier:
                    pending.remove(m)
                    if not done[m].noisy:
                        self.cache[self._key(setting, m)] = dataclasses.replace(done[m])
                yield _ordered(done, skipped), tuple(p for p in methods if p in pending), reused, ()

    def _result_size(self, setting: Setting) -> int:
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        return result_bytes(setting.batch, self.spec(setting).num_params(setting.hidden), self.dtype, outputs)

    def _warm_up(self, setting: Setting, data: _Data, calls: dict[str, Callable[[], object]], names: list[str],
                 poll: Callable[[], None]) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
        """One call of each method: its cost (to plan the tiers and size the blocks) and, for strategies, its
        max |difference| from the loop on the checked samples. Returns (estimates, differences, prior): a call
        that took at least ``prior_min_s`` counts as the method's first round (timing it again would cost more
        than it tells)."""
        estimates: dict[str, float] = {}
        diffs: dict[str, float] = {}
        prior: dict[str, list[float]] = {}
        if data.reference is None:  # the scaling curve's smaller batches: no verdict was drawn for them
            data.checked = self._checked(setting)
            data.reference = _loop_rows(data.model, data.loss_fn, data.x, data.y, data.checked, setting.quantity)
        idx, reference = data.checked, data.reference
        for m in names:
            if m == "hooks" and setting.quantity == "grads" and data.hooks_s is not None:
                estimates[m] = data.hooks_s  # the heatmap's gradients: this call, just made
                diffs[m] = float(torch.linalg.vector_norm(data.grads[idx] - reference, ord=math.inf))
                if data.hooks_s >= self.prior_min_s:
                    prior[m] = [data.hooks_s]
                continue
            poll()
            start = time.perf_counter()
            out = calls[m]()
            estimates[m] = time.perf_counter() - start
            if estimates[m] >= self.prior_min_s:
                prior[m] = [estimates[m]]
            if m in REFERENCES:
                continue
            rows = out.reshape(setting.batch, -1)[idx] if isinstance(out, torch.Tensor) else out
            diffs[m] = float(torch.linalg.vector_norm(rows - reference, ord=math.inf))
            del out, rows
        return estimates, diffs, prior


def _inputs_of(batch: Batch) -> object:
    """A batch's inputs as per_sample_grads takes them: a tensor, a tuple or a dict."""
    if batch.kwargs and not batch.args:
        return dict(batch.kwargs)
    if not batch.kwargs and len(batch.args) == 1:
        return batch.args[0]
    if not batch.kwargs:
        return tuple(batch.args)
    raise ValueError("inputs with both positional and keyword tensors cannot be drawn by the explorer")


def _drawn(one: Batch, kind: str) -> torch.Tensor | None:
    """What the sample panel draws of one sample: the image (its pixels, any shape) or the (T,) token ids."""
    if kind not in ("image", "tokens") or len(one.args) != 1 or not isinstance(one.args[0], torch.Tensor):
        return None
    return one.args[0][0].detach().cpu()


def _how(model: nn.Module, x: object) -> tuple[tuple[str, str, str], ...]:
    """(layer, module type, ``"rule"`` | ``"call"`` | ``"fallback"``) for each layer with trainable parameters."""
    modules = dict(model.named_modules())
    kinds = describe_layers(Trainable.of(model), Batch.of(x))
    return tuple((name, type(modules[name]).__name__ if name in modules else "-", kind) for name, kind in kinds.items())


def _layer_io(data: _Data, one: Batch, i: int, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, g) of sample i at ``module``: its input (1, ...) and the gradient of the sample's loss at its output
    (1, ...), from one forward and backward of the sample alone (a forward hook, removed at once)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, args, out):
        seen["a"], seen["out"] = args[0].detach(), out

    handle = module.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            out = one(data.model)
    finally:
        handle.remove()
    with torch.enable_grad():
        target = cut(data.y, slice(i, i + 1), Batch.of(data.x).size)
        (g,) = torch.autograd.grad(data.loss_fn(out, target), seen["out"])
    return seen["a"], g.detach()


def _rule(data: _Data, one: Batch, i: int, layer: str, module: nn.Module, grad: torch.Tensor) -> RuleView:
    """The closed-form rule of ``module`` (a Linear, Conv2d or Embedding) for sample i, its factors computed here
    from the layer's input and output gradient and checked against ``grad`` (the per-sample gradient of the
    weight, from per_sample_grads)."""
    a, g = _layer_io(data, one, i, module)
    norm = float(grad.norm())
    vector = None
    if isinstance(module, nn.Linear):
        n_in, n_out = module.in_features, module.out_features
        if a.dim() == 2:  # one position: the outer product g a^T
            vector = (a[0], g[0])
            left, right = g[0][:, None], a[0][None]
            names = ("g_i: the backprop signal at the output", "a_i^T: the layer's input", "g_i a_i^T")
        else:  # a sequence: the sum over positions of g_t a_t^T
            left, right = g.reshape(-1, n_out).T, a.reshape(-1, n_in)
            names = ("G_i^T: the signal at each position", "A_i: the input at each position", "G_i^T A_i")
        kind = "linear"
    elif isinstance(module, nn.Conv2d):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return RuleView(layer, None, note=f"{layer} is a grouped / padded-by-mode convolution: its rule (the "
                                              "unfolded patches per group) is not drawn here", gradient_norm=norm)
        patches = nn.functional.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding,
                                       stride=module.stride)[0]  # (C_in k k, L)
        left, right = g[0].reshape(module.out_channels, -1), patches.T  # (C_out, L), (L, C_in k k)
        names = ("G_i: the signal at each output position", "U_i^T: the unfolded input patches", "G_i U_i^T")
        kind = "conv"
    elif isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq:
            return RuleView(layer, None, note=f"{layer} renormalises or scales by frequency: not drawn here",
                            gradient_norm=norm)
        tokens = a.reshape(-1)
        left = nn.functional.one_hot(tokens, module.num_embeddings).to(g.dtype).T  # (V, T)
        if module.padding_idx is not None:
            left[module.padding_idx] = 0  # the padding row gets no gradient
        right = g.reshape(-1, module.embedding_dim)  # (T, d)
        names = ("O_i^T: the one-hot rows of the sample's tokens", "G_i: the signal at each token",
                 "O_i^T G_i: rows of the used tokens")
        kind = "embedding"
    else:
        return RuleView(layer, None, note=f"{layer} ({type(module).__name__}) has no closed-form panel here",
                        gradient_norm=norm)
    product = left @ right
    difference = float((product - grad.reshape(product.shape)).abs().max())
    return RuleView(layer, kind, "", left, right, product, names, *(vector or (None, None)), norm, difference)


def _first_layer_panel(setting: Setting, spec: ModelSpec, i: int, label: str, layer: str, grad: torch.Tensor,
                       jac: torch.Tensor | None, start: int, stop: int
                       ) -> tuple[torch.Tensor, tuple[str, ...], str]:
    """(first_layer, titles, title) of the sample panel: the first rule layer's weight gradient as (K, h, w) small
    images (a Linear on 28x28 images: one per hidden unit; a convolution: its kernels) or as a (R, C) matrix (an
    embedding's rows, one per token id; any other layer's rows); with a Jacobian, its outputs' sensitivity."""
    names = spec.class_names
    where = f"sample {i} ({label}) at {setting.short}"
    shape = grad.shape
    if jac is not None:
        first = jac[:, start:stop].reshape(jac.shape[0], *shape)  # (Y, *weight)
        outputs = tuple(names[:jac.shape[0]]) if names and len(names) >= jac.shape[0] else tuple(
            f"output {c}" for c in range(jac.shape[0]))
        if first.dim() == 3 and shape[1] == 784:  # rows of a Linear on images
            unit = int(first.square().sum(dim=(0, 2)).argmax())
            return (first[:, unit].reshape(-1, 28, 28), outputs,
                    f"{where}: d output_c / d {layer}.weight[{unit}, :] for each class c (hidden unit {unit}, the "
                    "most sensitive)")
        if first.dim() == 5:  # a convolution's kernels
            flat = first.reshape(first.shape[0], -1, *shape[2:])
            kernel = int(flat.square().sum(dim=(0, 2, 3)).argmax())
            return (flat[:, kernel], outputs, f"{where}: d output_c / d {layer}.weight (kernel {kernel}, the most "
                                               "sensitive) for each class c")
        rows = first.reshape(first.shape[0], shape[0], -1).norm(dim=2)  # (Y, rows)
        return (rows, outputs, f"{where}: ||d output_c / d {layer}.weight[row, :]|| for each class c and row")
    if grad.dim() == 2 and shape[1] == 784:
        units = grad.norm(dim=1).topk(min(MAX_IMAGES, shape[0])).indices.tolist()
        return (grad[units].reshape(-1, 28, 28), tuple(f"unit {j}" for j in units),
                f"{where}: its gradient w.r.t. {layer}.weight, the {len(units)} hidden units with the largest "
                "gradient (each is the input times one number)")
    if grad.dim() == 4:
        flat = grad.reshape(-1, *shape[2:])  # (C_out C_in, k, k)
        top = flat.flatten(1).norm(dim=1).topk(min(MAX_IMAGES, flat.shape[0])).indices.tolist()
        return (flat[top], tuple(f"out {j // shape[1]}, in {j % shape[1]}" for j in top),
                f"{where}: its gradient w.r.t. {layer}.weight, the {len(top)} kernels with the largest gradient")
    matrix = grad.reshape(shape[0], -1)
    return (matrix, tuple(str(k) for k in range(shape[0])),
            f"{where}: its gradient w.r.t. {layer}.weight, one row per "
            + ("token id (only the sample's tokens have one)" if spec.sample_kind == "tokens" else "output unit"))


def _loop_rows(model: nn.Module, loss_fn: Callable, x: object, y: object, idx: torch.Tensor,
               quantity: str) -> torch.Tensor:
    """The definition, written out (no strategy of the package involved): for each sample i of ``idx`` run alone,
    ``torch.autograd.grad`` of its loss (``"grads"``: (n, P)) or of each of its outputs (``"jacobian"``:
    (n, Y * P), the flat (Y, P) layout), over the trainable parameters in ``named_parameters`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    batch = Batch.of(x)
    rows = []
    with torch.enable_grad():
        for i in idx.tolist():
            out = batch.sample(i)(model)
            if quantity == "grads":
                parts = [torch.autograd.grad(loss_fn(out, cut(y, slice(i, i + 1), batch.size)), params)]
            else:
                flat = out.reshape(-1)
                parts = [torch.autograd.grad(flat[j], params, retain_graph=True) for j in range(flat.numel())]
            rows.append(torch.cat([g.reshape(-1) for grads in parts for g in grads]))
    return torch.stack(rows)


def _boundaries(model: nn.Module) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.append((name, start, start + p.numel()))
            start += p.numel()
    return out


def _ratios(done: dict[str, bench.Record], ratios: dict[str, float]) -> None:
    """Speed-up vs the loop and time vs the memory floor, as ratios of each one's ratio to the anchor of its
    own tier: comparable across tiers even if the load changed between them."""
    loop, floor = ratios.get("loop"), ratios.get(bench.MEMORY_FLOOR)
    for name, r in done.items():
        if r.skipped or name not in ratios:
            continue
        r.speedup_vs_loop = loop / ratios[name] if loop else None
        r.vs_memory_floor = ratios[name] / floor if floor else None


def _ordered(done: dict[str, bench.Record], skipped: list[bench.Record]) -> list[bench.Record]:
    """The strategies timed so far, fastest first (cheap tiers finish first, so the chart grows downwards), then
    the references, then the skipped ones."""
    strategies = sorted((r for name, r in done.items() if name not in REFERENCES), key=lambda r: r.median_s)
    return [*strategies, *(done[n] for n in REFERENCES if n in done), *skipped]


def _noisy(records: Sequence[bench.Record]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.strategy for r in records if r.noisy))


def _notes(setting: Setting, records: Sequence[bench.Record], provisional: Sequence[str] = ()) -> tuple[str, ...]:
    """The lines a learner must see: the slow baselines skipped (and why, and how to time them), the numbers
    still being measured (provisional: not a warning), the noisy measurements."""
    lines = []
    skipped = [r for r in records if r.skipped]
    if skipped:
        reason = skipped[0].note.removeprefix("skipped: ")
        names = ", ".join(r.strategy for r in skipped)
        lines.append(f"skipped as too slow at {setting.describe()}: {names} ({reason} for "
                     f"{skipped[0].strategy}). Lower the batch size, or raise 'time slow methods up to' (above the "
                     "table) to time them.")
    if provisional:
        lines.append(f"provisional: the first rounds of {', '.join(provisional)} varied, so more rounds are being "
                     "timed; the numbers may still move.")
    noisy = _noisy(records)
    if noisy:
        lines.append(f"noisy measurement: the rounds of {', '.join(noisy)} still varied after the extra rounds "
                     "(other programs are using the CPU), so these times are uncertain and not kept: press 'rerun "
                     "timings' or come back to this setting later.")
    return tuple(lines)
