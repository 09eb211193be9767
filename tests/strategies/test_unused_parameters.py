"""Trainable parameters that take no part (issue 28, tests/zoo/unused.py): zeros for them where others take part,
as the loop's allow_unused gives, in every strategy and auto, flat or not; where none takes part, one clear refusal
naming them and the fix (never PyTorch's "element 0 of tensors does not require grad"), the model, .grad, the RNG and
the grad mode left as they were."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, flatten_ref, per_sample_call, ref_grads, ref_jacobian
from zoo.unused import CASES

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")


def _problem(case):
    if case.needs:
        pytest.importorskip(case.needs)
    model = case.make_model()
    named = [p for p in model.parameters() if p.requires_grad]
    named[0].grad = torch.full_like(named[0], 0.25)
    g = torch.Generator().manual_seed(5)
    return model, torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_unused_parameters_get_zeros_or_one_refusal(case, strategy, quantity, flat):
    model, x, y = _problem(case)
    if case.refuse:
        assert_refuses(lambda: per_sample_call(quantity, model, x, y, strategy, flat), model,
                       "no trainable parameter takes part", "unmerge_adapter()", "requires_grad")
        return
    want = ref_grads(model, torch.nn.CrossEntropyLoss(), x, y) if quantity == "grads" else ref_jacobian(model, x)
    assert any(float(w.abs().max()) == 0 for w in want.values()), "the case has no unused parameter"
    got = per_sample_call(quantity, model, x, y, strategy, flat)
    if flat:
        torch.testing.assert_close(got, flatten_ref(want, 1 if quantity == "grads" else 2))
    else:
        assert list(got) == list(want)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", [c for c in CASES if c.refuse], ids=lambda c: c.name)
def test_derived_quantities_refuse_alike(case):
    model, x, y = _problem(case)
    loss = torch.nn.CrossEntropyLoss()
    assert_refuses(lambda: pv.per_sample_grad_norms(model, loss, x, y), model, "no trainable parameter takes part")
    assert_refuses(lambda: pv.empirical_ntk(model, x), model, "no trainable parameter takes part")


@pytest.mark.parametrize("loss", ["detached", "constant"])
@pytest.mark.parametrize("strategy", ALL)
def test_a_loss_that_reaches_no_parameter_is_one_refusal(strategy, loss):
    """A loss_fn that detaches its result or returns a constant: the same clear refusal from every strategy and
    every quantity, never PyTorch's "element 0 of tensors does not require grad"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    loss_fn = ((lambda o, t: torch.nn.functional.cross_entropy(o, t).detach()) if loss == "detached"
               else (lambda o, t: torch.tensor(1.0)))
    for call in (lambda: pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy),
                 lambda: pv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy),
                 lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, strategy=strategy)):
        assert_refuses(call, model, "no trainable parameter takes part", "detaches its result")
