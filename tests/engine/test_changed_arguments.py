"""A layer that changes a tensor it was called with in place: where the change comes after its use
(``return x.add_(self.bias)``, ``x *= self.w``) what the hooked forward captured of its call (after it) is not what it
computed from, where it comes first (``x = relu_(x)`` at its top) it is. ``hooks`` cannot tell which unchecked: with
``verify=False`` it is refused (it used to give wrong rows); with the check on, the check decides on that call (the
first kind fails it, the second passes). ``auto``'s result equals the loop's in every case."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, assert_state_unchanged, ref_grads, snapshot
from torch import nn

import pergrad_viz as pv


class AddInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x.add_(self.bias)


class ReluFirst(nn.Module):
    """``ReLU(inplace=True)`` on its argument, then its own Linear and scale: it computes from the changed value."""

    def __init__(self):
        super().__init__()
        self.lin, self.gamma = nn.Linear(4, 4), nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        x = torch.relu_(x)
        return x + self.gamma * self.lin(x)


class ScaleInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        x *= self.w
        return x


def _problem(inner: type[nn.Module]):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), inner(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(reduction="sum"), x, torch.tensor([0, 1, 0, 1, 1])


@pytest.mark.parametrize("inner", [AddInPlace, ScaleInPlace, ReluFirst])
def test_unchecked_hooks_refuses_a_layer_that_changes_its_argument(inner):
    model, loss_fn, x, y = _problem(inner)
    before = snapshot(model)
    for call in (lambda: pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False),
                 lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, strategy="hooks", verify=False)):
        with pytest.raises(pv.PlanMismatchError, match=r"layer '1' .* changes a tensor it was called with in place"):
            call()
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("inner", [AddInPlace, ScaleInPlace])
def test_the_check_finds_a_change_after_the_use(inner):
    model, loss_fn, x, y = _problem(inner)
    with pytest.raises(pv.CheckFailedError):
        pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")


def test_a_change_before_the_use_passes_the_check_and_hooks_runs_from_then_on():
    model, loss_fn, x, y = _problem(ReluFirst)
    want = ref_grads(model, loss_fn, x, y)
    assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks"), want, rtol=1e-10, atol=1e-12)
    assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False), want, rtol=1e-10,
                      atol=1e-12)
    assert pv.resolve_strategy("auto", model, x) == "hooks"


@pytest.mark.parametrize("inner", [AddInPlace, ScaleInPlace, ReluFirst])
@pytest.mark.parametrize("verify", [False, True])
def test_auto_gives_the_loops_rows(inner, verify):
    model, loss_fn, x, y = _problem(inner)
    want = ref_grads(model, loss_fn, x, y)
    for _ in range(2):
        assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y, verify=verify), want, rtol=1e-10, atol=1e-12)
