"""Interleaved timing: several methods measured in rounds, so that a stall hits every method alike.

Timing one method after another on a shared machine compares methods under different loads: a burst of
other work during one method's turn makes it look slow, and its rank flips. Here every round times each
method once (a *block* of a few calls), in an order that rotates and, every other round, runs backwards (so no
method always follows the same one, whose memory churn it would inherit), and the statistics come from the
rounds::

    >>> from pergrad_viz.bench.timing import time_interleaved
    >>> t = time_interleaved({"a": f, "b": g}, rounds=7)       # {name: Timing}
    >>> t["a"].median_s, t["a"].iqr_s, t["a"].noisy

A :class:`Timing` is noisy when its interquartile range is large against its median (default: more than
25%): such a number should be shown with a warning and measured again, never cached.

On a shared machine a few rounds are often spread by a stall or two, although the median is fine.
:func:`time_adaptive` therefore keeps measuring where it matters: after a first pass it adds rounds (with
longer blocks, which average short stalls out) while some median is still uncertain, within a bound of rounds
and of seconds (a :class:`Patience`), and only what is still uncertain then is flagged::

    >>> for timings, final in time_adaptive({"a": f, "b": g}, patience=Patience(rounds=5, max_rounds=15)):
    ...     show(timings, provisional=not final)    # the first pass at once, the settled numbers after

A median counts as uncertain when the half-width of its 95% confidence interval, ``1.57 IQR / sqrt(n)``
(the notches of a box plot: McGill, Tukey and Larsen 1978), is more than ``Patience.threshold`` of it.
On CUDA, work is queued and the clock would stop before it ran: every clock reading is preceded by a
synchronisation (:func:`synchronizer`: ``torch.cuda.synchronize`` whenever CUDA is in use in the process, unless a
``synchronize`` is given). Pure functions of the callables given; nothing here knows of strategies, widgets or
plots (``bench`` and the explorer build on it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pergrad_viz.engine import schedule

__all__ = [
    "NOISE_THRESHOLD",
    "Patience",
    "Timing",
    "drifted",
    "headroom_threads",
    "plan_tiers",
    "summarize",
    "synchronizer",
    "time_adaptive",
    "time_interleaved",
]

NOISE_THRESHOLD = 0.25  # IQR / median above this: noisy
MIN_BLOCK_S = 2e-3  # a block (one sample) lasts at least this long: many calls of a fast method per block


@dataclass(frozen=True)
class Timing:
    """The time per call of one method, from ``len(samples)`` rounds.

    Attributes:
        median_s: median time per call (seconds) over the rounds.
        iqr_s: interquartile range (q3 - q1) of the per-call times over the rounds.
        q1_s, q3_s: the quartiles.
        samples: the time per call measured in each round, in round order.
        number: calls per block (each sample is a block's time / number).
        noisy: ``iqr_s / median_s`` above the threshold (or a non-finite time).
    """

    median_s: float
    iqr_s: float
    q1_s: float
    q3_s: float
    samples: tuple[float, ...]
    number: int
    noisy: bool

    @property
    def spread(self) -> float:
        """IQR / median: 0.1 means the middle half of the rounds lie within about ±5% of the median."""
        return self.iqr_s / self.median_s if self.median_s > 0 else math.inf

    @property
    def uncertainty(self) -> float:
        """The half-width of the median's 95% confidence interval, as a fraction of the median:
        ``1.57 IQR / sqrt(rounds) / median`` (infinite for a non-finite or non-positive median)."""
        finite = all(math.isfinite(v) for v in self.samples) and self.median_s > 0
        return 1.57 * self.spread / math.sqrt(len(self.samples)) if finite and self.samples else math.inf


def paired_ratio(timing: Timing, base: Timing) -> float:
    """``timing`` / ``base`` as the median of each round's own ratio (both from one :func:`time_interleaved` run, a
    sample per round): this shared machine has spells, seconds long, in which every step runs up to 1.7x slower
    (a plain transformer step 3.6-3.8 ms, then 6.2-6.5 ms, in one process), and a round's methods share its spell."""
    if len(timing.samples) != len(base.samples):  # not one run's rounds (prior samples): the medians' ratio
        return timing.median_s / base.median_s if base.median_s > 0 else math.nan
    pairs = [t / b for t, b in zip(timing.samples, base.samples, strict=True) if b > 0 and math.isfinite(t / b)]
    return float(np.median(pairs)) if pairs else math.nan


