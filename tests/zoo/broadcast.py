"""Zoo cases for parameters of shape (1, ...) used in a layer's own forward (a class token, a position embedding,
a learned offset): where every use broadcasts over the batch they take the ``broadcast`` path (a per-sample copy of
the parameter in the one batched pass, ``pergrad_viz.engine.broadcast``); where a use reads the parameter's first
dimension another way (``p[0]``, ``p.mean(0, keepdim=True)``, ``p.sum(0)``) they must not, and stay on the per-layer
fallback (``p.squeeze(0)`` is a no-op on the copy, which then broadcasts the same way: the copies are right there).
``tests/strategies/test_zoo.py`` runs them like every case (each strategy against the loop);
``tests/engine/test_broadcast.py`` checks which path each takes.
"""

from __future__ import annotations

import torch
from torch import nn
from zoo.cases import Case, build, image_inputs, token_inputs


class TokensAndPositions(nn.Module):
    """A ViT's embedding step: a class token concatenated in front of the patches, a position embedding added, as
    timm's ``VisionTransformer`` and Hugging Face's ``ViTEmbeddings`` write it. ``use`` picks how the forward reads
    the two parameters (each (1, ...)): ``broadcast`` is the way people write it; the others read the first dimension
    of the parameters and so must not take the per-sample copies."""

    def __init__(self, use: str = "broadcast"):
        super().__init__()
        self.use = use
        self.patch = nn.Linear(4, 6)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos_embed = nn.Parameter(torch.randn(1, 4, 6))
        self.head = nn.Linear(6, 3)

    def embed(self, x):  # (B, 3, 4) -> (B, 4, 6)
        x = self.patch(x)
        cls, pos = self.cls_token, self.pos_embed
        if self.use == "index":  # p[0]: the first copy's row for every sample
            cls, pos = cls[0].expand(x.shape[0], -1, -1), pos[0]
        elif self.use == "squeeze":  # a no-op on the (B, ...) copy, which then broadcasts the same: still right
            pos = pos.squeeze(0)
        elif self.use == "mean":  # the same values, but the gradient of each row is spread over the batch
            pos = pos.mean(0, keepdim=True)
        elif self.use == "sum":
            pos = pos.sum(0)
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        return x + pos

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)).mean(1))


class LearnedOffset(nn.Module):
    """A layer with a learned offset (1, D) added to its input, no rule of its own, inside a network."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.offset = Offset(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.offset(self.fc(x))))


class Offset(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(1, features))
        self.scale = nn.Parameter(torch.randn(1, 1))

    def forward(self, x):
        return x * self.scale + self.shift


PATH = {"tokens-and-positions": "broadcast", "tokens-positions-index": "fallback",
        "tokens-positions-squeeze": "broadcast", "tokens-positions-mean": "fallback",
        "tokens-positions-sum": "fallback", "learned-offset": "broadcast"}

CASES: list[Case] = [
    Case("tokens-and-positions", build(TokensAndPositions), image_inputs("tokens", (3, 4))),
    *(Case(f"tokens-positions-{use}", build(lambda use=use: TokensAndPositions(use)), image_inputs(use, (3, 4)))
      for use in ("index", "squeeze", "mean", "sum")),
    Case("learned-offset", build(LearnedOffset), image_inputs("offset", (4,))),
]


class PositionEmbedding(nn.Module):
    """Token and position embeddings as GPT-2 and BERT write them: positions ``arange(T)[None]`` (1, T), so the
    position embedding's call holds no samples and its (1, T, D) output is added to every sample. ``use``: how the
    forward reads that output (``broadcast`` is the way people write it; ``index``, ``mean`` and ``sum`` read its
    first dimension and must not take the per-sample copies)."""

    def __init__(self, use: str = "broadcast"):
        super().__init__()
        self.use = use
        self.tokens = nn.Embedding(9, 6)
        self.positions = nn.Embedding(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):  # (B, T) token ids
        pos = self.positions(torch.arange(ids.shape[1]).unsqueeze(0))  # (1, T, 6)
        if self.use == "index":
            pos = pos[0]
        elif self.use == "mean":
            pos = pos.mean(0, keepdim=True)
        elif self.use == "sum":
            pos = pos.sum(0)
        return self.head(torch.tanh(self.tokens(ids) + pos).mean(1))


# Where the copies are refused, no module that holds the position embedding keeps the samples apart: hooks refuses
# the model (auto: torch_func), as before the copies existed.
SPREAD = {"position-embedding": "rule", "position-embedding-index": "refused",
          "position-embedding-mean": "refused", "position-embedding-sum": "refused"}

CASES += [
    Case("position-embedding", build(PositionEmbedding), token_inputs("positions", 4, 9)),
    *(Case(f"position-embedding-{use}", build(lambda use=use: PositionEmbedding(use)), token_inputs(use, 4, 9),
           expect="torch_func") for use in ("index", "mean", "sum")),
]
