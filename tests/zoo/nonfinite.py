"""Non-finite samples (issue 28): one sample with an inf in its input, one with a NaN target, one that overflows inside
the model (exp), activations so large (1e20 in float32) that their squares overflow while the gradient is finite
(scaled down by the model), and a NaN input through a layer on the per-layer fallback. Each case: ``(name,
make_model, make_batch, loss, bad samples)``; the other samples' rows and norms must be the loop's, finite."""

from __future__ import annotations

import torch
from torch import nn


class ExpNet(nn.Module):
    """exp of a linear layer: a large input overflows inside the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.exp(self.fc(x)))


class Tiny(nn.Module):
    """Huge inputs, an output scaled down by 1e-25: gradients ~1e-5, squared activations ~1e40 (inf in float32)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) * 1e-25


class ScaleShift(nn.Module):
    """x * w + b: a layer without a closed-form rule (the per-layer fallback), which checks its short path against
    the vmap one on the rows it wrote."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, n))

    def forward(self, x):
        return x * self.weight + self.bias


def _fallback():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), ScaleShift(6), nn.Tanh(), nn.Linear(6, 3)).double()


def _nan_input(x, y):
    x[2, 0] = float("nan")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6, 3)).double()


def _exp():
    torch.manual_seed(0)
    return ExpNet().double()


def _tiny():
    torch.manual_seed(0)
    return Tiny()


def _batch(shape, dtype=torch.float64, scale=1.0):
    def make():
        g = torch.Generator().manual_seed(4)
        return scale * torch.randn(4, *shape, generator=g, dtype=dtype), torch.randn(4, 3, generator=g, dtype=dtype)
    return make


def _with(make, edit):
    def made():
        x, y = make()
        edit(x, y)
        return x, y
    return made


def _inf_input(x, y):
    x[1].view(-1)[2] = float("inf")


def _nan_target(x, y):
    y[2, 0] = float("nan")


def _overflow(x, y):
    x[3] = 800.0


CASES = [
    ("mlp-inf-input", _mlp, _with(_batch((4,)), _inf_input), nn.MSELoss(), [1]),
    ("mlp-nan-target", _mlp, _with(_batch((4,)), _nan_target), nn.MSELoss(), [2]),
    ("conv-inf-input", _conv, _with(_batch((1, 4)), _inf_input), nn.MSELoss(reduction="sum"), [1]),
    ("exp-overflow", _exp, _with(_batch((4,)), _overflow), nn.MSELoss(), [3]),
    ("float32-huge-activations", _tiny, _batch((4,), torch.float32, 1e20), nn.MSELoss(), []),
    ("fallback-layer-nan-input", _fallback, _with(_batch((4,)), _nan_input), nn.MSELoss(reduction="sum"), [2]),
]
