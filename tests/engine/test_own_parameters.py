"""A parameter used outside the layer that handles it on a branch the data decides (``F.linear(h, self.lin.weight)``
on an outlier batch), which the probe never saw: every call sees it (pergrad_viz.engine.own_parameters: each hooked
layer's forward gets its parameters as leaves, so a use of the real one elsewhere reaches it in the backward), so
every call equals the loop (each sample alone, in this file) with verify=False too, and the model keeps its own
parameter objects, also when its forward raises."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, assert_state_unchanged, ref_grads, snapshot
from torch import nn

import pergrad_viz as pv


class OutlierBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if x.abs().max() > 10:  # an outlier batch: the layer's weight used once more, outside the layer
            h = nn.functional.linear(h, self.lin.weight)
        return self.head(h)


class FailingScale(nn.Module):
    """A layer (the per-layer fallback's) whose own forward raises on some data, its parameter a leaf by then."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(6))

    def forward(self, h):
        if float(h[0, 0]) < -5:
            raise ValueError("the model's own error")
        return h * self.weight


class FailsOnNegativeFirst(OutlierBranch):
    def __init__(self):
        super().__init__()
        self.scale = FailingScale()

    def forward(self, x):
        return self.head(self.scale(x))


def _batches(n: int):
    torch.manual_seed(0)
    for k in range(n):
        x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
        if k >= 2:
            x[k % 5, 0] = 20.0
        yield x, y


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_every_call_sees_a_use_outside_the_layer(strategy):
    torch.manual_seed(1)
    model, loss_fn = OutlierBranch().double(), nn.CrossEntropyLoss()
    for k, (x, y) in enumerate(_batches(6)):
        want = ref_grads(model, loss_fn, x, y)
        if strategy == "hooks" and k >= 2:
            with pytest.raises(pv.UnsupportedModelError, match=r"'lin.weight' is used outside the layer"):
                pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, verify=False)
            continue
        assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, verify=False), want,
                          rtol=1e-9, atol=1e-12)
        clipped = pv.clipped_grad_sum(model, loss_fn, x, y, 0.3, verify=False)
        c = (0.3 / (torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1) + 1e-6)).clamp(max=1.0)
        for name, g in want.items():
            torch.testing.assert_close(clipped[name], torch.einsum("b,b...->...", c, g), rtol=1e-9, atol=1e-12)


def test_the_model_keeps_its_parameters_when_its_forward_raises():
    torch.manual_seed(1)
    model = FailsOnNegativeFirst().double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    before, objects = snapshot(model), dict(model.named_parameters())
    x[0, 0] = -9.0
    with pytest.raises(ValueError, match="the model's own error"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert_state_unchanged(model, before)
    assert all(p is objects[n] for n, p in model.named_parameters())
    assert all(type(p) is nn.Parameter for p in model.parameters())
