"""Ghost norms computed as they are or scaled per sample (``rules.scaling.products_fit``): the plain form is taken
only where no square overflows or underflows, and both forms give the norm of the per-sample gradient written out
in float64 (an einsum in this test), for ordinary, huge, tiny and zero samples."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pergrad_viz.derived import tied
from pergrad_viz.rules import scaling
from pergrad_viz.rules.conv import ConvGhost
from pergrad_viz.rules.linear import LinearGhost, grams_fit
from pergrad_viz.rules.scaling import products_fit, row_norms, sample_maxima


def test_sample_maxima_is_the_largest_magnitude_of_each_sample():
    t = torch.tensor([[[1.0, -5.0], [2.0, 0.5]], [[0.0, 0.0], [0.0, 0.0]], [[3.0, float("nan")], [1.0, 1.0]]])
    got = sample_maxima(t)
    assert got[:2].tolist() == [5.0, 0.0] and math.isnan(got[2])
    assert sample_maxima(t.mT).tolist()[:2] == [5.0, 0.0]  # a strided view, read as it is
    assert sample_maxima(torch.tensor([-2.0, 3.0])).tolist() == [2.0, 3.0]  # (B,): one number per sample


@pytest.mark.parametrize("piece", [scaling.ROW_NORM_PIECE, 7, 1])  # in one piece, or a few columns at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_norms_are_the_float64_norms_in_any_number_of_pieces(monkeypatch, piece, dtype):
    monkeypatch.setattr(scaling, "ROW_NORM_PIECE", piece)
    t = torch.randn(5, 23, generator=torch.Generator().manual_seed(0)).to(dtype)
    t[1] *= 1e30 if dtype == torch.float32 else 1e35  # squares past the dtype's largest number
    t[2] *= 1e-30  # squares below its smallest
    t[3] = 0
    want = torch.linalg.vector_norm(t.double(), dim=1)
    for rows in (t, t.T.contiguous().T):  # contiguous and strided
        got = row_norms(rows)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=0, atol=0)


@pytest.mark.parametrize("odd", [None, "overflow", "underflow", "zero"])
def test_wide_row_norms_of_long_float32_rows_are_the_float64_norms(odd):
    """Rows of at least FLOAT32_FIRST numbers take float32 norms first: kept to float32's rounding where nothing
    overflowed or underflowed, else every row in float64 (exactly its norms)."""
    width = scaling.FLOAT32_FIRST // 4 + 1
    t = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    if odd == "overflow":
        t[1, 7] = 3e19  # its square is past float32's largest number: the float32 norm is inf
    elif odd == "underflow":
        t[2] *= 1e-22  # squares below float32's smallest normal number: the float32 norm loses digits
    elif odd == "zero":
        t[3] = 0
    want = torch.linalg.vector_norm(t.double(), dim=1)
    got = scaling.wide_row_norms(t)
    assert got.dtype == torch.float64
    if odd is None:  # float32 norms, widened
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        assert torch.equal(got, torch.linalg.vector_norm(t, dim=1).double())
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(row_norms(t), want.float(), rtol=2e-6, atol=0)


@pytest.mark.parametrize(("left", "right", "terms", "fit"), [
    ([1.0, 2.0], [0.5, 3.0], 10_000, True),
    ([1.0, 0.0], [0.0, 3.0], 10_000, True),  # a zero sample: its norm is exactly 0 either way
    ([1e20, 1.0], [1e-22, 1.0], 1, False),  # the square of 1e20 overflows float32
    ([1e17, 1.0], [1.0, 1.0], 10_000, False),  # (1e17)^2 * 1e4 terms: past the largest float32 / 16
    ([1e-21, 1.0], [1e10, 1.0], 1, False),  # (1e-21)^2 is subnormal in float32: digits lost
    ([float("inf"), 1.0], [1.0, 1.0], 1, False),
    ([float("nan"), 1.0], [1.0, 1.0], 1, False),
    ([1e-12, 1.0], [1e-12, 1.0], 1, False),  # each square normal, their product's square 0 in float32 (a probe)
])
def test_products_fit(left, right, terms, fit):
    assert products_fit(torch.tensor(left), torch.tensor(right), terms) is fit


def test_products_fit_of_float64_past_1e154_is_a_no_not_an_overflow_error():
    """Found by a probe: Python's float ``** 2`` of a float64 maximum over 1.34e154 raised OverflowError."""
    assert products_fit(torch.tensor([1e200, 1.0], dtype=torch.float64), torch.tensor([1e-200, 1.0],
                                                                                     dtype=torch.float64), 1) is False


