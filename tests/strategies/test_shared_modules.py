"""One module object reached by two paths (``enc[0] is dec[2]``): torch.func's ``functional_call`` (torch 2.14),
tying the paths, left the shared module a plain tensor for the rest of the call, so that torch_func's first call of a
plan gave its parameters zero rows (found by a probe of training code; ``auto`` hands over to torch_func where a
weight is used outside its layer). ``pergrad_viz.core.functional.functional_call_once`` swaps each module once."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_state_unchanged, snapshot
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.functional import functional_call_once

DT = torch.float64


class SharedLayer(nn.Module):
    def __init__(self, outside: bool = False):
        super().__init__()
        torch.manual_seed(1)
        shared = nn.Linear(5, 5)
        self.outside = outside
        self.enc = nn.Sequential(shared, nn.Tanh())
        self.dec = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), shared)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.dec(self.enc(x))
        if self.outside:  # a weight used outside its layer: the probe sends auto to torch_func
            h = h + 0.1 * nn.functional.linear(x, self.dec[0].weight)
        return self.head(h)


def _problem(outside=False):
    model = SharedLayer(outside).to(DT)
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(6, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)


def _loop(model, loss_fn, x, y):
    names, params = zip(*model.named_parameters(), strict=True)
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(x.shape[0])]
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


@pytest.mark.parametrize("strategy", ["torch_func", "auto", "hooks", "autograd_stack", "batched_grad"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_shared_layer_gets_its_rows_on_the_first_call(strategy, verify):
    model, x, y = _problem()
    loss = nn.CrossEntropyLoss()
    want = _loop(model, loss, x, y)
    before = snapshot(model)
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, verify=verify)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    assert isinstance(model.enc[0].weight, nn.Parameter) and model.enc[0] is model.dec[2]
    assert_state_unchanged(model, before)


def test_the_jacobian_of_a_shared_layer_on_the_first_call():
    model, x, _ = _problem()
    got = pv.per_sample_jacobian(model, x, strategy="torch_func", verify=False)
    want = pv.per_sample_jacobian(model, x, strategy="loop")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    assert got["enc.0.weight"].abs().max() > 0


def test_the_clipped_sum_where_auto_takes_torch_func():
    model, x, y = _problem(outside=True)
    loss = nn.CrossEntropyLoss(reduction="sum")
    want = _loop(model, loss, x, y)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in want.values()]).sum(0).sqrt()
    factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    got = pv.clipped_grad_sum(model, loss, x, y, 0.3, verify=False)
    for name, g in want.items():
        torch.testing.assert_close(got[name], torch.einsum("b,b...->...", factors, g), rtol=1e-9, atol=1e-12)


def test_functional_call_once_replaces_a_shared_module_once_and_a_tied_weight_everywhere():
    model, x, _ = _problem()
    tied = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    tied[1].weight = tied[0].weight  # GPT-2's embedding and output layer
    for module, inputs, name in ((model, x, "enc.0.weight"), (model, x, "dec.2.weight"),
                                 (tied, torch.tensor([[1, 2]]), "0.weight")):
        originals = {n: p for n, p in module.named_parameters(remove_duplicate=False)}
        value = dict(module.named_parameters(remove_duplicate=False))[name].detach() * 2
        out = functional_call_once(module, {name: value}, (inputs,))
        assert torch.equal(out, torch.func.functional_call(
            _copy_with(module, name, value), {}, (inputs,))), name
        now = dict(module.named_parameters(remove_duplicate=False))
        assert all(now[n] is p and isinstance(p, nn.Parameter) for n, p in originals.items()), name


def _copy_with(module, name, value):
    import copy

    twin = copy.deepcopy(module)  # deepcopy keeps the sharing and the ties
    with torch.no_grad():
        twin.get_parameter(name).copy_(value)
    return twin


@pytest.mark.parametrize("strategy", ["torch_func", "auto", "hooks", "loop"])
def test_inputs_that_require_grad(strategy):
    """Found by a probe: torch_func's result, on a graph through the inputs, was copied into the result's leaf in
    place (PyTorch's "a leaf Variable that requires grad is being used in an in-place operation")."""
    model, x, y = _problem()
    x = x.clone().requires_grad_()
    loss = nn.CrossEntropyLoss()
    want = _loop(model, loss, x.detach(), y)
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=True)
    torch.testing.assert_close(got, torch.cat([w.flatten(1) for w in want.values()], 1), rtol=1e-9, atol=1e-12)
    assert x.grad is None and not got.requires_grad
    jac = pv.per_sample_jacobian(model, x, strategy=strategy if strategy != "loop" else "loop")
    assert not any(t.requires_grad for t in jac.values())
