"""Mixed precision as people train (issue 28): a float32 model called inside ``torch.autocast("cpu",
dtype=torch.bfloat16)`` (or float16): an MLP, and a model with a convolution, LayerNorm, an Embedding and
nn.MultiheadAttention. ``inputs(batch)`` gives float32 inputs (B, 40) and (B,) labels."""

from __future__ import annotations

import torch
from torch import nn


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.ln = nn.LayerNorm(64)
        self.emb = nn.Embedding(10, 4)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(68, 3)

    def forward(self, x):
        img, tok = x[:, :36].reshape(-1, 1, 6, 6), (x[:, 36:40].abs() * 3).long().clamp(max=9)
        h = self.ln(torch.relu(self.conv(img)).flatten(1))
        e = self.emb(tok)
        a, _ = self.mha(e, e, e)
        return self.head(torch.cat([h, a.mean(1)], 1))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 16), nn.GELU(), nn.Linear(16, 3))


def mixed() -> nn.Module:
    torch.manual_seed(0)
    return Mixed()


def inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(batch, 40, generator=g), torch.randint(0, 3, (batch,), generator=g)


CASES = [("mlp", mlp), ("conv-ln-embedding-attention", mixed)]
AUTOCAST = [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