def test_float64_huge_activations_with_tiny_gradients_are_scaled_not_nan():
    """Found by a probe: the scale (s_a s_g)^2 was formed as s_a^2 s_g^2, inf * 0 for 1e200 and 1e-200 (a finite
    gradient's norm NaN on the path a GPU takes, refused as not finite)."""
    torch.manual_seed(4)
    a, g = torch.randn(3, 4, 16, dtype=torch.float64), torch.randn(3, 4, 16, dtype=torch.float64)
    a[1] *= 1e200
    g[1] *= 1e-200
    scaled_a, scaled_g, weight_scale, _ = scaling.scaled_unless_fit(a, g, 16)
    got = torch.einsum("bto,bti->boi", scaled_g, scaled_a).square().sum((1, 2)) * weight_scale
    torch.testing.assert_close(got, _reference(a, g)[0], rtol=1e-12, atol=0)
    got = LinearGhost.squared_norms(None, a, g, {"weight": "w"})["weight"]
    torch.testing.assert_close(got, _reference(a, g)[0], rtol=1e-12, atol=0)


def test_products_fit_reads_no_device_memory():
    meta = torch.ones(2, device="meta")
    assert products_fit(meta, meta, 1) is False  # elsewhere than on CPUs: the scaled form, no synchronisation


