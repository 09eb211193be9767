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
    vocab, dim = module.num_embeddings, module.embedding_dim
    idx = activation.reshape(batch, -1)  # (B, T)
    g = grad_output.reshape(n, batch, -1, dim)  # (N, B, T, D)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    rows = (idx + vocab * torch.arange(batch, device=idx.device).unsqueeze(1)).reshape(-1)  # (B*T,)
    result = torch.zeros(n, batch * vocab, dim, dtype=g.dtype, device=g.device)
    result.index_add_(1, rows, g.reshape(n, -1, dim))
    out["weight"].copy_(result.view(n, batch, vocab, dim))
