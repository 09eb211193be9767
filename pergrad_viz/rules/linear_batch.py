"""The Gram norms of many Linear calls at once, on a CPU. A small transformer's Linear layers (B=32, 16 tokens, 64
features) have Grams of some 30 us, and one layer's norms were mostly the dispatch of some 25 small operations
around them (the product, the range read, the cancellation guard): 110-180 us a layer. Book-keeping holds every
Linear's inputs and output gradients until its share of the sum anyway, so it hands them here after the backward:
their Grams are written into one buffer per token count and dtype, multiplied, range-read and guarded once for all
of them, each layer's result the same as :meth:`pergrad_viz.rules.linear.LinearGhost.squared_norms` gives alone
(a layer whose values are extreme is handed to it: scaled there)."""

from __future__ import annotations

import math

import torch

from pergrad_viz.rules.doubts import tops_fit
from pergrad_viz.rules.linear import CANCELLATION, LinearGhost, gram_is_faster, guarded, recompute_cancelled

# The Grams of one group, both sides, at most this many bytes (a layer whose pair is larger is a group alone).
GROUP_BYTES = 4 << 20

# One Linear call: a (B, T, in), g (B, T, out), {"weight" and maybe "bias": the parameter's full name}.
LinearCall = tuple[torch.Tensor, torch.Tensor, dict[str, str]]


def batchable(a: torch.Tensor, g: torch.Tensor, roles: dict[str, str]) -> bool:
    """Whether a Linear call's norms may be taken with others' (:func:`linear_gram_norms`): a (B, T, in) and g (B,
    T, out) on a CPU in float32 or float64 alike, T > 1, its weight trainable and its Grams the faster form."""
    return (a.device.type == "cpu" and a.dtype == g.dtype and a.dtype in (torch.float32, torch.float64)
            and a.dim() == 3 and g.dim() == 3 and a.shape[1] > 1 and "weight" in roles
            and gram_is_faster(a.shape[1], a.shape[2], g.shape[2]))


def linear_gram_norms(calls: list[LinearCall]) -> dict[str, torch.Tensor]:
    """{full name: (B,) squared per-sample norm} of :func:`batchable` Linear calls, each ``sum_{t,s} (a_t . a_s)
    (g_t . g_s)`` for its weight and ``||sum_t g_t||^2`` for its bias, taken in groups of one token count and
    dtype."""
    groups: dict[tuple, list[LinearCall]] = {}
    for call in calls:
        a = call[0]
        groups.setdefault((a.shape[0], a.shape[1], a.dtype), []).append(call)
    result: dict[str, torch.Tensor] = {}
    for (batch, tokens, dtype), members in groups.items():
        per_layer = 2 * batch * tokens * tokens * dtype.itemsize
        step = max(1, GROUP_BYTES // per_layer)
        for first in range(0, len(members), step):
            result.update(_group_norms(members[first:first + step]))
    return result


def _group_norms(members: list[LinearCall]) -> dict[str, torch.Tensor]:
    """:func:`linear_gram_norms` of calls of one batch size, token count and dtype: both Grams of every call in one
    (2, L, B, T, T) buffer, one product, one read of the diagonals' maxima, one cancellation guard (float32)."""
    a0 = members[0][0]
    batch, tokens, dtype = a0.shape[0], a0.shape[1], a0.dtype
    grams = torch.empty(2, len(members), batch, tokens, tokens, dtype=dtype)
    first: dict[tuple, int] = {}  # a layer input seen before (BERT's query, key and value read one): its Gram copied
    for i, (a, g, _) in enumerate(members):
        same = first.setdefault((a.data_ptr(), a.shape, a.stride()), i)
        if same == i:
            torch.bmm(a, a.mT, out=grams[0, i])
        else:
            grams[0, i].copy_(grams[0, same])
        torch.bmm(g, g.mT, out=grams[1, i])
    weights = torch.linalg.vecdot(grams[0].view(len(members), batch, -1),
                                  grams[1].view(len(members), batch, -1)).clamp_min_(0)  # (L, B)
    diagonals = grams.diagonal(dim1=3, dim2=4)  # (2, L, B, T)
    tops = diagonals.amax(3).tolist()  # [2][L][B]
    cancelled: list[list[int]] = [[] for _ in members]
    if guarded(a0):  # the guard of rules.linear.cancelling, every layer at once
        widths = [math.sqrt(a.shape[2]) + math.sqrt(g.shape[2]) + tokens for a, g, _ in members]
        bounds = torch.tensor(widths, dtype=dtype).mul_(CANCELLATION * torch.finfo(dtype).eps)
        usual = torch.linalg.vecdot(diagonals[0], diagonals[1])  # (L, B)
        for layer, row in (weights < usual * bounds[:, None]).nonzero().tolist():
            cancelled[layer].append(row)
    result = {}
    for i, (a, g, roles) in enumerate(members):
        if not tops_fit(tops[0][i], tops[1][i], (dtype, dtype), tokens * tokens, a.shape[2], g.shape[2]):
            own = LinearGhost.squared_norms(None, a, g, roles)  # extreme values: scaled there
            result.update({roles[ln]: sq for ln, sq in own.items()})
            continue
        weight = weights[i]
        if cancelled[i]:
            recompute_cancelled(weight, grams[0, i], grams[1, i], a, g)
        result[roles["weight"]] = weight
        if "bias" in roles:
            result[roles["bias"]] = g.sum(1).square().sum(1)
    return result
