"""Gradient checkpointing (issue 28, tests/zoo/checkpointing.py): with use_reentrant=True every strategy and auto
refuse with one message naming use_reentrant=False (never PyTorch's "incompatible with .grad()"), leaving the model,
.grad, the RNG and the grad mode as they were; with use_reentrant=False, the loop's numbers (auto and loop always;
another strategy may refuse with UnsupportedModelError naming one that works)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, flatten_ref, per_sample_call, ref_grads, ref_jacobian
from zoo.checkpointing import CASES

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _problem(name):
    _, make, inputs, reentrant, needs = next(c for c in CASES if c[0] == name)
    if needs:
        pytest.importorskip(needs)
    model = make()
    first = next(p for p in model.parameters() if p.requires_grad)
    first.grad = torch.full_like(first, 0.25)
    x = inputs(3)
    return model, x, torch.tensor([0, 2, 1]), reentrant


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_checkpointing_is_right_or_refused_naming_use_reentrant_false(name, strategy, quantity, flat):
    model, x, y, reentrant = _problem(name)
    if quantity == "jacobian" and name.startswith("hf") and strategy in ("loop", "autograd_stack", "batched_grad"):
        pytest.skip("slow baselines on the Jacobian of a transformer: the grads cover them")
    if reentrant:
        assert_refuses(lambda: per_sample_call(quantity, model, x, y, strategy, flat), model, "use_reentrant=False",
                       "gradient_checkpointing_kwargs={'use_reentrant': False}", error=pv.UnsupportedModelError)
        return
    try:
        got = per_sample_call(quantity, model, x, y, strategy, flat)
    except pv.UnsupportedModelError as e:
        assert strategy not in ("auto", "loop"), f"{strategy} must not refuse: {e}"
        assert "'auto'" in str(e) or "'loop'" in str(e)
        return
    want = ref_grads(model, torch.nn.CrossEntropyLoss(), x, y) if quantity == "grads" else ref_jacobian(model, x)
    if flat:
        torch.testing.assert_close(got, flatten_ref(want, 1 if quantity == "grads" else 2))
    else:
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[3]])
def test_derived_quantities_refuse_reentrant_checkpoints_alike(name):
    model, x, y, _ = _problem(name)
    loss = torch.nn.CrossEntropyLoss()
    assert_refuses(lambda: pv.per_sample_grad_norms(model, loss, x, y), model, "use_reentrant=False",
                   error=pv.UnsupportedModelError)
    assert_refuses(lambda: pv.empirical_ntk(model, x), model, "use_reentrant=False", error=pv.UnsupportedModelError)
    assert_refuses(lambda: pv.clipped_grad_sum(model, loss, x, y, 1.0), model, "use_reentrant=False",
                   error=pv.UnsupportedModelError)
