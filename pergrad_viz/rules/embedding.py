"""nn.Embedding: the gradient row of token v is the sum of the output gradients where v occurs."""

from __future__ import annotations

import torch
from torch import nn

from pergrad_viz.core.numbers import wide_square
from pergrad_viz.rules.registry import join_positions, positions, register, register_ghost, register_weighted_sum
from pergrad_viz.rules.scaling import row_norms


@register(nn.Embedding, features=lambda module: 0)
def embedding(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
              out: dict[str, torch.Tensor]) -> None:
    if "weight" not in out:
        return
    n, batch = grad_output.shape[:2]
    idx = activation.reshape(batch, -1)  # (B, T)
    g = positions(grad_output, n, batch)  # (N, B, T, D)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    weight = out["weight"]  # (N, B, V, D), possibly a strided view into the caller's result: written in place
    weight.zero_()
    rows_n = torch.arange(n, device=idx.device).view(n, 1, 1)
    rows_b = torch.arange(batch, device=idx.device).view(1, batch, 1)
    weight.index_put_((rows_n, rows_b, idx.unsqueeze(0)), g, accumulate=True)


@register_ghost(nn.Embedding)
class EmbeddingGhost:
    """Only the rows a sample touches are non-zero: sum the gradients per (sample, index), then square."""

    kind = "embedding"

    @staticmethod
    def applies(module):
        return True

    @staticmethod
    def stack(module, seen):
        acts, grads = [], []
        for a, g in seen:
            n, batch = g.shape[:2]
            idx = a.reshape(batch, -1)
            g = g.reshape(n, batch, idx.shape[1], module.embedding_dim)
            if module.padding_idx is not None:
                g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
            acts.append(idx)
            grads.append(g)
        return join_positions(acts, grads)

    @staticmethod
    def squared_norms(module, a, g, local):
        if "weight" not in local:
            return {}
        vocab = module.num_embeddings
        pairs = (a + vocab * torch.arange(a.shape[0], device=a.device).unsqueeze(1)).reshape(-1)  # (sample, token)
        unique, inverse = torch.unique(pairs, return_inverse=True)
        rows = g.new_zeros(unique.numel(), g.shape[-1]).index_add_(0, inverse, g.reshape(pairs.numel(), g.shape[-1]))
        squared = wide_square(row_norms(rows))  # per row: float64, no overflow in the squares
        return {"weight": squared.new_zeros(a.shape[0]).index_add_(0, unique // vocab, squared)}

    @staticmethod
    def factors(module, a, g):
        return a, g  # W (V, D): sum_t outer(one-hot(idx_t), g_t), rows ignored by the layer already zeroed in g

    @staticmethod
    def overlap(a1, a2, dtype):
        return (a1[:, None, :, None] == a2[None, :, None, :]).to(dtype)  # the same index

    @staticmethod
    def gram_cost(module, tokens, y_count, pairs):
        gram = tokens * tokens * (1 + y_count * module.embedding_dim) + tokens * pairs * module.embedding_dim
        return gram, pairs * module.weight.numel()


@register_weighted_sum(nn.Embedding)
def embedding_weighted_sum(module, seen, weights, out):
    """weight (V, D) += the c-weighted output gradients, added into the rows of their indices (``index_add_``);
    the ``padding_idx`` row gets nothing."""
    if "weight" not in weights:
        return
    c = weights["weight"]
    for a, g in seen:
        idx = a.reshape(-1)  # (B * T,)
        rows = positions(g, a.shape[0]) * c.view(-1, 1, 1)
        rows = rows.reshape(idx.numel(), module.embedding_dim)
        if module.padding_idx is not None:
            rows = rows * (idx != module.padding_idx).unsqueeze(1).to(rows.dtype)
        out["weight"].index_add_(0, idx, rows)
