"""A forward that a flag or the data switches to another path between the layers after the probe and many calls
took the first one. Every call's graph between the layers is walked (pergrad_viz.engine.unplanned): a layer's weight
used outside the layer is refused by ``hooks`` and handed over by ``auto``, checked or not; a path no passed check
saw makes the call's check due (pergrad_viz.engine.schedule), so that samples coupled on it are caught on that
call. Each result equals the loop's."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, counting_calls, ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv
from pergrad_viz.engine import certify, schedule

SWITCH = {"on": False}


class Branching(nn.Module):
    """``a``'s weight used again outside ``a`` where an input is an outlier (``by="data"``) or a flag outside the
    model is set (``by="flag"``)."""

    def __init__(self, by: str):
        super().__init__()
        self.a, self.b, self.by = nn.Linear(4, 4), nn.Linear(4, 3), by

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if (x.abs() > 3).any() if self.by == "data" else SWITCH["on"]:
            h = h + x @ self.a.weight.T
        return self.b(h)


def _batches(by: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(6, 4, generator=g, dtype=torch.float64).clamp(-2.5, 2.5)
    outlier = plain.clone()
    if by == "data":
        outlier[2, 1] = 4.0
    return plain, outlier


def _clipped_sum(grads: dict[str, torch.Tensor], bound: float = 1.0) -> dict[str, torch.Tensor]:
    """The loop's per-sample gradients clipped to ``bound`` and summed, as DP-SGD defines it."""
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    return {n: (g * factors.view(-1, *(1,) * (g.dim() - 1))).sum(0) for n, g in grads.items()}


def _warm(model, loss_fn, x, y, by):
    SWITCH["on"] = False
    for _ in range(4):
        pv.per_sample_grads(model, loss_fn, x, y, verify=False)
        pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, verify=False)
    SWITCH["on"] = by == "flag"


@pytest.mark.parametrize("by", ["data", "flag"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_later_use_outside_the_layer_gives_the_loops_rows(by, verify):
    torch.manual_seed(0)
    model, loss_fn = Branching(by).double(), nn.CrossEntropyLoss(reduction="sum")
    plain, outlier = _batches(by)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    _warm(model, loss_fn, plain, y, by)
    try:
        want = ref_grads(model, loss_fn, outlier, y)
        got = pv.per_sample_grads(model, loss_fn, outlier, y, verify=verify)
        assert_dict_close(got, want, rtol=1e-10, atol=1e-12)
        clipped = _clipped_sum(want)
        summed = pv.clipped_grad_sum(model, loss_fn, outlier, y, 1.0, verify=verify)
        assert_dict_close(summed, clipped, rtol=1e-10, atol=1e-12)
    finally:
        SWITCH["on"] = False


@pytest.mark.parametrize("call", ["grads", "clipped", "jacobian"])
def test_hooks_refuses_a_later_use_outside_the_layer(call):
    torch.manual_seed(0)
    model, loss_fn = Branching("data").double(), nn.CrossEntropyLoss(reduction="sum")
    plain, outlier = _batches("data")
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    _warm(model, loss_fn, plain, y, "data")
    run = {"grads": lambda x: pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False),
           "clipped": lambda x: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, strategy="hooks", verify=False),
           "jacobian": lambda x: pv.per_sample_jacobian(model, x, strategy="hooks", verify=False)}[call]
    run(plain)  # the branch not taken: the plan fits
    with pytest.raises(pv.PlanMismatchError, match="outside the forward of the layer that holds it"):
        run(outlier)


def test_the_jacobian_of_a_later_use_outside_the_layer_is_the_loops():
    torch.manual_seed(0)
    model = Branching("data").double()
    plain, outlier = _batches("data")
    for _ in range(3):
        pv.per_sample_jacobian(model, plain, verify=False)
    assert_dict_close(pv.per_sample_jacobian(model, outlier, verify=False), ref_jacobian(model, outlier),
                      rtol=1e-10, atol=1e-12)


class Coupling(nn.Module):
    """From ``SWITCH["on"]``: each sample's hidden state scaled by ``scale(x)`` (``"batch"``: the batch's sum,
    coupling the samples; ``"own"``: twice, each sample alone)."""

    def __init__(self, scale: str):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(4, 4), nn.Linear(4, 3), scale

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if SWITCH["on"]:
            h = h * (x.sum(0, keepdim=True).tanh() if self.scale == "batch" else 2.0)
        return self.b(h)


def _many_calls(model, loss_fn, x, y):
    SWITCH["on"] = False
    for _ in range(30):  # past the first checks: the schedule checks within its share of the time only
        pv.per_sample_grads(model, loss_fn, x, y)
        pv.clipped_grad_sum(model, loss_fn, x, y, 1.0)
    SWITCH["on"] = True


def test_samples_coupled_on_a_later_path_are_caught_on_its_first_call(monkeypatch):
    monkeypatch.setattr(schedule, "SHARE", 0.0)  # after the first calls, no check for time's sake
    torch.manual_seed(0)
    model, loss_fn = Coupling("batch").double(), nn.CrossEntropyLoss(reduction="sum")
    x, y = _batches("data")[0], torch.tensor([0, 1, 2, 0, 1, 2])
    _many_calls(model, loss_fn, x, y)
    try:
        want = ref_grads(model, loss_fn, x, y)
        clipped = _clipped_sum(want)
        assert_dict_close(pv.clipped_grad_sum(model, loss_fn, x, y, 1.0), clipped, rtol=1e-10, atol=1e-12)
        assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y), want, rtol=1e-10, atol=1e-12)
        with pytest.raises(pv.UnsupportedModelError, match="the samples interact"):  # found on the first call
            pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    finally:
        SWITCH["on"] = False


def test_a_later_path_is_checked_once(monkeypatch):
    monkeypatch.setattr(schedule, "SHARE", 0.0)
    torch.manual_seed(0)
    model, loss_fn = Coupling("own").double(), nn.CrossEntropyLoss(reduction="sum")
    x, y = _batches("data")[0], torch.tensor([0, 1, 2, 0, 1, 2])
    _many_calls(model, loss_fn, x, y)
    checks = counting_calls(monkeypatch, certify, "check_grads")
    monkeypatch.setattr(pv.api, "check_grads", certify.check_grads)
    try:
        got = [pv.per_sample_grads(model, loss_fn, x, y) for _ in range(3)]
        assert len(checks) == 1  # its first call
        for g in got:
            assert_dict_close(g, ref_grads(model, loss_fn, x, y), rtol=1e-10, atol=1e-12)
    finally:
        SWITCH["on"] = False
