"""Any real scalar is a number (issue 28): numpy scalars, 0-dim tensors and ints are accepted where the package asks
for a number (clipping bounds, the DP noise, chunk and batch sizes, byte budgets), with the same result as the plain
Python number; non-finite values and what is not a real scalar are refused, naming the argument."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, flatten_ref, ref_grads
from torch import nn
from zoo.numbers import COUNTS, NON_FINITE, NOT_NUMBERS, REALS

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 7, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("label", "make"), REALS, ids=[r[0] for r in REALS])
def test_clip_bounds_are_any_real_scalar(label, make):
    grads = _grads()
    want, want_norms = pv.clip_per_sample(grads, 0.5)
    got, norms = pv.clip_per_sample(grads, make(0.5))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # float16's 0.5 is exact: the same numbers
    torch.testing.assert_close(norms, want_norms)
    assert got.dtype == grads.dtype
    as_dict = pv.clip_per_sample({"w": grads.view(5, 7)}, make(2.0))[0]["w"]
    torch.testing.assert_close(as_dict, pv.clip_per_sample(grads, 2.0)[0])


@pytest.mark.parametrize(("label", "make"), REALS, ids=[r[0] for r in REALS])
def test_dp_noise_and_bound_are_any_real_scalar(label, make):
    grads = _grads()
    want = pv.dp_sgd_gradient(grads, 1.0, 0.5, generator=torch.Generator().manual_seed(1))
    got = pv.dp_sgd_gradient(grads, make(1.0), make(0.5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(got, want)
    assert got.dtype == grads.dtype


@pytest.mark.parametrize(("label", "value"), NON_FINITE + NOT_NUMBERS, ids=[r[0] for r in NON_FINITE + NOT_NUMBERS])
def test_what_is_not_a_finite_number_is_refused(label, value):
    grads = _grads()
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        pv.clip_per_sample(grads, value)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        pv.dp_sgd_gradient(grads, 1.0, value)
    if value is None:
        return  # max_bytes=None: the default budget
    with pytest.raises(ValueError, match="max_bytes must be a finite number"):
        pv.per_sample_grads(nn.Linear(7, 2).double(), nn.MSELoss(), grads, grads[:, :2], max_bytes=value)


@pytest.mark.parametrize("value", [0, -1.0, torch.tensor(-0.5), pytest.importorskip("numpy").float32(0)])
def test_a_bound_must_be_positive(value):
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        pv.clip_per_sample(_grads(), value)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize(("label", "make"), COUNTS, ids=[r[0] for r in COUNTS])
def test_chunk_size_and_budget_are_any_integer(label, make, strategy, flat):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (5,), generator=g)
    loss = nn.CrossEntropyLoss()
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=flat, chunk_size=make(2),
                              max_bytes=make(10**9))
    want = ref_grads(model, loss, x, y)
    if flat:
        torch.testing.assert_close(got, flatten_ref(want, 1))
    else:
        for name, w in want.items():
            torch.testing.assert_close(got[name], w)


@pytest.mark.parametrize("value", [2.0, True, torch.tensor([2]), 0, torch.tensor(2.0)], ids=str)
def test_a_count_must_be_an_integer(value):
    model = nn.Linear(4, 2).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_refuses(lambda: pv.per_sample_grads(model, nn.MSELoss(), x, x[:, :2], chunk_size=value), model,
                   "chunk_size must be a positive int")


@pytest.mark.parametrize("width", [1, 7, 1024])
def test_row_dots_are_each_rows_dot_product(width):
    from pergrad_viz.core.numbers import row_dots

    left, right = torch.randn(5, width, dtype=torch.float64), torch.randn(5, width, dtype=torch.float64)
    want = torch.stack([sum(left[i, k] * right[i, k] for k in range(width)) for i in range(5)])
    torch.testing.assert_close(row_dots(left, right), want)
    assert row_dots(left.to("meta"), right.to("meta")).shape == (5,)  # the other devices' bmm
