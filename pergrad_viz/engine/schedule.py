"""When the per-call check runs: on the first calls of every plan, then within a share of the time spent.

A check (:mod:`pergrad_viz.engine.certify`) costs about one plain forward and backward of the batch: on a call
whose fast path is 1.5-3x that, a check of every call would be a third to a half of its cost. So the check is
amortised, per model, input signature (the plan's key, :func:`pergrad_viz.engine.plan_key.plan_key`: a change of
structure, of a flag a forward may branch on, of the inputs' shapes or dtypes starts a new schedule), quantity and
strategy:

* the first :data:`FIRST` calls are always checked (a plan that is wrong for every batch, a rule that is wrong, a
  misplaced row: caught on the first call);
* after them a call is checked when the time spent on checks, with this one's expected cost (the last one's),
  stays within :data:`SHARE` of the time spent computing, both counted from the call after them (the first calls
  and checks pay one-time costs: a first check's start-up, 1 s, would starve a 1 ms call's checks for 10,000
  calls). Over many calls the checks cost at most that share, on any device: it is a share of measured time, not a
  count.
* and a ``hooks`` call whose graph between the layers (``engine.unplanned``) no passed check saw yet, up to
  :data:`GRAPHS` of them per plan: a forward that a flag or the data switches to another path between the layers
  after the first calls (a coupling of the samples, ``h * x.sum(0)``) is checked on the first batch that takes it.

The same account keeps ``auto``'s choice between two sound strategies (:class:`Race`): where the probe lets
``hooks`` run, ``torch_func`` is timed too on a few early calls, and ``auto`` runs the faster from then on, so it is
never slower than ``vmap(grad(functional_call))`` for long.

On CUDA the call's time is read without a synchronisation (the check ends with a host read, which does wait): a
call whose kernels are still running when it returns counts for less, so checks run less often, never more.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.plan_key import call_key
from pergrad_viz.engine.probe import remember

FIRST = 2  # calls of a new plan that are always checked
GRAPHS = 32  # graphs between the layers per plan whose first call is always checked
SHARE = 0.10  # of the time spent computing, at most, spent on checks after them
RECENT = 16  # calls whose median time per sample is a typical call's (for what a check makes the next one pay)
MARGIN = 0.8  # auto takes torch_func over hooks where its best time is under this share of hooks' best
WARMED = {"torch_func": False}  # whether this process has timed a torch.func call in a race (its first is cold)


@dataclass
class Schedule:
    """The check's account for one (model, input signature, quantity, strategy).

    A check's cost is its own time and what it makes the next call pay: its references' memory, freed, leaves glibc's
    heap trimmed, and the next call faults its tensors' pages in again (MLP(784, 512, 10)'s DP step at B=32: 2.5 ms
    after a check against 1.6 ms, its check 1.3 ms; the checks were 18-20% of the calls' time, not 10%). So a call
    right after a check counts its time beyond a typical call's (the median per sample of the last :data:`RECENT`
    calls no check preceded, times its batch size) as the check's."""

    calls: int = 0
    checks: int = 0
    compute_seconds: float = 0.0
    check_seconds: float = 0.0
    last_check: float = 0.0
    recent: list[float] = field(default_factory=list)  # seconds per sample of the last calls no check preceded
    check_before: bool = False  # the previous call was checked
    checked: bool = False  # this call was checked

    def due(self) -> bool:
        """Whether the call being made now is checked."""
        if self.calls < FIRST:
            return True
        return self.check_seconds + self.last_check <= SHARE * self.compute_seconds

    def computed(self, seconds: float, batch: int = 1) -> None:
        """A call of ``batch`` samples computed its result in ``seconds`` (before any check). The first
        :data:`FIRST` calls and their checks stay out of the account: they are always made, and pay one-time costs
        (a first check's start-up took 1 s against 4 ms after it, and starved the checks of a 1 ms call for 10,000
        calls; a first call's 0.33 s would allow a run of checks)."""
        self.calls += 1
        if self.calls <= FIRST:
            self.check_before = self.checked = False
            return
        self.compute_seconds += seconds
        if not self.check_before:
            self.recent = [*self.recent[1 - RECENT:], seconds / max(batch, 1)]
        elif self.recent:  # what this call paid beyond a typical one is the previous check's
            spill = max(0.0, seconds - statistics.median(self.recent) * batch)
            self.check_seconds += spill
            self.last_check += spill
        self.check_before, self.checked = self.checked, False

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Times the check run inside (counted even when it fails; a check of the first calls as the next one's
        expected cost only)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last_check = time.perf_counter() - start
            if self.calls >= FIRST:
                self.check_seconds += self.last_check
            self.checks += 1
            self.checked = True


