"""Odd but valid models (issue 28): a buffer that is also another module's Parameter, ``nn.DataParallel`` on CPU,
anomaly detection mode, full backward hooks (one reading a value with ``.item()``), complex and empty (B, 0)
outputs for Jacobians, a lazy module not yet initialised.

``CASES``: ``(name, make_model, context)`` run like any model (the loop's numbers, or a clear refusal); the others
are tested on their own in tests/strategies/test_odd_models.py.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

DT = torch.float64


class BufferIsParameter(nn.Module):
    """``fc.weight`` registered again as a buffer of another module (a weight-norm or EMA helper written by hand)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.stats = nn.Module()
        self.stats.register_buffer("w", self.fc.weight)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.tanh(x @ self.stats.w.T)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _buffer_is_parameter():
    torch.manual_seed(0)
    return BufferIsParameter().to(DT)


def _data_parallel():
    return nn.DataParallel(mlp())


def _full_backward_hook(reads: bool):
    def make():
        model = mlp()
        seen = []
        model[0].register_full_backward_hook(
            lambda mod, gin, gout: seen.append(float(gout[0].abs().max())) if reads else None)
        return model
    return make


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return torch.complex(h, torch.tanh(h))


class Empty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)[:, :0]


def complex_model():
    torch.manual_seed(0)
    return Complex().to(DT)


def empty_model():
    torch.manual_seed(0)
    return Empty().to(DT)


def lazy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


CASES = [
    ("buffer-is-parameter", _buffer_is_parameter, contextlib.nullcontext),
    ("data-parallel-cpu", _data_parallel, contextlib.nullcontext),
    ("anomaly-detection", mlp, torch.autograd.detect_anomaly),
    ("full-backward-hook", _full_backward_hook(False), contextlib.nullcontext),
    ("full-backward-hook-reading-item", _full_backward_hook(True), contextlib.nullcontext),
]
