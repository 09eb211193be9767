"""A forward that reaches a parameter through a Python reference its module keeps (``self._c = [self.weight]``):
``torch.func.functional_call`` cannot replace it, so torch_func would give that parameter zeros. torch_func now finds
it once per plan (one sample, plain against replaced) and refuses naming the fix; ``auto`` gives the loop's numbers
(each sample alone, in this file): its check finds the per-layer fallback wrong here (it replaces the layer's
parameters the same way), and the hand-over no longer stops at torch_func's zeros."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv
from pergrad_viz.errors import HandOverError


class KeptReference(nn.Linear):
    def forward(self, x):
        if not hasattr(self, "_kept"):
            object.__setattr__(self, "_kept", [self.weight])  # outside nn.Module's registries
        return nn.functional.linear(x, self._kept[0], self.bias)


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(KeptReference(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return model, torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
def test_torch_func_refuses_and_auto_equals_the_loop(quantity):
    model, x, y = _problem()
    loss_fn = nn.CrossEntropyLoss()
    if quantity == "grads":
        call = lambda strategy, verify: pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy,  # noqa: E731
                                                            verify=verify)
        want = ref_grads(model, loss_fn, x, y)
    else:
        call = lambda strategy, verify: pv.per_sample_jacobian(model, x, strategy=strategy, verify=verify)  # noqa: E731
        want = ref_jacobian(model, x)
    with pytest.raises(HandOverError, match=r"parameter '0.weight' is reached through a reference"):
        call("torch_func", False)
    for _ in range(3):
        assert_dict_close(call("auto", True), want, rtol=1e-9, atol=1e-12)


def test_an_ordinary_model_still_runs_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="torch_func", verify=False)
    assert_dict_close(got, ref_grads(model, nn.CrossEntropyLoss(), x, y), rtol=1e-9, atol=1e-12)
