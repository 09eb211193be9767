"""Interleaved timing: several methods measured in rounds, so that a stall hits every method alike.

Timing one method after another on a shared machine compares methods under different loads: a burst of
other work during one method's turn makes it look slow, and its rank flips. Here every round times each
method once (a *block* of a few calls), in an order that rotates and, every other round, runs backwards (so no
method always follows the same one, whose memory churn it would inherit), and the statistics come from the
rounds::

    >>> from pergrad_viz.timing import time_interleaved
    >>> t = time_interleaved({"a": f, "b": g}, rounds=7)       # {name: Timing}
    >>> t["a"].median_s, t["a"].iqr_s, t["a"].noisy

A :class:`Timing` is noisy when its interquartile range is large against its median (default: more than
25%): such a number should be shown with a warning and measured again, never cached. Pure functions of the
callables given; nothing here knows of strategies, widgets or plots (``bench`` and the explorer build on it).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "NOISE_THRESHOLD",
    "Timing",
    "drifted",
    "headroom_threads",
    "plan_tiers",
    "summarize",
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
            for is stale). synchronize: called before each clock reading (e.g. ``torch.cuda.synchronize``).
        clock: seconds, monotonic.

    Returns:
        ``{name: Timing}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(fns)
    sync = synchronize or (lambda: None)
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
