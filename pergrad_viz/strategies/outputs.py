"""Small pieces the strategies share."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write(out: dict[str, torch.Tensor], names: Sequence[str], grads: Sequence[torch.Tensor | None],
          index: int | tuple[int, ...] | slice) -> None:
    """``out[name][index] = grad`` for each parameter; a parameter the output does not use gets zeros."""
    for name, g in zip(names, grads, strict=True):
        if g is None:
            out[name][index].zero_()
        else:
            out[name][index].copy_(g.to_dense() if g.is_sparse else g)  # e.g. nn.Embedding(sparse=True)