def _reference(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) squared norms of sum_t g_t a_t^T and of sum_t g_t, in float64."""
    a, g = a.double(), g.double()
    return torch.einsum("bto,bti->boi", g, a).square().sum((1, 2)), g.sum(1).square().sum(1)


@pytest.mark.parametrize("tokens", [3, 40])  # the Gram form (T^2 < in * out) and the (out, in) form
def test_linear_ghost_norms_for_ordinary_huge_and_tiny_samples(tokens):
    torch.manual_seed(0)
    a, g = torch.randn(5, tokens, 6), torch.randn(5, tokens, 7)
    a[1] *= 1e20
    g[1] *= 1e-15  # huge activations, tiny gradients: a finite norm whose plain squares overflow
    a[2] *= 1e-21
    g[2] *= 1e10  # tiny activations: subnormal squares
    a[3] = 0.0  # a zero sample
    got = LinearGhost.squared_norms(None, a, g, {"weight": "w", "bias": "b"})
    want_w, want_b = _reference(a, g)
    assert torch.isfinite(got["weight"]).all()
    torch.testing.assert_close(got["weight"].double(), want_w, rtol=1e-4, atol=0)
    torch.testing.assert_close(got["bias"].double(), want_b, rtol=1e-4, atol=0)


def test_linear_ghost_norms_ordinary_samples_unscaled_agree():
    torch.manual_seed(1)
    a, g = torch.randn(4, 9, 8), torch.randn(4, 9, 5)
    got = LinearGhost.squared_norms(None, a, g, {"weight": "w", "bias": "b"})
    want_w, want_b = _reference(a, g)
    torch.testing.assert_close(got["weight"].double(), want_w, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["bias"].double(), want_b, rtol=1e-5, atol=0)


def test_linear_gram_norms_of_ordinary_samples_are_taken_unscaled_and_agree():
    torch.manual_seed(2)
    a, g = torch.randn(4, 3, 6), torch.randn(4, 3, 7)  # T^2 < in * out: the Gram form
    assert grams_fit(torch.bmm(a, a.mT), torch.bmm(g, g.mT), 6, 7)
    got = LinearGhost.squared_norms(None, a, g, {"weight": "w", "bias": "b"})
    want_w, want_b = _reference(a, g)
    torch.testing.assert_close(got["weight"].double(), want_w, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["bias"].double(), want_b, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("scale_a", "scale_g", "fit"), [
    (1.0, 1.0, True),
    (0.0, 1.0, True),  # a zero sample: exact zeros
    (1e18, 1e-10, False),  # a's squares times 6 features overflow float32 on the diagonal
    (1e-20, 1e10, False),  # a's squares are subnormal: digits lost
    (1e9, 1e10, False),  # each Gram fits, their products over T^2 terms do not
    (1e-14, 1e5, True),  # small, with squares that keep float32's digits
    (1e-12, 1e-12, False),  # each Gram normal (1e-23), their products 0 in float32 (a probe: norms 0 and 3.7e-23)
])
def test_grams_fit(scale_a, scale_g, fit):
    torch.manual_seed(3)
    a, g = torch.randn(2, 3, 6), torch.randn(2, 3, 7)
    a[1] *= scale_a
    g[1] *= scale_g
    assert grams_fit(torch.bmm(a, a.mT), torch.bmm(g, g.mT), 6, 7) is fit


def test_conv_ghost_norms_for_huge_samples():
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(3, 3, 5, 5)
    g = torch.randn(3, 4, 5, 5)
    x[0] *= 1e20
    g[0] *= 1e-22
    a_cols, g_rows = ConvGhost.stack(conv, [(x, g[None])])
    got = ConvGhost.squared_norms(conv, a_cols, g_rows[0], {"weight": "w"})["weight"]
    want, _ = _reference(a_cols, g_rows[0])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize(("tokens", "width_in", "width_out", "gram"), [
    (12, 16, 16, False),  # T^2 < in * out, yet T (in + out) > in * out: the (out, in) gradient is faster
    (8, 16, 16, True),  # T (in + out) = in * out: the Grams
    (4, 16, 48, True),
])
def test_linear_norms_take_the_faster_form_and_agree(tokens, width_in, width_out, gram, monkeypatch):
    from pergrad_viz.rules import linear

    assert linear.gram_is_faster(tokens, width_in, width_out) is gram
    bmm, shapes = torch.bmm, []
    monkeypatch.setattr(linear.torch, "bmm", lambda x, y: shapes.append(tuple(y.shape)) or bmm(x, y))
    torch.manual_seed(5)
    a, g = torch.randn(4, tokens, width_in), torch.randn(4, tokens, width_out)
    got = LinearGhost.squared_norms(None, a, g, {"weight": "w", "bias": "b"})
    assert (shapes[0][-1] == tokens) is gram  # a Gram's (B, in, T) operand, or the gradient's (B, T, in)
    want_w, want_b = _reference(a, g)
    torch.testing.assert_close(got["weight"].double(), want_w, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["bias"].double(), want_b, rtol=1e-5, atol=0)


def _tied_parts(scale_left: float, scale_right: float):
    """Two factor parts (left (B, T, R), right (B, T, C)) and a one-hot part (ids (B, T), rows (B, T, C)) of one
    (R, C) weight in float32, sample 1's factors scaled (its per-sample gradients unchanged); with the float64 norm
    of their sum."""
    g = torch.Generator().manual_seed(3)
    factors = [(torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 6, generator=g)) for _ in range(2)]
    ids, rows = torch.randint(0, 5, (3, 7), generator=g), torch.randn(3, 7, 6, generator=g)
    for left, right in factors:
        left[1] *= scale_left
        right[1] *= scale_right
    grads = [torch.einsum("btr,btc->brc", left.double(), right.double()) for left, right in factors]
    dense = torch.zeros(3, 5, 6, dtype=torch.float64)
    for b in range(3):
        dense[b].index_add_(0, ids[b], rows[b].double())
    parts = [(left, right, w.square().sum((1, 2)).float()) for (left, right), w in zip(factors, grads, strict=True)]
    parts.append((ids, rows, dense.square().sum((1, 2)).float()))
    return parts, (grads[0] + grads[1] + dense).square().sum((1, 2))


@pytest.mark.parametrize(("scale_left", "scale_right", "plain"), [
    (1.0, 1.0, True),
    (1e20, 1e-20, False),  # huge left factors, tiny right ones: the left Gram overflows, the right one underflows
    (1e-21, 1e21, False),
])
def test_tied_cross_terms_as_they_are_only_where_they_fit(scale_left, scale_right, plain):
    parts, want = _tied_parts(scale_left, scale_right)
    assert all((s is None) is plain for *_, s in tied._scaled_parts(parts))
    torch.testing.assert_close(tied.tied_squared_norms(parts).double(), want, rtol=1e-4, atol=0.0)
