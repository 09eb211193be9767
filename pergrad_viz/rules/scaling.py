"""Per-sample numerics the rules share: each sample's largest magnitude, a sample scaled by it where squares could
overflow or underflow (:func:`sample_scaled`, :func:`scaled_unless_fit`), and row norms that lose nothing to either
(:func:`row_norms`, :func:`wide_row_norms`). No registry, no modules: tensors in, tensors out."""

from __future__ import annotations

import math

import torch

from pergrad_viz.core.numbers import SQUARES, wide_square


def sample_maxima(t: torch.Tensor) -> torch.Tensor:
    """(B,) each sample's largest magnitude in ``t`` (B, ...), NaN where it holds one: two reductions and no
    temporary the size of ``t`` (on CPUs 1.6x faster than ``abs().amax()``, 25x faster than ``vector_norm(ord=inf)``,
    which is not vectorised there)."""
    if not t.numel():
        return t.new_zeros(t.shape[0])
    t, dims = t.detach(), tuple(range(1, t.dim()))  # no reshape: a strided view (columns) is not copied
    if not dims:
        return t.abs()
    return torch.maximum(t.amax(dims), t.amin(dims).neg())


def sample_scaled(t: torch.Tensor, s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t / s, s)`` for ``t`` (B, ...), ``s`` (B,) each sample's largest magnitude (:func:`sample_maxima`, or the
    ``s`` given; 1 where 0 or not finite): the squares and products of the scaled tensor neither overflow nor
    underflow where the squared norm they make up (times ``s`` squared) is finite, e.g. huge activations (1e20 in
    float32) meeting tiny or zero gradients, whose plain squares would give inf * 0 = NaN."""
    s = sample_maxima(t) if s is None else s
    s = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return t / s.view(-1, *(1,) * (t.dim() - 1)), s


def products_fit(left: torch.Tensor, right: torch.Tensor, terms: int) -> bool:
    """Whether a sum of ``terms`` products of four entries, two of a tensor whose per-sample maxima
    (:func:`sample_maxima`) are ``left`` (B,) and two of one whose maxima are ``right`` (B,) (a Gram form such as
    ``sum_{t,s} (a_t . a_s)(g_t . g_s)``), computed as it is, without :func:`sample_scaled`, neither overflows nor
    loses a sample's leading digits to underflow: every maximum finite, its square times ``terms`` far below the
    dtype's largest number, and each sample's maximum 0 or with a square that keeps the dtype's precision. Read on
    the host, so only on CPUs (where that is free); elsewhere False (the scaled form, no synchronisation)."""
    if left.device.type != "cpu" or not left.numel():
        return False
    info = torch.finfo(left.dtype)
    top, low = info.max / 16 / max(1, terms), info.tiny / info.eps
    values = left.tolist() + right.tolist()  # B numbers each: a read of the host's own memory
    if not all(map(math.isfinite, values)):
        return False
    n = left.numel()
    hi_a, hi_g = max(values[:n]), max(values[n:])
    lo = min((v for v in values if v != 0), default=1.0)
    if not (max(hi_a, hi_g, hi_a * hi_g) <= math.sqrt(top) and lo * lo >= low):  # a root: float64's 1e155 squared
        return False  # raised OverflowError in Python
    # a sample's two maxima together: their product's square (a term of the form) kept normal too (a probe: each
    # square normal, their product 0 in float32)
    least = min((a * g for a, g in zip(values[:n], values[n:], strict=True) if a and g), default=1.0)
    return least * least >= low


def scaled_unless_fit(a: torch.Tensor, g: torch.Tensor, terms: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(a, g, weight_scale, bias_scale)`` for a Gram form of ``terms`` products over a (B, ...) and g (B, ...): a and
    g as they are where those products fit (:func:`products_fit`; then both scales None), else each scaled per sample
    (:func:`sample_scaled`), a weight's squared norm then to be multiplied by ``weight_scale`` (B,) = (s_a s_g)^2 and
    a bias's (g alone) by ``bias_scale`` (B,) = s_g^2, both float64 (:func:`~pergrad_viz.core.numbers.wide_square`)."""
    sa, sg = sample_maxima(a), sample_maxima(g)
    if products_fit(sa, sg, terms):
        return a, g, None, None
    a, sa = sample_scaled(a, sa)  # per sample: the squares neither overflow nor underflow on their own
    g, sg = sample_scaled(g, sg)
    scale = wide_square(sa.to(SQUARES) * sg.to(SQUARES))  # (s_a s_g)^2: 1e200 * 1e-200 is 1, their squares inf * 0
    return a, g, scale, wide_square(sg)


# Float64 row norms of a narrower dtype on pieces of at most this many numbers: vector_norm(dtype=float64) converts
# all of its input first (18 MB for a ViT's 192 -> 768 per-sample gradients at B=16; 5x slower on 75M numbers).
ROW_NORM_PIECE = 1 << 19


# From this many numbers on, float32 row norms are taken first on CPUs (below it the float64 ones cost as little).
FLOAT32_FIRST = 1 << 16


def row_norms(t: torch.Tensor) -> torch.Tensor:
    """(B,) the L2 norm of each row of ``t`` (B, n), with no overflow or underflow in the squares: accumulated in
    float64 for a narrower dtype (its squares all fit there), a few columns at a time (:data:`ROW_NORM_PIECE`),
    through :func:`sample_scaled` for float64 itself; in ``t``'s dtype."""
    norms = wide_row_norms(t)
    return norms if norms.dtype == t.dtype or not t.is_floating_point() else norms.to(t.dtype)


def wide_row_norms(t: torch.Tensor) -> torch.Tensor:
    """:func:`row_norms` in float64 (a narrower dtype's norms as accumulated, not rounded back to it: a float32
    row's norm may exceed float32's largest number). On CPUs a float32 ``t`` of at least :data:`FLOAT32_FIRST`
    numbers has its norms taken in float32 first, kept where they are exact to float32's rounding
    (:func:`_float32_exact`), as they almost always are: a float64 accumulation reads 5-8x slower there (2 cores,
    (32, 16384): 157 against 31 us)."""
    if t.dtype == torch.float64 or not t.is_floating_point():
        scaled, s = sample_scaled(t)
        return torch.linalg.vector_norm(scaled, dim=1) * s
    if t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.numel() >= FLOAT32_FIRST:
        norms = torch.linalg.vector_norm(t, dim=1)
        if _float32_exact(norms, t.shape[1]):
            return norms.to(torch.float64)
    if t.numel() <= ROW_NORM_PIECE:
        return torch.linalg.vector_norm(t, dim=1, dtype=torch.float64)
    pieces = t.split(max(1, ROW_NORM_PIECE // max(1, t.shape[0])), dim=1)
    return sum(torch.linalg.vector_norm(p, dim=1, dtype=torch.float64).square() for p in pieces).sqrt()


def _float32_exact(norms: torch.Tensor, width: int) -> bool:
    """Whether float32 row norms (B,) of rows of ``width`` numbers lost nothing to overflow or underflow, read on the
    host (CPUs: free): every one finite (a square or partial sum past float32's range makes the norm inf) and each
    at least sqrt(width * tiny / eps), so that the squares lost to underflow, under ``tiny`` each, stay below the
    norm's own rounding (a zero norm, whose row may hold only such numbers, is not kept either)."""
    info = torch.finfo(torch.float32)
    values = norms.tolist()
    return all(map(math.isfinite, values)) and min(values, default=math.inf) >= math.sqrt(
        width * info.tiny / info.eps)
