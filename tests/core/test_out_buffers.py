"""``out=`` buffers that cannot hold the results are refused up front (issue 28): before the model runs, with a
message naming the fix, leaving the model, its ``.grad``, the RNG and the grad mode as they were; ones that can
(tests/zoo/outs.py's GOOD) give the loop's numbers, in every strategy and ``auto``."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, flatten_ref, ref_grads, ref_jacobian
from torch import nn
from zoo.outs import BAD, DT, GOOD, CountingMLP

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")
B = 4


def _problem():
    model = CountingMLP()
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.25)
    g = torch.Generator().manual_seed(3)
    return model, torch.randn(B, 6, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


def _call(quantity, model, x, y, strategy, out, flat=True):
    if quantity == "grads":
        return pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy, flat=flat, out=out)
    return pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat, out=out)


def _shape(quantity, model):
    p = sum(q.numel() for q in model.parameters())
    return (B, p) if quantity == "grads" else (B, 3, p)


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_out_is_refused_before_the_model_runs(bad, strategy, quantity):
    model, x, y = _problem()
    make, fragment = BAD[bad]
    out, x = make(_shape(quantity, model), x, model)
    x_before = x.clone()
    assert_refuses(lambda: _call(quantity, model, x, y, strategy, out), model, "out=", fragment, "torch.empty(")
    assert model.calls == 0, f"{bad}: the model ran {model.calls} times before the refusal"
    assert torch.equal(x, x_before), "the inputs were written"


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
def test_out_without_flat_is_refused_up_front(strategy, quantity):
    model, x, y = _problem()
    out = torch.empty(_shape(quantity, model), dtype=DT)
    assert_refuses(lambda: _call(quantity, model, x, y, strategy, out, flat=False), model, "flat=True")
    assert model.calls == 0


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("good", list(GOOD))
def test_good_out_holds_the_loops_rows(good, strategy, quantity):
    model, x, y = _problem()
    out, x = GOOD[good](_shape(quantity, model), x, model)
    got = _call(quantity, model, x, y, strategy, out)
    assert got is out
    if quantity == "grads":
        want = flatten_ref(ref_grads(model, torch.nn.CrossEntropyLoss(), x, y), 1)
    else:
        want = flatten_ref(ref_jacobian(model, x), 2)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)
    assert torch.equal(model.fc.weight.grad, torch.full_like(model.fc.weight, 0.25))


def test_the_overlap_check_is_not_fooled_by_disjoint_neighbours():
    """Inputs and out carved from one buffer without overlap are fine (the check compares byte ranges)."""
    model, x, y = _problem()
    p = sum(q.numel() for q in model.parameters())
    work = torch.empty(x.numel() + B * p, dtype=DT)
    work[:x.numel()] = x.reshape(-1)
    xs, out = work[:x.numel()].view(x.shape), work[x.numel():].view(B, p)
    got = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), xs, y, flat=True, out=out)
    torch.testing.assert_close(got, flatten_ref(ref_grads(model, torch.nn.CrossEntropyLoss(), x, y), 1))


@pytest.mark.parametrize("strategy", ["auto", "loop", "hooks"])
def test_out_overlapping_a_loss_modules_tensor_is_refused(strategy):
    """Found by a probe: out= over CrossEntropyLoss(weight=...)'s memory was accepted; the loop and auto read the
    overwritten weight (rows off by up to 1.8, the loss's weight left changed)."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(5, 3).double(), torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    arena = torch.zeros(4 * 18, dtype=torch.float64)
    arena[:3] = torch.tensor([0.5, 1.0, 2.0])
    loss = nn.CrossEntropyLoss(weight=arena[:3], reduction="sum")
    with pytest.raises(ValueError, match="overlaps the memory of loss_fn.weight"):
        pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=True, out=arena.view(4, 18))
    assert torch.equal(loss.weight, torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))


def test_an_expanded_jacobian_buffer_is_refused_with_a_jacobians_shape():
    """Found by a probe: the refusal of an expanded (B, Y, P) buffer named torch.empty((B, P), ...)."""
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    out = torch.empty(8, dtype=torch.float64).expand(4, 2, 8)
    with pytest.raises(ValueError, match=r"torch\.empty\(\(B, Y, P\)"):
        pv.per_sample_jacobian(model, x, flat=True, out=out)
