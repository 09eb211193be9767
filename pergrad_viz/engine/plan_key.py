"""The key under which a plan (:mod:`pergrad_viz.engine.probe`) is cached: what can change it structurally, read
afresh on every call (a value changed since the plan was made must be seen)."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torch.nn.modules import module as module_mod

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable

_PLAIN = (bool, int, float, str, type(None))
_EXACTLY_PLAIN = frozenset(_PLAIN)  # a value of exactly one of these types is plain: no isinstance needed
_NEVER_PLAIN = frozenset((dict, OrderedDict, set))  # nn.Module's own bookkeeping (hooks, _parameters, ...)


def _plain_attributes(module: nn.Module) -> tuple:
    """The module's attributes that are plain values (bools, numbers, strings, None, tuples / lists of them): what a
    forward may branch on (``self.task``, ``self.center``), so a plan made with other values does not describe it.

    Read on every call (a value changed since the plan was made must be seen); the exact-type tests first only skip
    the ``isinstance`` calls (a subclass of a plain type, an ``IntEnum`` flag, still counts)."""
    items = []
    for k, v in module.__dict__.items():
        kind = type(v)
        if kind in _EXACTLY_PLAIN:
            items.append((k, v))
        elif kind in _NEVER_PLAIN:
            continue
        elif isinstance(v, _PLAIN):
            items.append((k, v))
        elif isinstance(v, (tuple, list)) and all(isinstance(e, _PLAIN) for e in v):
            items.append((k, tuple(v)))
    return tuple(items)


def plan_key(trainable: Trainable, inputs: Batch) -> tuple:
    """What a plan depends on, read afresh: the input signature; per module its name, identity, type, forward (the
    class's and an instance's own), forward hooks and plain attributes; the global forward hooks; per parameter
    (``named_parameters()``, frozen ones too, walked once per call by :meth:`Trainable.of`) its name, identity,
    shape, dtype and ``requires_grad``; and the call's ``randomness=``."""
    return (
        inputs.signature(),
        tuple((n, id(m), type(m), type(m).forward, m.__dict__.get("forward"),
               len(m._forward_hooks) + len(m._forward_pre_hooks), _plain_attributes(m))
              for n, m in trainable.modules),
        len(module_mod._global_forward_hooks) + len(module_mod._global_forward_pre_hooks),
        tuple((n, id(p), tuple(p.shape), p.dtype, p.requires_grad)
              for n, p in trainable.named_parameters or trainable.model.named_parameters()),
        trainable.call.draws is not None,  # randomness='different': a plan probed with the draws held fixed
    )
