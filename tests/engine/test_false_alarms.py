"""No false alarm from float32 rounding (engine.certify): on every zoo architecture that the fast path runs, in
float32, a right result (the loop's own) is checked many times as from a batched strategy and as from torch_func,
and never refused. The cheap architectures 200 times, the large CNNs 20 times (each check of those is a forward
and backward of a ResNet)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map
from zoo.cases import CASES

import pergrad_viz as pv
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.engine import certify

FAST_PATH = [case for case in CASES if case.expects(0) == "hooks"]


def _float32(obj: object) -> object:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj)


@pytest.mark.parametrize("case", FAST_PATH, ids=lambda c: c.name)
def test_no_false_alarm_in_float32(case):
    model = case.prepare(case.make_model(), 0).float()
    x, y = (_float32(t) for t in case.make_inputs(4))
    loss = next(iter(case.loss_fns.values()))()
    rows = pv.per_sample_grads(model, loss, x, y, strategy="loop")
    trainable = Trainable.of(model)
    inputs = x if isinstance(x, Batch) else Batch.of(x)
    checks = 20 if case.expensive or sum(p.numel() for p in model.parameters()) > 10**6 else 200
    alarms = []
    for k in range(checks):
        try:
            with restoring_modes(trainable):
                certify.check_grads(trainable, loss, inputs, y, rows, "hooks", batched=k % 5 != 0)
        except certify.CheckFailedError as e:
            alarms.append(e.reason)
    assert not alarms, f"{len(alarms)} false alarms in {checks} checks: {alarms[0]}"
