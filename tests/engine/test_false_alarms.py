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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_false_alarm_on_samples_whose_gradient_is_zero(dtype):
    """Targets equal to the batch's outputs: those samples' gradients are 0 in the batch and rounding alone (1e-16)
    in the loop's forward of the sample alone; they are measured against the batch's rows, and a wrong one is still
    found (every strategy's result computed here from the loop's rows)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)
    x = torch.randn(5, 6, dtype=dtype)
    with torch.no_grad():
        y = model(x)
    y[1] += 1.0  # one sample with a gradient, four at their minimum
    loss = torch.nn.MSELoss(reduction="sum")
    rows = pv.per_sample_grads(model, loss, x, y, strategy="loop")
    norms = {n: g.flatten(1).square().sum(1).double() for n, g in rows.items()}
    zero = {n: torch.where(torch.arange(5).view(-1, *(1,) * (g.dim() - 1)) == 1, g, 0) for n, g in rows.items()}
    trainable, inputs = Trainable.of(model), Batch.of(x)
    for k in range(40):
        with restoring_modes(trainable):
            certify.check_grads(trainable, loss, inputs, y, zero, "hooks", batched=k % 2 == 0)
            certify.check_norms(trainable, loss, inputs, y, {n: v * (torch.arange(5) == 1) for n, v in norms.items()},
                                "hooks")
    wrong = {n: g.clone() for n, g in zero.items()}
    wrong["0.weight"][3] = 1e-2 * rows["0.weight"][1]  # a zero row made 1e-2 of the batch's largest
    with pytest.raises(certify.CheckFailedError):
        for _ in range(40):  # the check draws its sample: one of these draws sample 3
            with restoring_modes(trainable):
                certify.check_grads(trainable, loss, inputs, y, wrong, "hooks", batched=False)
    assert len(pv.per_sample_grads(model, loss, x, y, strategy="hooks")) == 4  # and the call itself passes