def summarize(samples: Sequence[float], *, number: int = 1, noise_threshold: float = NOISE_THRESHOLD) -> Timing:
    """A :class:`Timing` from per-call times (one per round): median, quartiles, and the noisy flag."""
    if not samples:
        raise ValueError("no samples to summarize: time at least one round")
    values = np.asarray(samples, dtype=np.float64)
    q1, median, q3 = (float(v) for v in np.percentile(values, [25, 50, 75]))
    iqr = q3 - q1
    finite = bool(np.isfinite(values).all()) and median > 0
    noisy = not finite or iqr / median > noise_threshold
    return Timing(median, iqr, q1, q3, tuple(float(v) for v in values), number, noisy)


def synchronizer(device: torch.device | str | None = None) -> Callable[[], None]:
    """What to call before each clock reading so that the clock sees the work done: for a CUDA ``device``,
    ``torch.cuda.synchronize(device)``; without a device, ``torch.cuda.synchronize()`` (the current device) when
    CUDA has been initialised in this process (so some work may be queued there); otherwise nothing."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return _nothing
        return functools.partial(torch.cuda.synchronize, device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return _nothing


def _nothing() -> None:
    pass


def _block_number(estimate_s: float, min_block_s: float, max_number: int) -> int:
    """Calls per block so that a block lasts at least ``min_block_s`` (1 for a slow call)."""
    if not math.isfinite(estimate_s):
        return 1
    if estimate_s <= 0:
        return max_number
    return max(1, min(max_number, math.ceil(min_block_s / estimate_s)))


def time_interleaved(fns: Mapping[str, Callable[[], object]], *, rounds: int = 5,
                     estimates: Mapping[str, float] | None = None, min_block_s: float = MIN_BLOCK_S,
                     max_number: int = 10_000, warmup: bool = True, noise_threshold: float = NOISE_THRESHOLD,
                     prior: Mapping[str, Sequence[float]] | None = None,
                     check: Callable[[], None] | None = None, synchronize: Callable[[], None] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time each callable in ``rounds`` interleaved rounds; returns ``{name: Timing}`` in the order given.

    Each round times every method once, as a block of ``number`` back-to-back calls (chosen per method so
    that a block lasts at least ``min_block_s``); round r starts with method r mod K, so no method is always
    first after a pause. A stall (another process, the garbage collector) then lands in one round of every
    method alike instead of in all rounds of one method, and shows as spread.

    Args:
        fns: ``{name: no-argument callable}``; their results are dropped.
        rounds: samples per method (at least 1; 5-7 give a usable IQR).
        estimates: seconds per call, if known (e.g. from an earlier call); otherwise one warm-up call each
            measures it (first calls pay for caches, lazy initialisation, page faults). Methods with an
            estimate or ``prior`` samples are not called before the rounds; without ``warmup`` none is (and a
            method without an estimate is timed one call per block).
        min_block_s, max_number: block length and the most calls per block.
        noise_threshold: a :class:`Timing` is noisy above this IQR / median.
        prior: ``{name: [seconds per call, ...]}`` already measured for a method (e.g. an expensive first call
            that was timed anyway): counted as its first rounds, which it then sits out.
        check: called before every block; raise from it to abandon the measurement (e.g. the setting it was
            for is stale).
        synchronize: called before each clock reading; default :func:`synchronizer` ``()``, which synchronises
            CUDA whenever it is in use in this process.
        clock: seconds, monotonic.

    Returns:
        ``{name: Timing}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(fns)
    sync = synchronize or synchronizer()
    poll = check or (lambda: None)
    known = dict(estimates or {})
    earlier = {name: list((prior or {}).get(name, ())) for name in names}
    for name in names:
        if name in known or earlier[name] or not warmup:
            continue
        poll()
        sync()
        start = clock()
        fns[name]()
        sync()
        known[name] = clock() - start
    for name in names:
        if name not in known:
            known[name] = min(earlier[name]) if earlier[name] else math.inf
    numbers = {name: _block_number(known[name], min_block_s, max_number) for name in names}
    samples: dict[str, list[float]] = {name: earlier[name][:rounds] for name in names}
    for r in range(rounds):
        order = [names[(r + k) % len(names)] for k in range(len(names))]
        if r % 2:
            order.reverse()
        for name in order:
            if r < len(earlier[name]):
                continue
            fn, number = fns[name], numbers[name]
            poll()
            sync()
            start = clock()
            for _ in range(number):
                fn()
            sync()
            samples[name].append((clock() - start) / number)
    return {name: summarize(samples[name], number=numbers[name], noise_threshold=noise_threshold)
            for name in names}


@dataclass(frozen=True)
class Patience:
    """How long :func:`time_adaptive` keeps measuring while medians are uncertain.

    Attributes:
        rounds: rounds of the first pass (its numbers are shown at once, as provisional).
        max_rounds: at most this many rounds in all.
        budget_s: the extra rounds take at most about this long in all (no pass starts that would run past it,
            by the round cost measured so far).
        threshold: a median is settled when the half-width of its 95% confidence interval is at most this
            fraction of it (:attr:`Timing.uncertainty`); still above after the extra rounds: noisy.
        block_growth, max_block_s: each extra pass times blocks this many times longer than the previous one (up
            to ``max_block_s``): a block then spans a stall of the machine instead of being one.
    """

    rounds: int = 5
    max_rounds: int = 15
    budget_s: float = 1.5
    threshold: float = 0.15
    block_growth: float = 2.0
    max_block_s: float = 0.02

    def settled(self, t: Timing) -> bool:
        """Whether ``t``'s median is known well enough (see :attr:`threshold`)."""
        return t.uncertainty <= self.threshold

    def extra_rounds(self, timings: Sequence[Timing], *, rounds_done: int, spent_s: float, round_s: float) -> int:
        """How many rounds to add now: 0 when every median is settled, the rounds are used up or the budget
        would be passed; else up to as many as were done (the number of rounds doubles per pass), within what
        remains of ``max_rounds`` and of the budget at ``round_s`` seconds a round."""
        if all(self.settled(t) for t in timings):
            return 0
        left = self.max_rounds - rounds_done
        affordable = math.floor((self.budget_s - spent_s) / round_s) if round_s > 0 else left
        return max(0, min(left, affordable, max(2, rounds_done)))


