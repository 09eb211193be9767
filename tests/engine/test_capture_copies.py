"""Captured tensors that a forward modifies in place (``ReLU(inplace=True)``, ``out += identity``): the hooked forward
copies those, and only those, found changed (``Plan.copy_captures`` names them), so that a ResNet's forward does not
clone every captured tensor; the per-sample gradients still equal the loop's, written out in the test."""

from __future__ import annotations

import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.probe import plan_for


class Block(nn.Module):
    """conv -> BN -> ReLU(inplace) -> conv -> BN, += the input, ReLU(inplace): torchvision's BasicBlock."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(channels * 16, 2)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.head(self.relu(out).flatten(1))


def _loop(model, loss_fn, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)])
            for i in range(x.shape[0])]
    return torch.stack(rows)


def test_only_the_tensors_changed_in_place_are_copied_and_the_rows_are_right():
    torch.manual_seed(0)
    model = Block().double().eval()
    for bn in (model.bn1, model.bn2):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    x, y = torch.randn(5, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for _ in range(2):  # the first call finds the changed tensors, the second copies them from the start
        got = pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", flat=True)
        torch.testing.assert_close(got, _loop(model, loss_fn, x, y), rtol=1e-10, atol=1e-12)
    copies = plan_for(Trainable.of(model), x).copy_captures
    assert isinstance(copies, frozenset) and copies, "the changed tensors named, not every one copied"
    assert {name for name, _, _ in copies} <= {"bn1", "bn2", "relu"}, copies  # outputs the ReLUs and += change
    assert not {name for name, _, _ in copies} & {"conv1", "conv2", "head"}
