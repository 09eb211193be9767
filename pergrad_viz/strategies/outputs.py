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


def non_finite_rows(out: dict[str, torch.Tensor]) -> list[int]:
    """The samples i whose rows ``out[name][i]`` (B, ...) hold a NaN or an inf. After one batched backward these
    may come from another sample (its inf activation times this sample's zero gradient in a weight's product): the
    batched strategies recompute them alone."""
    rows = None
    for t in out.values():
        finite = t.reshape(t.shape[0], -1).isfinite().all(1)
        rows = finite if rows is None else rows & finite
    return [] if rows is None else (~rows).nonzero().flatten().tolist()
