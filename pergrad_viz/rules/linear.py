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
            _outer(grad_output, activation, out["weight"])
        if "bias" in out:
            out["bias"].copy_(grad_output)
        return
    a = activation.reshape(batch, -1, activation.shape[-1])  # (B, T, in)
    g = grad_output.reshape(n, batch, -1, grad_output.shape[-1])  # (N, B, T, out)
    if "weight" in out:
        out["weight"].copy_(torch.matmul(g.transpose(-1, -2), a))  # (N, B, out, in)
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])


# Per-sample blocks of at least this many elements are written by a batched matmul, which writes large
# blocks faster than the broadcasting multiply (and into strided result views with less copying).
BMM_BLOCK = 32768


def _outer(g: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, b] = outer(g[n, b], a[b]): g (N, B, out), a (B, in), out (N, B, out, in)."""
    if g.shape[0] == 1 and out.shape[-1] * out.shape[-2] >= BMM_BLOCK:
        torch.bmm(g[0].unsqueeze(2), a.unsqueeze(1), out=out[0])
    else:
        torch.mul(g.unsqueeze(-1), a.unsqueeze(1), out=out)
