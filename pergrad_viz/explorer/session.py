"""The explorer's timing session: a setting's methods timed tier by tier in interleaved rounds
(:func:`pergrad_viz.bench.timing.time_adaptive`), and the cache of settled timings.

Timings are cached by everything that affects them (:class:`~pergrad_viz.explorer.state.TimingKey`: model,
quantity, batch size, width, method, dtype, device, threads); a noisy one (its median still uncertain after the
extra rounds, or the anchor drifted between tiers) is flagged (``Record.noisy``) and never cached.

The process is the user's: the explorer's thread count is set for each step of its work and the user's restored
after it (:meth:`TimingSession.stepwise`), never left changed while the explorer waits or draws; on CUDA every
clock reading waits for the device first (:func:`synchronizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn

from pergrad_viz.bench import timing
from pergrad_viz.bench.records import MEMORY_FLOOR, Record, failed_note
from pergrad_viz.explorer.state import ANCHOR, REFERENCES, Budget, Computed, Setting, TimingKey

__all__ = ["TimingSession", "clock", "intra_op_threads", "synchronizer"]

T = TypeVar("T")

Calls = dict[str, Callable[[], object]]
Progress = tuple[list[Record], tuple[str, ...], int, tuple[str, ...]]


@dataclasses.dataclass(eq=False)
class TimingSession:
    """Times settings' methods and keeps the settled timings (:attr:`cache`). The fields are the arguments of
    :class:`~pergrad_viz.explorer.model.ExplorerModel` of the same names:

    Args:
        rounds, min_rounds: rounds of a tier's first pass (:func:`pergrad_viz.bench.timing.time_adaptive`): ``rounds``,
            fewer (down to ``min_rounds``) where they would take more than ``tier_budget_s`` seconds (the slow
            baselines, from about 30 ms a call: their first pass is short, and extra rounds follow only where its
            spread leaves the median uncertain).
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
    """

    rounds: int
    min_rounds: int
    max_rounds: int
    patience_s: float
    tier_budget_s: float
    round_budget_s: float
    prior_min_s: float
    min_block_s: float
    noise_threshold: float
    drift: float
    dtype: torch.dtype
    device: str
    threads: int
    cache: dict[TimingKey, Record] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.min_rounds = min(self.min_rounds, self.rounds)
        self.max_rounds = max(self.max_rounds, self.rounds)

    def stepwise(self, steps: Iterator[T]) -> Iterator[T]:
        """``steps`` (a generator), each step run with :attr:`threads` intra-op threads and the process's own
        count restored before it is yielded: the user's cells, run meanwhile, keep theirs."""
        try:
            while True:
                with intra_op_threads(self.threads):
                    try:
                        item = next(steps)
                    except StopIteration:
                        return
                yield item
        finally:
            steps.close()

    def key(self, setting: Setting, method: str) -> TimingKey:
        return TimingKey(setting.model, setting.quantity, setting.batch, setting.hidden, method, str(self.dtype),
                         str(self.device), self.threads)

    def untimed(self, setting: Setting, methods: Sequence[str], have: Sequence[Record] = ()) -> list[str]:
        """Those of ``methods`` neither in ``have`` (timed earlier in this visit) nor in the cache."""
        done = {r.strategy for r in have if not r.skipped}
        return [m for m in methods if m not in done and self.key(setting, m) not in self.cache]

    def time_setting(self, setting: Setting, data: Computed | None, poll: Callable[[], None], *, methods: Sequence[str],
                     skipped: Sequence[Record], result_bytes: int, prepare: Callable[[], Calls],
                     describe_auto: Callable[[], str], rounds: int | None = None,
                     have: Sequence[Record] = (), budget: Budget | None = None) -> Iterator[Progress]:
        """Time the setting's ``methods`` tier by tier; yields (records so far, methods pending, records reused,
        methods provisional). ``skipped``: the records of the methods skipped as too slow (shown last);
        ``data``: what the setting computed (None will do where nothing is to be timed: all cached or in ``have``);
        ``prepare()``: the calls to time, ``{method: no-argument callable}``, with ``data.reference`` set (called
        only when something is to be timed); ``describe_auto()``: the note of ``"auto"`` (what it resolves to).
        ``rounds``: a first pass of at most this many (default: the session's; the scaling curve's smaller batches
        use fewer, and fewer extra rounds). ``have``: records timed earlier in this visit (an earlier phase's, noisy
        ones too): kept as they are, not timed again, not counted as reused. ``budget``: the seconds of extra rounds
        left for the setting, shared by the phases of a visit (default: a fresh one, :attr:`patience_s`, half that
        with ``rounds``)."""
        most = self.rounds if rounds is None else rounds
        skipped = list(skipped)
        done = {r.strategy: dataclasses.replace(r) for r in have if not r.skipped}
        reused = 0
        for name in methods:
            hit = self.cache.get(self.key(setting, name))
            if name not in done and hit is not None:
                done[name] = dataclasses.replace(hit)
                reused += 1
        todo = [m for m in methods if m not in done]
        if not todo:  # the ratios among these rows (a cached row's "vs loop" was of its own visit's rows)
            relate(done, {n: r.vs_forward_backward for n, r in done.items() if r.vs_forward_backward is not None})
            yield ordered(done, skipped), (), reused, ()
            return
        sync = synchronizer(data.model, self.device)
        calls = prepare()
        warm = [*todo, *([ANCHOR] if ANCHOR not in todo else [])]
        estimates, diffs, prior, failed = self.warm_up(setting, data, calls, warm, poll, sync)
        if failed:  # shown after the skipped ones, with why; never cached: the next visit tries again
            skipped += [Record(m, setting.quantity, setting.batch, setting.hidden, None, None, result_bytes,
                               note=note) for m, note in failed.items()]
            todo = [m for m in todo if m not in failed]
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
        auto = describe_auto() if "auto" in todo else ""
        if budget is None:  # for the extra rounds, in all
            budget = Budget(self.patience_s if rounds is None else self.patience_s / 2)
        for tier in tiers:
            fns = {m: calls[m] for m in tier}
            fns.setdefault(ANCHOR, calls[ANCHOR])
            cost = sum(max(estimates[m], self.min_block_s) for m in fns)
            first = max(self.min_rounds, min(most, int(self.tier_budget_s / cost)))
            patience = timing.Patience(rounds=first, max_rounds=max(first, self.max_rounds if rounds is None
                                                                    else 2 * first),
                                       budget_s=max(0.0, budget.left_s), threshold=self.noise_threshold)
            extra_since: float | None = None
            for result, final in timing.time_adaptive(fns, patience=patience, estimates=estimates,
                                                      min_block_s=self.min_block_s, check=poll, synchronize=sync,
                                                      prior={m: prior[m] for m in fns if m in prior}):
                if not final and extra_since is None:
                    extra_since = clock(sync)
                elif final and extra_since is not None:
                    budget.left_s -= clock(sync) - extra_since
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
                    record = Record(m, setting.quantity, setting.batch, setting.hidden, t.median_s, t.iqr_s,
                                          result_bytes, max_abs_diff=diffs.get(m), note=note, noisy=noisy)
                    record.vs_forward_backward = ratios[m]
                    done[m] = record
                relate(done, ratios)
                if not final:
                    yield ordered(done, skipped), tuple(p for p in methods if p in pending), reused, tuple(tier)
                    continue
                if anchor_ref is None:
                    anchor_ref = anchor
                for m in tier:
                    pending.remove(m)
                    if not done[m].noisy and m not in (data.unchecked or ()):  # those: once checked
                        self.cache[self.key(setting, m)] = dataclasses.replace(done[m])
                yield ordered(done, skipped), tuple(p for p in methods if p in pending), reused, ()

    def check_late(self, setting: Setting, data: Computed, records: Sequence[Record]) -> list[Record]:
        """``records`` with the differences from the loop (``data.reference``, in now) of the methods timed before
        it ran (``data.unchecked``); those are cached now (unless noisy)."""
        unchecked, data.unchecked, out = data.unchecked or {}, None, []
        for r in records:
            if r.strategy in unchecked:
                rows = unchecked[r.strategy]
                got = data.grads[data.checked] if rows is None else rows
                r = dataclasses.replace(r, max_abs_diff=float(torch.linalg.vector_norm(got - data.reference,
                                                                                      ord=math.inf)))
                if not r.noisy:
                    self.cache[self.key(setting, r.strategy)] = dataclasses.replace(r)
            out.append(r)
        return out

    def warm_up(self, setting: Setting, data: Computed, calls: Calls, names: list[str], poll: Callable[[], None],
                sync: Callable[[], None] | None = None
                ) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]], dict[str, str]]:
        """One call of each method: its cost (to plan the tiers and size the blocks) and, for strategies, its
        max |difference| from the loop on the checked samples (``data.reference``). Returns (estimates,
        differences, prior, failed): a call that took at least ``prior_min_s`` counts as the method's first round
        (timing it again would cost more than it tells); a strategy that raised (``torch_func`` on a model
        ``torch.func`` cannot run, an explicit strategy that refuses it) is not timed: ``failed`` {method: its note,
        the error's first line}, so that the other methods' rows still come. ``sync``: called before each clock reading
        (CUDA)."""
        estimates: dict[str, float] = {}
        diffs: dict[str, float] = {}
        prior: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        idx, reference = data.checked, data.reference
        for m in names:
            if m == "hooks" and setting.quantity == "grads" and data.hooks_s is not None:
                estimates[m] = data.hooks_s  # the heatmap's gradients: this call, just made
                if reference is None:  # the loop runs later: :meth:`check_late`
                    data.unchecked[m] = None
                else:
                    diffs[m] = float(torch.linalg.vector_norm(data.grads[idx] - reference, ord=math.inf))
                continue  # an estimate, never a round: that call was cold (the first of a plan: its probe too)
            poll()
            start = clock(sync)
            try:
                out = calls[m]()
            except Exception as e:  # the references are the model's own: their errors are the setting's
                if m in REFERENCES:
                    raise
                failed[m] = failed_note(e, limit=240)
                continue
            estimates[m] = clock(sync) - start
            if estimates[m] >= self.prior_min_s:
                prior[m] = [estimates[m]]
            if m in REFERENCES:
                continue
            rows = out.reshape(setting.batch, -1)[idx] if isinstance(out, torch.Tensor) else out
            if reference is None:  # kept for :meth:`check_late`, unless they are the heatmap's
                same = setting.quantity == "grads" and torch.equal(rows, data.grads[idx])
                data.unchecked[m] = None if same else rows
            else:
                diffs[m] = float(torch.linalg.vector_norm(rows - reference, ord=math.inf))
            del out, rows
        return estimates, diffs, prior, failed


