"""Module attributes a forward changes on every call (a call counter: ``self.calls += 1``, ``self.step += 1``): each
change changes the plan's key (:mod:`~pergrad_viz.engine.plan_key`), so every call would probe the model again and
restart its check schedule (7x a call on a small MLP). Where a number attribute, and nothing else, changed and the
probe found the very same plan twice for it, the attribute is left out of this model's key from then on.

What a later value of it could still change is caught as any data-dependent behaviour is: a layer called another
number of times or on other shapes, a parameter used outside the planned layers (per call, ``PlanMismatchError``:
``auto`` hands over, and the numbers left out count again, :func:`forget`, so that the next call probes anew),
samples made to interact (the per-call check)."""

from __future__ import annotations

import weakref
from collections import Counter

from torch import nn

from pergrad_viz.engine.plan import Plan

SAME_PLANS = 2  # re-probes that must find the same plan before an attribute is left out
_NUMBERS = (int, float)

_SKIPPED: weakref.WeakKeyDictionary[nn.Module, dict[str, frozenset[str]]] = weakref.WeakKeyDictionary()
_SEEN: weakref.WeakKeyDictionary[nn.Module, Counter] = weakref.WeakKeyDictionary()


def skipped(model: nn.Module) -> dict[str, frozenset[str]]:
    """{module name: attribute names} left out of ``model``'s plan key (empty for almost every model)."""
    return _SKIPPED.get(model, _NONE)


_NONE: dict[str, frozenset[str]] = {}


def forget(model: nn.Module) -> None:
    """A call found the plan not fitting (another structure): every number left out of ``model``'s key counts again,
    so that the next call, whose key then differs, probes the model anew (a number that now changes the plan is
    not left out again)."""
    _SKIPPED.pop(model, None)
    _SEEN.pop(model, None)


def note_probe(model: nn.Module, old: tuple[tuple, Plan], key: tuple, plan: Plan) -> bool:
    """After a probe that a changed key caused (``old``: the cached (key, plan)): where the keys differ only in
    number attributes of modules and ``plan`` is the same as the old one, count each such attribute, and leave out
    those counted :data:`SAME_PLANS` times. Returns whether the attributes left out changed (the key must be read
    again)."""
    changed = _changed_numbers(old[0], key)
    if not changed or not _same_plan(old[1], plan):
        return False
    seen = _SEEN.setdefault(model, Counter())
    seen.update(changed)
    ready = [pair for pair in changed if seen[pair] >= SAME_PLANS]
    if not ready:
        return False
    now = dict(skipped(model))
    for name, attribute in ready:
        now[name] = now.get(name, frozenset()) | {attribute}
    _SKIPPED[model] = now
    return True


def differs_in_numbers(old: tuple, new: tuple) -> bool:
    """Whether the keys ``old`` and ``new`` differ in number attributes of modules alone (the plan of ``old`` is
    the one to compare a new probe's with: with batches of several lengths, the model's last plan is another
    length's, and a number changing every call would never be left out)."""
    return bool(_changed_numbers(old, new))


def _changed_numbers(old: tuple, new: tuple) -> list[tuple[str, str]] | None:
    """[(module name, attribute)] whose number values differ between the keys ``old`` and ``new``
    (``plan_key``'s); None where anything else differs (another input signature, module, hook, parameter, a
    setting that is not a number, a bool)."""
    if len(old) != len(new) or old[0] != new[0] or old[2:] != new[2:] or len(old[1]) != len(new[1]):
        return None
    changed = []
    for before, after in zip(old[1], new[1], strict=True):
        if before == after:
            continue
        if before[:-1] != after[:-1] or len(before[-1]) != len(after[-1]):
            return None
        for (k, v), (k2, v2) in zip(before[-1], after[-1], strict=True):
            if k != k2 or (v != v2 and not (_number(v) and _number(v2))):
                return None
            if v != v2:
                changed.append((before[0], k))
    return changed


def _number(v: object) -> bool:
    return isinstance(v, _NUMBERS) and not isinstance(v, bool)


def _same_plan(a: Plan, b: Plan) -> bool:
    """Whether the probe found the same plan: the same layers, each handled the same way on calls of the same
    shapes, and the same findings about the samples and hooks."""
    if (a.interaction, a.hooks_problem, a.verified) != (b.interaction, b.hooks_problem, b.verified):
        return False
    if a.layers.keys() != b.layers.keys():
        return False
    return all((x.kind, x.local, x.calls, x.spread) == (y.kind, y.local, y.calls, y.spread)
               for x, y in ((a.layers[n], b.layers[n]) for n in a.layers))