_SCHEDULES: weakref.WeakKeyDictionary[nn.Module, OrderedDict[tuple, dict[tuple, Schedule | Race]]] = (
    weakref.WeakKeyDictionary())  # per model, per plan key (as many as the plans kept: ``probe.remember``)


@dataclass
class Race:
    """Which of two sound strategies ``auto`` runs for one (model, input signature, quantity, batch size): the fast
    path (``hooks``) for its first :data:`FIRST` calls, then ``torch_func`` once; where that took less than
    :data:`MARGIN` of the fast path's best time, ``torch_func`` once more, and from then on ``torch_func`` if its best
    is still under that margin, else ``hooks`` (on a noisy machine a wrong pick costs more than a missed one). A
    strategy that failed (it could not run, or its check failed) loses the race. The process's first timed
    ``torch_func`` call is not counted (:data:`WARMED`): it pays torch.func's start-up."""

    times: dict[str, list[float]]
    lost: set[str]

    def order(self) -> tuple[str, str]:
        """The strategy to run for this call, then the one to hand over to."""
        hooks, func = self.times["hooks"], self.times["torch_func"]
        if "torch_func" in self.lost or len(hooks) < FIRST:
            return "hooks", "torch_func"
        if "hooks" in self.lost:
            return "torch_func", "hooks"
        ahead = bool(func) and min(func) < MARGIN * min(hooks)
        if not func or (len(func) < 2 and ahead):
            return "torch_func", "hooks"
        return ("torch_func", "hooks") if ahead else ("hooks", "torch_func")

    def ran(self, strategy: str, seconds: float) -> None:
        if strategy == "torch_func" and not WARMED["torch_func"]:
            # The process's first torch.func call pays torch.func's start-up (0.9 s on 2 cores against 3 ms the
            # next), which would lose it every race it could win: not counted, so that it runs again.
            WARMED["torch_func"] = True
            return
        if strategy in self.times and len(self.times[strategy]) < 2 * FIRST:
            self.times[strategy].append(seconds)

    def lose(self, strategy: str) -> None:
        self.lost.add(strategy)


def _kept(trainable: Trainable, inputs: Batch) -> dict:
    key = call_key(trainable, inputs)  # read by the probe's plan_for in this call, if it ran
    kept = _SCHEDULES.get(trainable.model)
    if kept is None:
        kept = _SCHEDULES[trainable.model] = OrderedDict()
    schedules = kept.get(key)
    return remember(kept, key, {} if schedules is None else schedules)


def schedule_for(trainable: Trainable, inputs: Batch, quantity: str, strategy: str) -> Schedule:
    """The schedule of ``quantity`` ("grads", "jacobian", "norms") by ``strategy`` for this model on inputs like
    ``inputs``: a new one (its first calls checked) whenever the plan's key changed."""
    return _kept(trainable, inputs).setdefault((quantity, strategy), Schedule())


def race_for(trainable: Trainable, inputs: Batch, quantity: str) -> Race:
    """The :class:`Race` between ``hooks`` and ``torch_func`` for this model, input signature, quantity and batch
    size (kept with the schedules: a new one whenever the plan's key changed)."""
    return _kept(trainable, inputs).setdefault(("race", quantity, inputs.size),
                                               Race({"hooks": [], "torch_func": []}, set()))


def forget(model: nn.Module) -> None:
    """Drop ``model``'s schedules: its next calls are checked as a new plan's are."""
    _SCHEDULES.pop(model, None)


def unseen_graphs(trainable: Trainable) -> set:
    """The graphs between the layers this call took that no passed check of its plan saw (while it has seen fewer
    than :data:`GRAPHS`): the call is checked, and :func:`seen_graphs` notes them once the check passed."""
    plan = trainable.call.plan
    if plan is None or len(plan.graphs) >= GRAPHS:
        return set()
    return trainable.call.graphs - plan.graphs


def seen_graphs(trainable: Trainable, graphs: set) -> None:
    """Note ``graphs`` (from :func:`unseen_graphs`) as seen by a passed check of the call's plan."""
    if graphs:
        trainable.call.plan.graphs |= graphs
