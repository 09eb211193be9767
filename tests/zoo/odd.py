"""Odd but valid models (issue 28): a buffer that is also another module's Parameter, ``nn.DataParallel`` on CPU,
anomaly detection mode, full backward hooks (one reading a value with ``.item()``), a layer handed its batch's state as
an object (a cache: the per-layer fallback cannot replay it for one sample), complex and empty (B, 0)
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


class BatchState:
    """State of the whole batch handed to a layer as an object, not a tensor (a Hugging Face cache): the layer cannot
    be run again for one sample with it."""

    def __init__(self, shift: torch.Tensor):
        self.shift = shift  # (B, d)


class Stateful(nn.Module):
    """x @ W + state.shift: no closed-form rule (the per-layer fallback), its batch's rows in an object."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.eye(d) + 0.1 * torch.randn(d, d))

    def forward(self, x, state: BatchState):
        return x @ self.w + state.shift


class WithBatchState(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.mix = Stateful(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.head(self.mix(h, BatchState(0.5 * h.detach().square())))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _buffer_is_parameter():
    torch.manual_seed(0)
    return BufferIsParameter().to(DT)


def _batch_state():
    torch.manual_seed(0)
    return WithBatchState().to(DT)


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
    ("batch-state-object", _batch_state, contextlib.nullcontext),
]
