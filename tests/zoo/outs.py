"""``out=`` buffers as people allocate them (issue 28): ones that cannot hold the results (every row the same memory,
memory the call reads, a tensor that records gradients) and ones that can (a fresh tensor, columns of a larger one).

Each maker takes the result's shape (B, P) or (B, Y, P), the inputs and the model, and returns ``(out, inputs)``:
a bad ``out`` may share memory with the inputs it hands back.
"""

from __future__ import annotations

import math

import torch
from torch import nn

DT = torch.float64


class CountingMLP(nn.Module):
    """Linear(6, 5) -> tanh -> Linear(5, 3) that counts its forward passes (a refusal up front runs none)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 5).to(DT)
        self.head = nn.Linear(5, 3).to(DT)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.head(torch.tanh(self.fc(x)))


def _workspace(shape, x, model):
    """One scratch buffer carved into the inputs and (overlapping them by one row too many) the result."""
    n, rows = math.prod(shape), x.numel()
    work = torch.zeros(rows + n - x.shape[1], dtype=DT)
    work[:rows] = x.reshape(-1)
    return work[rows - x.shape[1]:].view(shape), work[:rows].view(x.shape)


def _holding_a_grad(shape, x, model):
    """A flat gradient arena: the first parameter's .grad is a view of the buffer the result is asked into."""
    arena = torch.zeros(math.prod(shape) + 1, dtype=DT)
    first = next(model.parameters())
    first.grad = arena[:first.numel()].view(first.shape)
    return arena[1:].view(shape), x


def _inside_inference_mode(shape, x, model):
    with torch.inference_mode():
        return torch.empty(shape, dtype=DT), x


BAD = {  # name -> (maker, what the message names)
    "expanded-row": (lambda shape, x, m: (torch.zeros(shape[-1], dtype=DT).expand(shape), x), "share memory"),
    "expanded-sample": (lambda shape, x, m: (torch.zeros(1, *shape[1:], dtype=DT).expand(shape), x),
                        "share memory"),
    "overlaps-inputs": (_workspace, "overlaps the memory of inputs"),
    "overlaps-a-grad": (_holding_a_grad, "overlaps the memory of fc.weight.grad"),
    "leaf-requires-grad": (lambda shape, x, m: (torch.zeros(shape, dtype=DT, requires_grad=True), x),
                           "requires grad"),
    "graph-result": (lambda shape, x, m: (torch.zeros(shape, dtype=DT, requires_grad=True) * 1, x),
                     "requires grad"),
    "inference-tensor": (_inside_inference_mode, "inference tensor"),
}
GOOD = {
    "column-major": lambda shape, x, m: (torch.full(tuple(reversed(shape)), float("nan"), dtype=DT).permute(
        *reversed(range(len(shape)))), x),
    "fresh": lambda shape, x, m: (torch.full(shape, float("nan"), dtype=DT), x),
    "columns-of-larger": lambda shape, x, m: (torch.full((*shape[:-1], shape[-1] + 7), float("nan"),
                                                         dtype=DT)[..., 3:3 + shape[-1]], x),
}