def time_adaptive(fns: Mapping[str, Callable[[], object]], *, patience: Patience = Patience(),
                  min_block_s: float = MIN_BLOCK_S, clock: Callable[[], float] = time.perf_counter,
                  **options) -> Iterator[tuple[dict[str, Timing], bool]]:
    """Time ``fns`` interleaved (:func:`time_interleaved`), adding rounds while a median is uncertain.

    Yields ``({name: Timing}, final)``: the first pass's timings (``final`` False when more rounds follow: show
    them as provisional), then after each pass of extra rounds; the last yield has ``final`` True, and there a
    :class:`Timing` is ``noisy`` exactly when its median is still not settled (:meth:`Patience.settled`). Every
    pass interleaves all methods again (their ratios stay comparable), its blocks ``block_growth`` times longer.

    Args:
        fns: ``{name: no-argument callable}``.
        patience: rounds, limits and the settling threshold. min_block_s: the first pass's block length.
        clock: seconds, monotonic (also what the budget is measured with).
        options: more :func:`time_interleaved` arguments (``estimates``, ``prior``, ``check``,
            ``synchronize``, ``max_number``, ``warmup``), for the first pass; later passes use the medians so
            far as estimates and run no warm-up.
    """
    if patience.rounds < 1 or patience.max_rounds < patience.rounds:
        raise ValueError(f"need 1 <= rounds <= max_rounds, got {patience.rounds} and {patience.max_rounds}")
    sync = options.pop("synchronize", None) or synchronizer()
    later = {k: v for k, v in options.items() if k in ("check", "max_number")}
    result = time_interleaved(fns, rounds=patience.rounds, min_block_s=min_block_s, clock=clock, synchronize=sync,
                              **options)
    done, block, spent = patience.rounds, min_block_s, 0.0
    while True:
        block = min(max(block * patience.block_growth, min_block_s), max(patience.max_block_s, min_block_s))
        round_s = sum(max(t.median_s, block) if math.isfinite(t.median_s) else block for t in result.values())
        extra = patience.extra_rounds(list(result.values()), rounds_done=done, spent_s=spent, round_s=round_s)
        if extra == 0:
            yield {n: dataclasses.replace(t, noisy=not patience.settled(t)) for n, t in result.items()}, True
            return
        yield result, False
        sync()
        start = clock()
        result = time_interleaved(fns, rounds=done + extra, min_block_s=block, clock=clock, warmup=False,
                                  estimates={n: t.median_s for n, t in result.items()},
                                  prior={n: list(t.samples) for n, t in result.items()}, synchronize=sync, **later)
        sync()
        spent += clock() - start
        done += extra


