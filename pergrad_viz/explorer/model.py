"""The explorer's model: pure and widget-free. A :class:`Setting` goes in, :class:`View` s come out.

>>> from pergrad_viz.explorer.model import ExplorerModel, Setting
>>> model = ExplorerModel()
>>> view = model.update(Setting(batch=32, hidden=20))     # everything at this setting, timed
>>> view.verdict.ok, [r.strategy for r in view.records], view.grads.shape    # True, [...], (32, P)

:meth:`ExplorerModel.stages` yields the views progressively, as a responsive front end wants them:

1. ``"gradients"``: everything that needs one call at the setting: the (B, P) per-sample gradients (the
   heatmap), the chosen sample's first-layer gradients and the fast rule's parts (a_i, g_i), the norms for the
   DP-SGD view; then (a second view) the verdict: the heatmap's gradients against the loop (the definition,
   written out here: ``torch.autograd.grad`` of each checked sample's loss, run alone);
2. ``"timing"``: per tier of methods timed (cheapest first; methods of a tier interleaved in rounds with
   ``forward+backward`` as the anchor), the records so far: first *provisional* (the first pass of rounds) where
   a median is still uncertain, then settled after more rounds (:func:`pergrad_viz.timing.time_adaptive`); every
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

from .. import bench, timing
from ..api import per_sample_grads, per_sample_jacobian, resolve_strategy
from ..data import CLASS_NAMES
from ..errors import human_bytes
from ..memory import check_held, result_bytes
from ..strategies import STRATEGIES

__all__ = ["ClipView", "ExplorerModel", "SampleView", "Setting", "Stale", "Verdict", "View"]

QUANTITIES = ("grads", "jacobian")
QUANTITY_NAMES = {"grads": "per-sample gradients", "jacobian": "output Jacobian"}
OUTPUTS = 10  # the MLP's classes
IN_FEATURES = 784
FIRST_LAYER = "fc1"
MAX_IMAGES = 9  # hidden units shown as images for a per-sample gradient
REFERENCES = (bench.FORWARD_BACKWARD, bench.MEMORY_FLOOR)
ANCHOR = bench.FORWARD_BACKWARD  # timed in every tier: ratios within a tier, drift between tiers


class Stale(Exception):
    """Raised by a ``check`` callback to abandon work for a setting that is no longer wanted."""


@dataclass(frozen=True)
class Setting:
    """What the controls say. ``quantity, batch, hidden`` decide the computation and the timings; ``strategies``
    which methods are timed, ``slow_limit`` which of them are skipped as too slow (None: the model's default);
    ``sample`` and ``clip`` only the sample panels and the DP-SGD view."""

    batch: int = 32
    hidden: int = 20
    quantity: str = "grads"
    strategies: tuple[str, ...] = STRATEGIES
    sample: int = 0
    clip: float = 20.0
    slow_limit: int | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.quantity, self.batch, self.hidden)

    def describe(self) -> str:
        """``"batch size B=32, hidden width 20"``: how every title and line names the setting."""
        return f"batch size B={self.batch}, hidden width {self.hidden}"

    @property
    def short(self) -> str:
        return f"B={self.batch}, hidden {self.hidden}"


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
class SampleView:
    """The chosen sample i: its first-layer gradients as images and the fast rule's parts.

    Shapes: image and a (784,), g (hidden,), first_layer (K, 784), jacobian (Y, P) or None.
    """

    index: int
    label: str
    image: torch.Tensor
    first_layer: torch.Tensor
    first_layer_titles: tuple[str, ...]
    first_layer_title: str
    jacobian: torch.Tensor | None
    a: torch.Tensor
    g: torch.Tensor
    gradient_norm: float  # ||the per-sample gradient of fc1.weight||, from per_sample_grads


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
        reused: records taken from the cache.
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
    x: torch.Tensor
    y: torch.Tensor
    labels: torch.Tensor
    grads: torch.Tensor  # (B, P)
    boundaries: list[tuple[str, int, int]]
    total: torch.Tensor  # (B,)
    layers: dict[str, torch.Tensor]  # {layer: (B,)}
    verdict: Verdict | None
    checked: torch.Tensor | None = None  # (n,) the samples compared with the loop
    reference: torch.Tensor | None = None  # (n, P) or (n, Y * P): the loop's result on them, for max |diff|
    hooks_s: float | None = None  # how long the hooks call for ``grads`` took


@dataclass(frozen=True)
class TimingKey:
    """Everything a timing depends on."""

    quantity: str
    batch: int
    hidden: int
    method: str
    dtype: str
    device: str
    threads: int


def _num_params(hidden: int) -> int:
    return (IN_FEATURES + 1) * hidden + (hidden + 1) * OUTPUTS


class ExplorerModel:
    """The explorer's computations for the tutorial ``MLP(784, hidden, 10)``, MSE ``reduction='sum'``.

    Args:
        batch_options: the batch sizes of the slider (the scaling curve picks among those up to the current).
        slow_limit: the slow baselines are skipped (with a note) above this many sample-backward passes per
            call (see :func:`pergrad_viz.bench.backward_work`).
        rounds, min_rounds: rounds of a tier's first pass (:func:`pergrad_viz.timing.time_adaptive`): ``rounds``,
            fewer (down to ``min_rounds``) where they would take more than ``tier_budget_s`` seconds.
        max_rounds, patience_s: while a median is uncertain, more rounds are timed, up to ``max_rounds`` per tier
            and about ``patience_s`` seconds per setting in all (half that for each of the scaling curve's smaller
            batches); the first numbers are shown meanwhile, as provisional.
        round_budget_s: one round of a tier costs about this much (cheap methods share a tier; a costly one gets
            its own). prior_min_s: a first call at least this long counts as a round.
        min_block_s: a timed block lasts at least this long (many calls of a fast method).
        noise_threshold: a median is settled when the half-width of its 95% confidence interval is at most this
            fraction of it (:attr:`pergrad_viz.timing.Timing.uncertainty`); still above after the extra rounds:
            noisy. drift: the anchor's median may move by this factor between tiers before the later tier counts
            as noisy.
        sweep_batches: batch sizes on the scaling curve (up to the current one).
        threads: intra-op threads while computing (default: one core left free, see
            :func:`pergrad_viz.timing.headroom_threads`).
        verdict_samples, verdict_samples_jacobian: the results are compared with the loop on all samples up to
            this many (for gradients / for Jacobians), else on this many spread evenly over the batch.
    """

    def __init__(self, *, batch_options: Sequence[int] = tuple(2**k for k in range(9)), slow_limit: int = 1024,
                 rounds: int = 5, min_rounds: int = 3, max_rounds: int = 15, patience_s: float = 1.0,
                 tier_budget_s: float = 1.0, round_budget_s: float = 0.05, prior_min_s: float = 0.1,
                 min_block_s: float = timing.MIN_BLOCK_S, noise_threshold: float = 0.15, drift: float = 1.5,
                 sweep_batches: int = 3, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 threads: int | None = None, verdict_samples: int = 64, verdict_samples_jacobian: int = 8):
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
        self._data: dict[tuple[str, int, int], _Data] = {}  # the latest setting's only: bounded memory

    # ------------------------------------------------------------------------------------------ checks

    def check(self, setting: Setting) -> None:
        """Refuse a setting that is malformed or would not fit in memory, before allocating anything."""
        if setting.quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {QUANTITIES}, got {setting.quantity!r}")
        if setting.batch < 1 or setting.hidden < 1:
            raise ValueError(f"batch size and hidden width must be positive, got {setting.batch}, {setting.hidden}")
        unknown = [s for s in setting.strategies if s != "auto" and s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
        if not (setting.clip > 0 and math.isfinite(setting.clip)):
            raise ValueError(f"the clipping threshold must be a positive number, got {setting.clip!r}")
        if setting.slow_limit is not None and setting.slow_limit < 0:
            raise ValueError(f"slow_limit must be a number of sample-backward passes >= 0, got {setting.slow_limit}")
        p = _num_params(setting.hidden)
        grads = result_bytes(setting.batch, p, self.dtype)
        outputs = OUTPUTS if setting.quantity == "jacobian" else 1
        one = result_bytes(setting.batch, p, self.dtype, outputs)
        # the heatmap's (B, P) gradients, plus while timing: the reference result, a fresh one, a working copy
        held = grads + 3 * one
        check_held(what=f"the explorer at {setting.describe()} ({QUANTITY_NAMES[setting.quantity]})", held=held,
                   detail=f"the {human_bytes(grads)} gradients of the heatmap and three copies of the "
                          f"{human_bytes(one)} result while timing",
                   fix="Choose a smaller batch size or hidden width, or the per-sample gradients instead of the "
                       "Jacobian.", device=torch.device(self.device))

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
                        pending=tuple(self._methods(setting)))
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
        for key in [k for k in self.cache if (k.quantity, k.hidden) == (setting.quantity, setting.hidden)
                    and k.batch in batches]:
            del self.cache[key]

    # ------------------------------------------------------------------------------------------ gradients

    def _gradients(self, setting: Setting, keep: bool = True) -> _Data:
        """The per-sample gradients at ``setting`` (the verdict comes next, see :meth:`stages`); with ``keep`` (the
        current setting) they are kept for sample and clip changes, replacing the previous setting's."""
        cached = self._data.get(setting.key)
        if cached is not None:
            return cached
        model, loss_fn, x, y = bench.setting(setting.batch, setting.hidden, device=self.device, dtype=self.dtype)
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
        data = _Data(model, loss_fn, x, y, y.argmax(dim=1), grads, bounds, total, layers, None, hooks_s=hooks_s)
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
        """The first-layer images and the fast rule's parts for sample ``setting.sample`` (clamped to B-1)."""
        i = max(0, min(setting.sample, setting.batch - 1))
        names = CLASS_NAMES["fashion-mnist"]
        label = names[int(data.labels[i])]
        start, stop = next((a, b) for n, a, b in data.boundaries if n == f"{FIRST_LAYER}.weight")
        hidden = setting.hidden
        first_grad = data.grads[i, start:stop].reshape(hidden, IN_FEATURES)  # (hidden, 784) = g_i a_i^T
        jac = None
        if setting.quantity == "jacobian":
            jac = per_sample_jacobian(data.model, data.x[i:i + 1], flat=True)[0]  # (Y, P)
            first = jac[:, start:stop].reshape(jac.shape[0], hidden, IN_FEATURES)  # (Y, hidden, 784)
            unit = int(first.square().sum(dim=(0, 2)).argmax())
            images, titles = first[:, unit], tuple(names)
            title = (f"sample {i} ({label}) at {setting.short}: d output_c / d fc1.weight[{unit}, :] for each class "
                     f"c (hidden unit {unit}, the most sensitive)")
        else:
            units = first_grad.norm(dim=1).topk(min(MAX_IMAGES, hidden)).indices.tolist()
            images, titles = first_grad[units], tuple(f"unit {j}" for j in units)
            title = (f"sample {i} ({label}) at {setting.short}: its gradient w.r.t. fc1.weight, the {len(units)} "
                     "hidden units with the largest gradient (each is the input times one number)")
        return SampleView(i, label, data.x[i], images, titles, title, jac, data.x[i], self._backprop_signal(data, i),
                          float(first_grad.norm()))

    @staticmethod
    def _backprop_signal(data: _Data, i: int) -> torch.Tensor:
        """g_i: the gradient of sample i's loss with respect to fc1's output (hidden,)."""
        model = data.model
        with torch.enable_grad():
            h = model.fc1(data.x[i:i + 1]).detach().requires_grad_(True)
            loss = data.loss_fn(model.fc2(model.act(h)), data.y[i:i + 1])
            (g,) = torch.autograd.grad(loss, h)
        return g[0]

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
        outputs = OUTPUTS if setting.quantity == "jacobian" else 1
        strategy = "hooks" if name == "auto" else name
        work = bench.backward_work(strategy, setting.quantity, setting.batch, outputs)
        limit = self.slow_limit if setting.slow_limit is None else setting.slow_limit
        if work > limit:
            return f"skipped: {work:,} sample-backward passes > slow_limit={limit:,}"
        return None

    def _key(self, setting: Setting, method: str) -> TimingKey:
        return TimingKey(setting.quantity, setting.batch, setting.hidden, method, str(self.dtype), str(self.device),
                         self.threads)

    def _calls(self, setting: Setting, data: _Data) -> dict[str, Callable[[], object]]:
        model, loss_fn, x, y = data.model, data.loss_fn, data.x, data.y
        params = [p for p in model.parameters() if p.requires_grad]
        outputs = OUTPUTS if setting.quantity == "jacobian" else 1
        shape = (setting.batch, _num_params(setting.hidden)) if outputs == 1 else (
            setting.batch, outputs, _num_params(setting.hidden))

        def forward_backward() -> object:
            return torch.autograd.grad(loss_fn(model(x), y), params)

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
        outputs = OUTPUTS if setting.quantity == "jacobian" else 1
        return result_bytes(setting.batch, _num_params(setting.hidden), self.dtype, outputs)

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


def _loop_rows(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
               quantity: str) -> torch.Tensor:
    """The definition, written out (no strategy of the package involved): for each sample i of ``idx`` run alone,
    ``torch.autograd.grad`` of its loss (``"grads"``: (n, P)) or of each of its outputs (``"jacobian"``:
    (n, Y * P), the flat (Y, P) layout), over the trainable parameters in ``named_parameters`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    with torch.enable_grad():
        for i in idx.tolist():
            out = model(x[i:i + 1])
            if quantity == "grads":
                parts = [torch.autograd.grad(loss_fn(out, y[i:i + 1]), params)]
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
