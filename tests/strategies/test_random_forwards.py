"""Random forwards refused cleanly (issue 28, tests/zoo/random.py): one answer, UndefinedPerSampleError, from every
strategy and auto (grads, Jacobians, norms; flat or not), with nothing drawn from the caller's global RNG and the
model, .grad and the grad mode as they were."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses
from zoo.random import CASES

import pergrad_viz as pv
from pergrad_viz.errors import UndefinedPerSampleError

ALL = (*pv.STRATEGIES, "auto")
IDS = [c[0] for c in CASES]


def _problem(case):
    name, make_model, make_inputs, needs = case
    if needs:
        pytest.importorskip(needs)
    model = make_model()
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.25)
    return model, *make_inputs(4)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian", "norms"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_random_forward_is_refused_by_every_strategy_without_drawing(case, strategy, quantity, flat):
    if quantity == "norms" and flat:
        pytest.skip("norms have no flat form")
    model, x, y = _problem(case)
    loss = torch.nn.CrossEntropyLoss()
    calls = {
        "grads": lambda: pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=flat),
        "jacobian": lambda: pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat),
        "norms": lambda: pv.per_sample_grad_norms(model, loss, x, y, strategy=strategy),
    }
    torch.manual_seed(1234)
    fix = "model.eval()" if model.training else "eval mode already"  # eval() cannot be the fix of a draw in eval mode
    assert_refuses(calls[quantity], model, "random", fix, error=UndefinedPerSampleError)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_forward_really_is_random(case):
    model, x, _ = _problem(case)
    with torch.no_grad():
        assert any(not torch.equal(model(x), model(x)) for _ in range(10))
