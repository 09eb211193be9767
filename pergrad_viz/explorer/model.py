"""The explorer's model: pure and widget-free. A :class:`Setting` goes in, :class:`View` s come out.

>>> from pergrad_viz.explorer.model import ExplorerModel, Setting
>>> model = ExplorerModel()
>>> view = model.update(Setting(batch=32, hidden=20))     # everything at this setting, timed
>>> view.verdict.ok, [r.strategy for r in view.records], view.grads.shape    # True, [...], (32, P)
>>> view = model.update(Setting(model="lstm", batch=16, hidden=32))     # another network of the menu

The network is a :class:`~.specs.ModelSpec`: one of the built-in menu (:data:`~.specs.MENU`) or a user's own
network and data (:func:`~.specs.user_spec`); ``Setting.hidden`` is its width (hidden units, channels, d_model ...).

:meth:`ExplorerModel.stages` yields the views progressively, as a responsive front end wants them:
``"gradients"`` (the (B, P) per-sample gradients of one call: the heatmap, the chosen sample's panel, the DP-SGD
view; then the verdict: those gradients against the loop, the definition written out here, each checked sample's
``torch.autograd.grad`` run alone), ``"timing"`` (the fast strategies and the references tier by tier, cheapest
first, interleaved in rounds with ``forward+backward`` as the anchor, provisional while a median is uncertain:
:func:`pergrad_viz.bench.timing.time_adaptive`; then at the scaling curve's smaller batch sizes; every result
compared with the loop), ``"measuring"`` (all that shown and final; the slow baselines, ``loop``,
``autograd_stack``, ``batched_grad``, and where one result is over :data:`LARGE_RESULT` bytes every method but
``auto``'s, timed the same way, their rows ``pending``), ``"done"`` (every row, the whole scaling curve).
:meth:`ExplorerModel.ahead` computes a setting up to its ``"measuring"`` view before it is asked for.

Timings are cached by all that affects them (:mod:`.session`), a noisy one flagged, never cached. Records are in
:mod:`.state`, pure computations in :mod:`.compute` and :mod:`.sample`; this module calls the package and puts the
stages in order, knowing nothing of ipywidgets (:mod:`.view` maps controls to settings and views to images).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator, Iterator, Sequence

import torch
from torch import nn

from pergrad_viz.api import per_sample_grads, per_sample_jacobian, resolve_strategy
from pergrad_viz.bench import timing
from pergrad_viz.bench.records import FORWARD_BACKWARD, MEMORY_FLOOR, Record
from pergrad_viz.bench.sweeps import backward_work
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.layout import param_boundaries
from pergrad_viz.core.memory import result_bytes
from pergrad_viz.core.validate import check_modes
from pergrad_viz.errors import UnsupportedModelError
from pergrad_viz.explorer import compute
from pergrad_viz.explorer.sample import inputs_of, sample_view
from pergrad_viz.explorer.session import Calls, Progress, TimingSession, clock, synchronizer
from pergrad_viz.explorer.specs import MENU, ModelSpec
from pergrad_viz.explorer.state import (
    REFERENCES,
    Budget,
    ClipView,
    Computed,
    RuleView,
    SampleView,
    Setting,
    Stale,
    Verdict,
    View,
    Visit,
    weights_version,
)
from pergrad_viz.strategies import REGISTRY

LARGE_RESULT = 64 * 2**20  # bytes of one result above which only auto's method is timed before the view shows

__all__ = ["ClipView", "ExplorerModel", "RuleView", "SampleView", "Setting", "Stale", "Verdict", "View"]


class ExplorerModel:
    """The explorer's computations for the networks of ``models`` (default the built-in menu, the tutorial
    ``MLP(784, hidden, 10)`` first; each with its loss, MSE ``reduction='sum'`` for the menu's).

    Args:
        models: {key: :class:`~.specs.ModelSpec`}; ``Setting.model`` picks one.
        batch_options: the batch sizes of the slider (the scaling curve picks among those up to the current).
        slow_limit: the slow baselines are skipped (with a note) above this many sample-backward passes per
            call (see :func:`pergrad_viz.bench.sweeps.backward_work`).
        rounds, min_rounds, max_rounds, patience_s, round_budget_s, prior_min_s, tier_budget_s, min_block_s,
            noise_threshold, drift: how settings are timed (:class:`~.session.TimingSession` says what each does).
        sweep_batches: batch sizes on the scaling curve (up to the current one).
        threads: intra-op threads while computing (default: one core left free, see
            :func:`pergrad_viz.bench.timing.headroom_threads`); set for each step of :meth:`stages` and the
            process's own count restored after it.
        verdict_samples, verdict_samples_jacobian: the results are compared with the loop on all samples up to
            this many (for gradients / for Jacobians), else on this many spread evenly over the batch.
    """

    def __init__(self, *, batch_options: Sequence[int] = tuple(2**k for k in range(9)), slow_limit: int = 1024,
                 rounds: int = 5, min_rounds: int = 3, max_rounds: int = 15, patience_s: float = 1.0,
                 tier_budget_s: float = 0.15, round_budget_s: float = 0.05, prior_min_s: float = 0.1,
                 min_block_s: float = timing.MIN_BLOCK_S, noise_threshold: float = 0.15, drift: float = 1.5,
                 sweep_batches: int = 3, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 threads: int | None = None, verdict_samples: int = 64, verdict_samples_jacobian: int = 8,
                 models: dict[str, ModelSpec] | None = None):
        self.models = dict(MENU if models is None else models)
        if not self.models:
            raise ValueError("models is empty: pass at least one ModelSpec")
        self._outputs: dict[str, int] = {}
        self.batch_options, self.slow_limit = tuple(sorted(batch_options)), slow_limit
        self.sweep_batches, self.device, self.dtype = sweep_batches, device, dtype
        self.verdict_samples, self.verdict_samples_jacobian = verdict_samples, verdict_samples_jacobian
        self.session = TimingSession(
            rounds=rounds, min_rounds=min_rounds, max_rounds=max_rounds, patience_s=patience_s,
            tier_budget_s=tier_budget_s, round_budget_s=round_budget_s, prior_min_s=prior_min_s,
            min_block_s=min_block_s, noise_threshold=noise_threshold, drift=drift, dtype=dtype, device=device,
            threads=threads if threads is not None else timing.headroom_threads())
        self.cache = self.session.cache  # {TimingKey: Record}: the settled timings
        self._data: dict[tuple[str, str, int, int], Computed] = {}  # the latest setting's only: bounded memory
        self._ahead: dict[tuple[str, str, int, int], Computed] = {}  # computed ahead (:meth:`ahead`): one a network

    @property
    def threads(self) -> int:
        return self.session.threads

    # ------------------------------------------------------------------------------------------ checks

    def check(self, setting: Setting) -> None:
        """Refuse a malformed setting, or one too large for the memory, before allocating (:func:`.compute.check`)."""
        spec = self.spec(setting)
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        compute.check(setting, spec, outputs, self.dtype, torch.device(self.device))

    def spec(self, setting: Setting) -> ModelSpec:
        """The network ``setting.model`` names."""
        if setting.model not in self.models:
            raise ValueError(f"unknown model {setting.model!r}; this explorer has {', '.join(self.models)}")
        return self.models[setting.model]

    def outputs(self, setting: Setting) -> int:
        """Y, the outputs of one sample (10 for the menu's networks; a user's: one forward of one sample)."""
        key = setting.model
        if key not in self._outputs:
            spec = self.spec(setting)
            self._outputs[key] = 10 if spec.max_batch is None else compute.output_count(spec, setting.hidden)
        return self._outputs[key]

    def problem(self, setting: Setting) -> tuple[nn.Module, nn.Module, object, object, torch.Tensor]:
        """(model, loss_fn, inputs, targets, labels) at ``setting`` (a menu network on the explorer's device, dtype)."""
        spec = self.spec(setting)
        model, loss_fn, x, y, labels = spec.problem(setting.batch, setting.hidden)
        if spec.max_batch is None:
            model = model.to(device=self.device, dtype=self.dtype)
            x, y = (t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device) for t in (x, y))
        return model, loss_fn, x, y, labels

    def scaling_batches(self, batch: int) -> list[int]:
        """The batch sizes of the scaling curve (:func:`.compute.scaling_batches`)."""
        return compute.scaling_batches(batch, self.batch_options, self.sweep_batches)

    # ------------------------------------------------------------------------------------------ stages

    def update(self, setting: Setting) -> View:
        """Everything at ``setting``, timed: the last of :meth:`stages`."""
        *_, last = self.stages(setting)
        return last

    def stages(self, setting: Setting, check: Callable[[], None] | None = None) -> Iterator[View]:
        """Views of ``setting``, progressively (see the module's docstring). ``check`` is called between steps (and
        timed blocks): raise :class:`Stale` from it to abandon the setting. Each step runs with :attr:`threads`
        intra-op threads, the process's own restored before each view is yielded (:meth:`.session.TimingSession
        .stepwise`)."""
        self.check(setting)
        yield from self.session.stepwise(self._stages(setting, check or (lambda: None)))

    def ahead(self, setting: Setting, check: Callable[[], None] | None = None) -> View | None:
        """Compute ``setting`` before it is asked for (while the explorer idles), up to its first view shown in full;
        its gradients and verdict kept for its visit (one setting per network), its timings cached: the visit shows
        them at once. ``check``: as for :meth:`stages` (what was computed before a :class:`Stale` is kept).
        Returns that view (the explorer draws its figures ahead), None when it did not get that far."""
        self.check(setting)
        steps = self.session.stepwise(self._stages(setting, check or (lambda: None), keep="ahead"))
        with contextlib.closing(steps):
            return next((view for view in steps if view.shown), None)

    def _stages(self, setting: Setting, poll: Callable[[], None], keep: str = "shown") -> Iterator[View]:
        data = self._gradients(setting, keep)
        view = View(setting, "gradients", data.grads, data.boundaries, data.labels, data.verdict,
                    self._sample(setting, data), compute.clipping(setting, data),
                    pending=tuple(self._methods(setting)), layers=data.how)
        yield view
        poll()
        late = data.verdict is None and self._result_size(setting) > LARGE_RESULT  # the loop after the figures
        if late:
            data.checked, data.unchecked = self._checked(setting), {}
        elif data.verdict is None:
            data.verdict = compute.verdict(setting, data, self._checked(setting), self.dtype)
            view = dataclasses.replace(view, verdict=data.verdict)
            yield view
            poll()
        auto = resolve_strategy("auto", data.model, data.x)
        slow = {m for m in setting.strategies if self._later(m, auto, setting)}
        visit = Visit()
        view = yield from self._phase(view, data, lambda m: m not in slow, "timing", poll, visit)
        if slow:  # what is left: the slow baselines' rows, marked as coming
            yield (view := dataclasses.replace(view, stage="measuring"))
        if late:  # the verdict, "checking" until now, and the differences of what was timed before it
            data.verdict = compute.verdict(setting, data, self._checked(setting), self.dtype)
            records = visit.records[setting.batch] = self.session.check_late(setting, data, view.records)
            new = dict(zip(map(id, view.records), records, strict=True))
            view = dataclasses.replace(view, verdict=data.verdict,
                                       scaling_records=tuple(new.get(id(r), r) for r in view.scaling_records))
            yield (view := compute.with_records(view, data, records, view.pending, view.reused, view.provisional,
                                                view.stage, self.dtype))
            poll()
        if slow:
            view = yield from self._phase(view, data, lambda m: True, "measuring", poll, visit)
        view = dataclasses.replace(view, stage="done", scaling_pending=(), pending=())
        yield dataclasses.replace(view, noisy=compute.noisy(view.scaling_records))

    def _phase(self, view: View, data: Computed, include: Callable[[str], bool], stage: str,
               poll: Callable[[], None], visit: Visit) -> Generator[View, None, View]:
        """Time the methods ``include`` names at the view's setting, then at the scaling curve's smaller batches (what
        ``visit`` holds of an earlier phase kept); the others stay pending. Returns the last view."""
        setting = view.setting
        methods = [m for m in self._methods(setting) if include(m)]
        coming = tuple(m for m in self._methods(setting) if not include(m))
        for b in (*(scaling := self.scaling_batches(setting.batch)[:-1]), setting.batch):
            visit.budgets.setdefault(b, Budget(self.session.patience_s / (2 if b != setting.batch else 1)))
        before = visit.reused.get(setting.batch, 0)
        records: list[Record] = []
        reused = 0
        for records, pending, reused, provisional in self._time_setting(
                setting, data, poll, methods=methods, have=visit.records.get(setting.batch, []),
                budget=visit.budgets[setting.batch]):
            view = compute.with_records(view, data, records, (*pending, *coming), before + reused, provisional, stage,
                                        self.dtype)
            yield view
        visit.records[setting.batch], visit.reused[setting.batch] = records, before + reused
        for k, b in enumerate(scaling):
            yield (view := dataclasses.replace(view, scaling_pending=tuple(scaling[k:])))
            poll()
            sub = dataclasses.replace(setting, batch=b)
            methods, have = [m for m in self._methods(sub) if include(m)], visit.records.get(b, [])
            if b not in visit.subs and self.session.untimed(sub, methods, have):  # else all cached: none needed
                visit.subs[b] = self._gradients(sub, keep=None)
            *_, (visit.records[b], *_rest) = self._time_setting(
                sub, visit.subs.get(b), poll, rounds=self.session.min_rounds, budget=visit.budgets[b],
                methods=methods, have=have)
        curve = [r for b in (*scaling, setting.batch) for r in visit.records[b]]
        yield (view := dataclasses.replace(view, scaling_pending=(), scaling_records=tuple(curve)))
        return view

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
            changes["clipping"] = compute.clipping(setting, data)
        return dataclasses.replace(view, **changes)

    def release(self) -> None:
        """Let go of the arrays kept for sample and clip changes (the timings stay cached)."""
        self._data, self._ahead = {}, {}

    def forget(self, setting: Setting) -> None:
        """Drop the cached timings of ``setting``'s batch sizes (the scaling curve's too): time them again."""
        batches, same = set(self.scaling_batches(setting.batch)), (setting.model, setting.quantity, setting.hidden)
        for key in [k for k in self.cache if (k.model, k.quantity, k.hidden) == same and k.batch in batches]:
            del self.cache[key]

    # ------------------------------------------------------------------------------------------ gradients

    def _gradients(self, setting: Setting, keep: str | None = "shown") -> Computed:
        """The per-sample gradients at ``setting`` (the verdict comes next, see :meth:`stages`), or those kept of it;
        ``keep``: ``"shown"`` (the current setting) keeps them for sample and clip changes, replacing the previous
        setting's; ``"ahead"`` (:meth:`ahead`) for the setting's visit, replacing its network's earlier ones."""
        cached = self._data.get(setting.key) or self._ahead.get(setting.key)
        if cached is not None and cached.weights == weights_version(cached.model):  # not trained since
            self._keep(setting, cached, keep)
            return cached
        model, loss_fn, x, y, labels = self.problem(setting)
        check_modes(model)  # a random forward refused naming model.eval(), not randomness=, which explorer() lacks
        sync = synchronizer(model, self.device)
        start = clock(sync)
        try:
            grads = per_sample_grads(model, loss_fn, x, y, strategy="hooks", flat=True)  # (B, P)
            hooks_s = clock(sync) - start
        except UnsupportedModelError:  # a network hooks cannot run: auto's exact route (hooks' row says why)
            grads, hooks_s = per_sample_grads(model, loss_fn, x, y, flat=True), None
        bounds = param_boundaries(model)
        total, layers = compute.norms(grads, bounds)
        data = Computed(model, loss_fn, x, y, labels, grads, bounds, total, layers, None, hooks_s=hooks_s,
                        how=compute.how(model, x), output=self.spec(setting).output, weights=weights_version(model))
        self._keep(setting, data, keep)
        return data

    def _keep(self, setting: Setting, data: Computed, keep: str | None) -> None:
        if keep == "shown":
            self._data = {setting.key: data}
        elif keep == "ahead":
            self._ahead = {k: v for k, v in self._ahead.items() if k[0] != setting.model} | {setting.key: data}

    def _checked(self, setting: Setting) -> torch.Tensor:
        """(n,) the samples compared with the loop (see :func:`.compute.checked_samples`)."""
        most = self.verdict_samples if setting.quantity == "grads" else self.verdict_samples_jacobian
        return compute.checked_samples(setting, most)

    def _sample(self, setting: Setting, data: Computed) -> SampleView:
        """The chosen sample's panel (:func:`.sample.sample_view`), with its output Jacobian for that quantity."""
        jac = None
        if setting.quantity == "jacobian":
            i = max(0, min(setting.sample, setting.batch - 1))
            one = Batch.of(data.x).sample(i)
            jac = per_sample_jacobian(data.model, inputs_of(one), flat=True, output=data.output)[0]  # (Y, P)
        return sample_view(setting, self.spec(setting), data, jac)

    # ------------------------------------------------------------------------------------------ timing

    def _methods(self, setting: Setting) -> list[str]:
        """Methods to time (not skipped), in the order given, then the references."""
        return [s for s in setting.strategies if self._skip_note(setting, s) is None] + list(REFERENCES)

    def _later(self, name: str, auto: str, setting: Setting) -> bool:
        """Timed once the rest is shown, unless cached at every batch size of the curve: a slow baseline (``auto``
        where it resolves to one), and where one result is over :data:`LARGE_RESULT` bytes every method but ``auto``'s
        (at B=256, hidden 512: torch_func 0.6 s a call, vmap writing the result twice, against hooks' 0.02-0.3 s)."""
        strategy = auto if name == "auto" else name
        later = REGISTRY[strategy].slow_baseline or (strategy != auto and self._result_size(setting) > LARGE_RESULT)
        curve = [dataclasses.replace(setting, batch=b) for b in self.scaling_batches(setting.batch)]
        return later and any(self.session.key(s, name) not in self.cache for s in curve if not self._skip_note(s, name))

    def _skip_note(self, setting: Setting, name: str) -> str | None:
        if name in REFERENCES:
            return None
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        strategy = "hooks" if name == "auto" else name
        work = backward_work(strategy, setting.quantity, setting.batch, outputs)
        limit = self.slow_limit if setting.slow_limit is None else setting.slow_limit
        if work > limit:
            return f"skipped: {work:,} sample-backward passes > slow_limit={limit:,}"
        return None

    def _calls(self, setting: Setting, data: Computed) -> dict[str, Callable[[], object]]:
        model, loss_fn, x, y = data.model, data.loss_fn, data.x, data.y
        params = [p for p in model.parameters() if p.requires_grad]
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        p = self.spec(setting).num_params(setting.hidden)
        shape = (setting.batch, p) if outputs == 1 else (setting.batch, outputs, p)
        batch = Batch.of(x)

        def forward_backward() -> object:
            return torch.autograd.grad(loss_fn(batch(model), y), params)

        floor: list[torch.Tensor] = []  # allocated at its first call (the warm-up's, untimed), where it is timed

        def memory_floor() -> torch.Tensor:
            if not floor:
                floor.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            return floor[0].fill_(0.5)

        calls: dict[str, Callable[[], object]] = {FORWARD_BACKWARD: forward_backward, MEMORY_FLOOR: memory_floor}
        for name in setting.strategies:
            if setting.quantity == "grads":
                calls[name] = (lambda s=name: per_sample_grads(model, loss_fn, x, y, strategy=s, flat=True))
            else:
                calls[name] = lambda s=name: per_sample_jacobian(model, x, strategy=s, flat=True, output=data.output)
        return calls

    def _time_setting(self, setting: Setting, data: Computed | None, poll: Callable[[], None],
                      rounds: int | None = None, *, methods: Sequence[str], have: Sequence[Record] = (),
                      budget: Budget | None = None) -> Iterator[Progress]:
        """Time ``methods`` at the setting (:meth:`.session.TimingSession.time_setting`)."""
        skipped = [Record(s, setting.quantity, setting.batch, setting.hidden, None, None,
                                self._result_size(setting), note=note)
                   for s in setting.strategies if (note := self._skip_note(setting, s)) is not None]
        return self.session.time_setting(
            setting, data, poll, methods=methods, have=have, budget=budget, skipped=skipped,
            result_bytes=self._result_size(setting), prepare=lambda: self._prepare(setting, data),
            describe_auto=lambda: "auto = " + resolve_strategy("auto", data.model, data.x), rounds=rounds)

    def _prepare(self, setting: Setting, data: Computed) -> Calls:
        """The calls to time, with the loop's reference of the checked samples (computed here for the scaling
        curve's smaller batches, which drew no verdict)."""
        calls = self._calls(setting, data)
        if data.reference is None and data.unchecked is None:
            data.checked = self._checked(setting)
            data.reference = compute.loop_rows(data.model, data.loss_fn, data.x, data.y, data.checked,
                                               setting.quantity, data.output)
        return calls

    def _result_size(self, setting: Setting) -> int:
        outputs = self.outputs(setting) if setting.quantity == "jacobian" else 1
        return result_bytes(setting.batch, self.spec(setting).num_params(setting.hidden), self.dtype, outputs)