def plan_tiers(estimates: Mapping[str, float], *, round_budget_s: float, first: Sequence[str] = ()
               ) -> list[list[str]]:
    """Group methods, cheapest first, into tiers whose one round costs at most ``round_budget_s``.

    Methods in one tier are timed interleaved together (:func:`time_interleaved`); a tier is reported once
    it is done, so cheap methods show up first and an expensive one does not hold them back. ``first``
    (e.g. reference rows) join the first tier whatever they cost. Every method lands in exactly one tier; a
    method costlier than the budget gets a tier of its own.
    """
    order = sorted((n for n in estimates if n not in first), key=lambda n: (estimates[n], n))
    tiers: list[list[str]] = [list(first)]
    cost = sum(max(estimates.get(n, 0.0), MIN_BLOCK_S) for n in first)
    for name in order:
        block = max(estimates[name], MIN_BLOCK_S)
        if tiers[-1] and cost + block > round_budget_s and any(n not in first for n in tiers[-1]):
            tiers.append([])
            cost = 0.0
        tiers[-1].append(name)
        cost += block
    return [t for t in tiers if t]


def drifted(reference: Timing, again: Timing, factor: float = 1.5) -> bool:
    """Whether two measurements of the same method (an anchor timed in two tiers) differ by more than
    ``factor``: the load changed in between, so numbers from the two are not comparable."""
    a, b = reference.median_s, again.median_s
    if not (a > 0 and b > 0):
        return True
    return max(a / b, b / a) > factor


def headroom_threads(cores: int | None = None) -> int:
    """Intra-op threads for timing that leave a core for everything else (the kernel, the browser, other
    processes): ``cores - 1``, at least 1; ``cores`` defaults to the CPUs this process may run on."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
    return max(1, cores - 1)


def steady_checks(model: nn.Module, calls: Sequence[Callable[[], object]]) -> None:
    """The per-call check's account as a long training loop has it, before timed rounds of ``calls`` (each a
    package call on ``model``). Calls before the rounds (a comparison's first results, memory measured under the
    profiler, several times slower) earn the check a share of their time, which the timed calls would spend on
    checks at nearly every call; and ``auto``'s first calls are its start-up, not its steady state: always checked
    (:data:`pergrad_viz.engine.schedule.FIRST`), then ``torch_func`` timed against ``hooks``
    (:class:`~pergrad_viz.engine.schedule.Race`). Timed from there (a warm-up call setting how many calls a block
    holds), an ``auto`` block of one slow call (MLP(784, 20, 10) at B=64: 1 call a block against 35 for
    ``verify=False``) read as a check of 36% of the call. So the account starts afresh and each call is made
    ``FIRST + 3`` times here; from then on the checks cost their share of the time, at most
    :data:`~pergrad_viz.engine.schedule.SHARE`, as in a long run (ResNet-18's DP step alone, 2 threads: 1.80x a
    plain step against 1.47x without the check before, 1.53x against 1.48x after). Where some timed calls are
    checked and some not (a check of about a fifth of a call, as on ResNet-18), a median of one-call blocks is
    either kind's: the amortised cost is the mean's, not the median's."""
    schedule.forget(model)
    for call in calls:
        for _ in range(schedule.FIRST + 3):
            call()
