"""The squared norms of a weight tied between layers (GPT-2's embedding and output layer), per sample, without forming
its per-sample gradient: each layer's part of it is a pair of factors, ``sum_t outer(left_t, right_t)`` (a Linear's
output gradients and inputs; an Embedding's token ids as one-hot rows; any layer's own per-sample gradient as its
rows, :func:`dense_part`), and the norm is the parts' own squared norms plus twice their cross inner products.

Shapes: B samples, T_k the positions of part k, a left factor (B, T_k, rows) or (B, T_k) integer rows, a right factor
(B, T_k, cols), the weight seen as (rows, cols).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pergrad_viz.core.numbers import SQUARES
from pergrad_viz.rules.linear import below_rounding, gradient_squared_norms, guarded
from pergrad_viz.rules.scaling import products_fit, sample_maxima, sample_scaled

# One layer's part of a tied weight's norm: (left factor, right factor, its own (B,) squared norm).
TiedPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _left_gram(left1: torch.Tensor, left2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T1, T2) inner products of two layers' left factors, (B, T, rows) vectors or (B, T) integer rows (one-hot
    vectors): a matmul, a gather of the dense side at the rows, or where the rows are equal."""
    one1, one2 = not left1.is_floating_point(), not left2.is_floating_point()
    if one1 and one2:
        return (left1.unsqueeze(2) == left2.unsqueeze(1)).to(dtype)
    if one1:
        return left2.gather(2, left1.unsqueeze(1).expand(-1, left2.shape[1], -1)).mT  # left2[b, s, idx_t]
    if one2:
        return left1.gather(2, left2.unsqueeze(1).expand(-1, left1.shape[1], -1))
    return torch.bmm(left1, left2.mT)


def tied_squared_norms(parts: Sequence[TiedPart]) -> torch.Tensor:
    """(B,) squared norms of the per-sample gradient of a weight tied between layers, sum_k g_k, without forming it:
    ``sum_k ||g_k||^2 + 2 sum_{k<l} <g_k, g_l>`` with ``<g_k, g_l> = sum_{t,s} (left_kt . left_ls)(right_kt .
    right_ls)`` per sample (an output Linear tied to an Embedding: the Linear's output gradient gathered at the
    token ids). O(B T_k T_l (rows + cols)) work, (B, T_k, T_l) memory. On a CPU a sample whose cross terms cancel its
    own ones (uses of the weight that nearly undo each other: the narrow dtype's rounding of the cross terms would be
    all that is left) is computed again with the factors in float64."""
    own = sum(own for _, _, own in parts)
    total = _with_cross_terms(own, _scaled_parts(parts))
    dtype = parts[0][1].dtype
    if parts[0][1].device.type != "cpu" or not guarded(parts[0][1]):
        return total.clamp_min(0)
    # the terms' usual size, sum_k sum_t |left_kt|^2 |right_kt|^2 (no copy of a (B, T, V) output gradient)
    square = lambda t: torch.linalg.vector_norm(t, dim=-1).double().square()  # noqa: E731
    usual = sum(((square(left) if left.is_floating_point() else 1.0) * square(r)).sum(1) for left, r, _ in parts)
    rows = below_rounding(total, usual.to(total.dtype), max(left.shape[-1] if left.is_floating_point() else 1
                                                            for left, _, _ in parts),
                          max(r.shape[-1] for _, r, _ in parts), max(left.shape[1] for left, _, _ in parts), dtype)
    rows = rows.nonzero().flatten()
    if rows.numel() and dtype == torch.float64:  # nothing wider: the gradient itself, what cancels rounded once
        total[rows] = gradient_squared_norms([(left[rows], right[rows]) for left, right, _ in parts]).to(total.dtype)
    elif rows.numel():
        wide = [(left[rows].double() if left.is_floating_point() else left[rows], r[rows].double(), None)
                for left, r, _ in parts]  # the own norms again too: theirs rounded as the cross terms did
        own_wide = sum((_left_gram(left, left, torch.float64) * torch.bmm(r, r.mT)).sum((1, 2)) for left, r, _ in wide)
        total[rows] = _with_cross_terms(own_wide, [(left, r, None) for left, r, _ in wide]).to(total.dtype)
    return total.clamp_min(0)


def _with_cross_terms(own: torch.Tensor, scaled: list) -> torch.Tensor:
    """(B,) ``own`` (the parts' own squared norms summed) plus twice every pair's cross term."""
    total = own
    for k, (left1, right1, s1) in enumerate(scaled):
        for left2, right2, s2 in scaled[k + 1:]:
            cross = (_left_gram(left1, left2, right1.dtype) * torch.bmm(right1, right2.mT)).sum((1, 2))
            total = total + 2 * (cross if s1 is None else cross.to(SQUARES) * (s1.to(SQUARES) * s2.to(SQUARES)))
    return total


def _scaled_parts(parts: Sequence[TiedPart]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The parts' factors (left, right, scale (B,) or None) for the cross terms: as they are where every cross
    term's products fit (``products_fit`` on every part's per-sample maxima, a one-hot left's being 1; CPUs only,
    a host read), else each factor scaled per sample, so that the products neither overflow nor underflow on their
    own (on a tied GPT-2's output gradients, (32, 32, 1000), the scaling was a division pass over them)."""
    lefts = [sample_maxima(left) if left.is_floating_point() else own.new_ones(own.shape, dtype=right.dtype)
             for left, right, own in parts]  # in the factors' dtype (own is float64): products_fit reads its range
    rights = [sample_maxima(right) for _, right, _ in parts]
    tokens = max(left.shape[1] for left, _, _ in parts)
    width = max(left.shape[-1] if left.is_floating_point() else 1 for left, _, _ in parts)
    terms = tokens * tokens * width * max(right.shape[-1] for _, right, _ in parts)
    if products_fit(torch.cat(lefts), torch.cat(rights), terms):
        return [(left, right, None) for left, right, _ in parts]
    result = []
    for (left, right, _), sl, sr in zip(parts, lefts, rights, strict=True):
        if left.is_floating_point():  # a one-hot left stays as it is, its scale the ones above
            left, sl = sample_scaled(left, sl)
        right, sr = sample_scaled(right, sr)
        result.append((left, right, sl * sr))
    return result


def dense_part(g: torch.Tensor, own: torch.Tensor) -> TiedPart:
    """A per-sample gradient (B, *shape) as a tied part: W.view(rows, -1) = sum_r outer(e_r, W[r]), its rows as
    one-hot left factors."""
    rows = g.reshape(g.shape[0], g.shape[1] if g.dim() > 1 else 1, -1)  # (B, rows, cols)
    index = torch.arange(rows.shape[1], device=g.device).expand(g.shape[0], -1)
    return index, rows, own
