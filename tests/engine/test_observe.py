"""``tensors_of`` reads a layer's arguments and outputs on every hooked call: plain tuples, lists and str-keyed dicts
without the pytree machinery, anything else through it; both give the same tensors in the same order."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten

from pergrad_viz.engine import observe
from pergrad_viz.engine.observe import tensors_of

a, b, c = torch.ones(1), torch.zeros(2), torch.nn.Parameter(torch.ones(3))
Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple


class Sub(torch.Tensor):
    pass


CASES = {
    "output and None": (a, None),
    "args and kwargs": ((a, b), {"z": c, "a": None, "need_weights": False, "m": b}),
    "nested": (a, [b, (c, 1.0)], {"k": "s"}),
    "dict order": {"b": a, "a": b},
    "namedtuple": (Pair(b, a), None),
    "ordered dict": collections.OrderedDict(y=a, x=b),
    "dataclass": Out(a, (b, c)),
    "int keys": {1: a, 0: b},
    "subclass": (b, a.as_subclass(Sub)),
}


@pytest.mark.parametrize("obj", CASES.values(), ids=CASES.keys())
def test_the_same_tensors_in_the_same_order_as_the_pytree(obj, monkeypatch):
    fast = tensors_of(obj)
    monkeypatch.setattr(observe, "_plain_containers", lambda *args: False)  # the pytree's way alone
    want = tensors_of(obj)
    if isinstance(obj, Out):
        want = [obj.logits, *obj.hidden]
    else:
        want = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    assert [id(t) for t in fast] == [id(t) for t in want] == [id(t) for t in tensors_of(obj)]
