"""A layer that changes a tensor it was called with in place (``x.add_(self.bias)``, ``x.mul_(self.w)``): what the
hooked forward captured of its call is not what it computed from, so ``hooks`` is refused (also with
``verify=False``, where it used to give wrong rows) and ``auto`` computes each sample alone; every result equals the
loop's."""

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


@pytest.mark.parametrize("inner", [AddInPlace, ScaleInPlace])
def test_hooks_refuses_a_layer_that_changes_its_argument(inner):
    model, loss_fn, x, y = _problem(inner)
    before = snapshot(model)
    with pytest.raises(pv.PlanMismatchError, match=r"layer '1' .* changes a tensor it was called with in place"):
        pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False)
    with pytest.raises(pv.UnsupportedModelError, match="changes a tensor it was called with in place"):
        pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, strategy="hooks", verify=False)  # remembered
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("inner", [AddInPlace, ScaleInPlace])
@pytest.mark.parametrize("verify", [False, True])
def test_auto_gives_the_loops_rows(inner, verify):
    model, loss_fn, x, y = _problem(inner)
    want = ref_grads(model, loss_fn, x, y)
    for _ in range(2):
        assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y, verify=verify), want, rtol=1e-10, atol=1e-12)