def relate(done: dict[str, Record], ratios: dict[str, float]) -> None:
    """Speed-up vs the loop and time vs the memory floor, as ratios of each one's ratio to the anchor of its
    own tier: comparable across tiers even if the load changed between them."""
    loop, floor = ratios.get("loop"), ratios.get(MEMORY_FLOOR)
    for name, r in done.items():
        if r.skipped or name not in ratios:
            continue
        r.speedup_vs_loop = loop / ratios[name] if loop else None
        r.vs_memory_floor = ratios[name] / floor if floor else None


def ordered(done: dict[str, Record], skipped: list[Record]) -> list[Record]:
    """The strategies timed so far, fastest first (cheap tiers finish first, so the chart grows downwards), then
    the references, then the skipped ones."""
    strategies = sorted((r for name, r in done.items() if name not in REFERENCES), key=lambda r: r.median_s)
    return [*strategies, *(done[n] for n in REFERENCES if n in done), *skipped]


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count at ``threads`` inside the block, as it was before after it (torch's setting
    is the process's: the block should not wait for anyone)."""
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def synchronizer(model: nn.Module, device: str | torch.device) -> Callable[[], None] | None:
    """What to call before each clock reading: ``torch.cuda.synchronize`` on every CUDA device of ``model``'s
    parameters and buffers and ``device`` (None when none is a CUDA device)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())} | {torch.device(device)}
    cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
    if not cuda:
        return None

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    return sync


def clock(sync: Callable[[], None] | None = None) -> float:
    """``time.perf_counter()``, after ``sync()`` (the device's queued work done) where given."""
    if sync is not None:
        sync()
    return time.perf_counter()
