"""Non-finite samples stay in their rows (issue 28, tests/zoo/nonfinite.py): an inf input, a NaN target or an overflow
in one sample leaves every other sample's gradient (and Jacobian, and norm) the loop's, in every strategy and auto,
flat or not; norms are finite wherever the loop's are (ghost norms of huge activations computed scaled)."""

from __future__ import annotations

import pytest
import torch
from helpers import flatten_ref, ref_grads, ref_jacobian
from zoo.nonfinite import CASES

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")
IDS = [c[0] for c in CASES]


def _loop_norms(ref: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = flatten_ref(ref, 1).double()
    scale = flat.abs().amax(1, keepdim=True).clamp_min(1e-300)
    return (flat / scale).norm(dim=1) * scale[:, 0]  # in float64, scaled: finite wherever the norm is


def _good(case, batch):
    return [i for i in range(batch) if i not in case[4]]


def _tol(dtype):
    return {"rtol": 1e-6, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-9}


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_other_samples_rows_are_the_loops(case, strategy, quantity, flat):
    name, make_model, make_batch, loss, bad = case
    model = make_model()
    x, y = make_batch()
    if quantity == "grads":
        want = flatten_ref(ref_grads(model, loss, x, y), 1)
        got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=flat)
        got = got if flat else flatten_ref(got, 1)
    else:
        want = flatten_ref(ref_jacobian(model, x), 2)
        got = pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat)
        got = got if flat else flatten_ref(got, 2)
    good = _good(case, x.shape[0])
    assert want[good].isfinite().all(), "the reference's other rows must be finite"
    torch.testing.assert_close(got[good], want[good], **_tol(x.dtype),
                               msg=lambda m: f"{name} {strategy}: another sample's rows changed: {m}")
    for i in bad:  # its own row: non-finite exactly where the loop's is (values there may differ: inf or NaN)
        assert bool(got[i].isfinite().all()) == bool(want[i].isfinite().all()), f"{name} {strategy}: sample {i}"
        torch.testing.assert_close(got[i][want[i].isfinite()], want[i][want[i].isfinite()], **_tol(x.dtype))


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_norms_are_finite_where_the_loops_are(case, strategy):
    name, make_model, make_batch, loss, bad = case
    model = make_model()
    x, y = make_batch()
    want = _loop_norms(ref_grads(model, loss, x, y))
    got = pv.per_sample_grad_norms(model, loss, x, y, strategy=strategy)
    finite = want.isfinite() & (want < torch.finfo(x.dtype).max)
    assert finite[_good(case, x.shape[0])].all()
    assert got[finite].isfinite().all(), f"{name} {strategy}: NaN / inf norms where the loop's are finite: {got}"
    torch.testing.assert_close(got[finite].double(), want[finite], **_tol(x.dtype))
