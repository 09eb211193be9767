"""nn.Embedding: the gradient row of token v is the sum of the output gradients where v occurs."""

from __future__ import annotations

import torch
from torch import nn

from . import register


@register(nn.Embedding)
def embedding(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
              out: dict[str, torch.Tensor]) -> None:
    if "weight" not in out:
        return
    n, batch = grad_output.shape[:2]
    dim = module.embedding_dim
    idx = activation.reshape(batch, -1)  # (B, T)
    g = grad_output.reshape(n, batch, -1, dim)  # (N, B, T, D)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    weight = out["weight"]  # (N, B, V, D), possibly a strided view into the caller's result: written in place
    weight.zero_()
    rows_n = torch.arange(n, device=idx.device).view(n, 1, 1)
    rows_b = torch.arange(batch, device=idx.device).view(1, batch, 1)
    weight.index_put_((rows_n, rows_b, idx.unsqueeze(0)), g, accumulate=True)
