"""nn.Linear, on inputs (B, in) or with extra dimensions (B, *, in)."""

from __future__ import annotations

import torch
from torch import nn

from . import register


@register(nn.Linear)
def linear(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
           out: dict[str, torch.Tensor]) -> None:
    n, batch = grad_output.shape[:2]
    if activation.dim() == 2:  # (B, in): the weight gradient is an outer product, written in place
        if "weight" in out:
            torch.mul(grad_output.unsqueeze(-1), activation.unsqueeze(1), out=out["weight"])
        if "bias" in out:
            out["bias"].copy_(grad_output)
        return
    a = activation.reshape(batch, -1, activation.shape[-1])  # (B, T, in)
    g = grad_output.reshape(n, batch, -1, grad_output.shape[-1])  # (N, B, T, out)
    if "weight" in out:
        out["weight"].copy_(torch.matmul(g.transpose(-1, -2), a))  # (N, B, out, in)
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])
