"""A float32 model inside torch.autocast (issue 28, tests/zoo/autocast.py): ``auto`` gives the autocast loop's
numbers (each sample alone under autocast: the definition's own computation), in the parameters' dtype (float32);
every other strategy but the loop refuses naming 'auto' / 'loop', leaving the model, .grad, the RNG and the grad
mode as they were. Grads, Jacobians, norms, flat or not."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, flatten_ref
from torch import nn
from zoo.autocast import AUTOCAST, CASES, inputs

import pergrad_viz as pv
from pergrad_viz.errors import UnsupportedModelError

ALL = (*pv.STRATEGIES, "auto")
B = 4


def _autocast_loop(model, x, y, dtype, quantity):
    """The definition under autocast: sample i alone, its loss (or each output) differentiated."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(x[i:i + 1])
            scalars = [torch.nn.functional.cross_entropy(out, y[i:i + 1])] if quantity == "grads" else out.reshape(-1)
        per = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(s, params, retain_graph=True)]) for s in scalars]
        rows.append(per[0] if quantity == "grads" else torch.stack(per))
    return torch.stack(rows)


def _call(quantity, model, x, y, strategy, flat):
    if quantity == "grads":
        return pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy, flat=flat)
    if quantity == "norms":
        return pv.per_sample_grad_norms(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy)
    return pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian", "norms"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize(("label", "dtype"), AUTOCAST, ids=[a[0] for a in AUTOCAST])
@pytest.mark.parametrize(("name", "make"), CASES, ids=[c[0] for c in CASES])
def test_autocast_gives_the_autocast_loop_or_refuses(name, make, label, dtype, strategy, quantity, flat):
    if quantity == "norms" and flat:
        pytest.skip("norms have no flat form")
    model = make()
    x, y = inputs(B)
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.25)
    if strategy not in ("auto", "loop"):
        with torch.autocast("cpu", dtype=dtype):
            assert_refuses(lambda: _call(quantity, model, x, y, strategy, flat), model, "torch.autocast",
                           "strategy='auto' or 'loop'", error=pv.UnsupportedModelError)
        return
    with torch.autocast("cpu", dtype=dtype):
        got = _call(quantity, model, x, y, strategy, flat)
    want = _autocast_loop(model, x, y, dtype, "grads" if quantity == "norms" else quantity)
    tol = {"rtol": 1.6e-2, "atol": 1e-5}  # the autocast dtype's precision (it is the same computation here)
    if quantity == "norms":
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.norm(dim=1), **tol)
        return
    if not flat:
        assert all(t.dtype == torch.float32 for t in got.values())
        got = flatten_ref(got, 1 if quantity == "grads" else 2)
    assert got.dtype == torch.float32, "the result is in the parameters' dtype"
    torch.testing.assert_close(got, want, **tol)


def test_the_autocast_loop_differs_from_the_float32_loop():
    """Else the test above could not tell a result computed without autocast from the autocast loop's."""
    model = CASES[1][1]()
    x, y = inputs(B)
    low = _autocast_loop(model, x, y, torch.bfloat16, "grads")
    full = _autocast_loop(model, x, y, None, "grads")
    assert (low - full).abs().max() > 1e-4


class _Decorated(torch.nn.Module):
    """A forward decorated with ``@torch.autocast``: the call itself sees no autocast, the layers compute in it."""

    def __init__(self, inner, dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.inner(x)


@pytest.mark.parametrize(("label", "dtype"), AUTOCAST, ids=[a[0] for a in AUTOCAST])
@pytest.mark.parametrize(("name", "make"), CASES, ids=[c[0] for c in CASES])
def test_a_forward_under_its_own_autocast_gives_the_loop_and_its_clipped_sum(name, make, label, dtype):
    """The clipped sum's products took the layers' bfloat16 inputs and output gradients into float32 sums (PyTorch's
    raw "mat1 and mat2 must have the same dtype"): now as .grad is, in the parameters' dtype."""
    model = _Decorated(make(), dtype)
    x, y = inputs(B)
    loss = torch.nn.CrossEntropyLoss()
    want = _autocast_loop(model, x, y, None, "grads")  # the autocast is the forward's own
    # the loop's own numbers (the probe finds a layer's output in the lower precision; a batched strategy rounded
    # otherwise, 4.5e-3 relative on a probe's model: found by a probe of training code)
    torch.testing.assert_close(pv.per_sample_grads(model, loss, x, y, flat=True), want, rtol=1e-6, atol=1e-7)
    norms = want.double().norm(dim=1)
    clipped = (want.double() * (0.5 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    got = pv.clipped_grad_sum(model, loss, x, y, 0.5)
    assert all(t.dtype == torch.float32 for t in got.values())
    flat = torch.cat([got[n].reshape(-1) for n, p in model.named_parameters() if p.requires_grad])
    torch.testing.assert_close(flat.double(), clipped, rtol=1e-5, atol=1e-6 * float(clipped.abs().max()))
    for strategy in ("hooks", "torch_func", "autograd_stack"):
        with pytest.raises(UnsupportedModelError, match="torch.autocast inside the forward.*'loop'"):
            pv.per_sample_grads(model, loss, x, y, strategy=strategy)


class _FloatMask(torch.nn.Module):
    """A float64 model with a module whose output is float32 (a 0/1 mask), no autocast anywhere."""

    def __init__(self):
        super().__init__()
        self.inner, self.head = torch.nn.Linear(6, 5).double(), torch.nn.Linear(5, 3).double()
        self.mask = _Mask()

    def forward(self, x):
        h = self.inner(x)
        return self.head(h * self.mask(h))


class _Mask(torch.nn.Module):
    def forward(self, h):
        return (h > 0).float()


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func"])
def test_a_lower_precision_output_without_autocast_keeps_the_batched_strategies(strategy):
    """A regression probe found the autocast rule catching this (auto the loop, hooks and torch_func refused); the
    mask's float32 is exact, and only a module called under autocast counts."""
    torch.manual_seed(0)
    model = _FloatMask()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    if strategy == "auto":
        assert pv.resolve_strategy("auto", model, x) == "hooks"
    got = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy)
    want = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy="loop")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["trace", "full"])
def test_the_ntk_under_autocast_is_contracted_in_the_parameters_dtype(mode):
    """Found by a probe: under a caller's bfloat16 autocast the kernel came back in bfloat16 (its J J^T contracted
    in bfloat16, entries 0.3% off), while per_sample_jacobian gives the float32 Jacobian."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jacobian = pv.per_sample_jacobian(model, x, flat=True).double()
        kernel = pv.empirical_ntk(model, x, mode=mode)
    assert kernel.dtype == torch.float32
    want = torch.einsum("iyp,jzp->ijyz" if mode == "full" else "iyp,jyp->ij", jacobian, jacobian)
    torch.testing.assert_close(kernel.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label, dtype", AUTOCAST)
def test_resolve_strategy_under_autocast_says_the_loop_as_the_calls_run_it(label, dtype):
    """Found by a review of docs/api.md: pv.resolve_strategy("auto", ...) under autocast raised
    UndefinedPerSampleError blaming a tensor kept from an earlier pass (its probe ran under autocast), while the calls
    run the loop; another strategy is refused naming autocast, as the calls refuse it."""
    model, x = CASES[0][1](), inputs(4)[0]
    with torch.autocast("cpu", dtype=dtype):
        assert pv.resolve_strategy("auto", model, x) == "loop"
        with pytest.raises(pv.UnsupportedModelError, match="autocast"):
            pv.resolve_strategy("hooks", model, x)
    assert pv.resolve_strategy("auto", model, x) == "hooks"
