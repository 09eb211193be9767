"""Results formed without the per-sample gradients (the ghost norms, book-keeping's clipped sum) are checked every
row at once: on a checked call the same pass also forms ``sum_i w_i g_i`` (random w) from the same captures and
rules, against the gradient of ``sum_i w_i L_i`` from a plain backward of the batch (engine/combination.py). A model
whose samples interact only in batches larger than the probe's pair (the last sample sees the one before it) gave
wrong rows from the default calls before; only one sample alone was checked. References: a loop written here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo.nets import DoublyTiedNet, LastSeesPrevious

import pergrad_viz as pv
from pergrad_viz.derived import ntk
from pergrad_viz.engine import combination
from pergrad_viz.engine.combination import check_ntk_rows
from pergrad_viz.errors import CheckFailedError


def _problem(seed: int):
    torch.manual_seed(seed)
    model = LastSeesPrevious().double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    return model, x, y


def _loop(model, loss_fn, x, y):
    """[(per-parameter gradients of sample i alone)] and the (B,) norms."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(x.shape[0])]
    return rows, torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in rows])


@pytest.mark.parametrize("seed", range(3))
def test_default_norms_and_clipped_sum_of_a_model_coupled_in_larger_batches_equal_the_loop(seed):
    model, x, y = _problem(seed)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    rows, norms = _loop(model, loss_fn, x, y)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y), norms, rtol=1e-9, atol=0)
    bound = float(norms.median())
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    sums = pv.clipped_grad_sum(model, loss_fn, x, y, bound)
    for k, (name, _) in enumerate(model.named_parameters()):
        want = sum(f * r[k] for f, r in zip(factors, rows, strict=True))
        torch.testing.assert_close(sums[name], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("quantity", ["norms", "clipped_sum"])
def test_hooks_asked_for_is_refused_naming_the_interaction(quantity):
    model, x, y = _problem(0)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    call = pv.per_sample_grad_norms if quantity == "norms" else lambda *a, **k: pv.clipped_grad_sum(*a, 1.0, **k)
    with pytest.raises(CheckFailedError, match=r"random combination of the per-sample gradients .*samples interact "
                                               r"in this model's forward .*Use strategy='auto'"):
        call(model, loss_fn, x, y, strategy="hooks")


def test_unchecked_calls_form_no_combination(monkeypatch):
    """verify=False (and calls the schedule does not check) pay nothing for it: no weights drawn."""
    drawn = []
    monkeypatch.setattr(combination, "random_normal", lambda *a: drawn.append(a) or torch.zeros(a[0], dtype=a[1].dtype))
    model, x, y = _problem(0)
    pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x[:2], y[:2], 1.0, verify=False)
    pv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x[:2], y[:2], verify=False)
    assert not drawn
    pv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x[:2], y[:2])
    assert drawn


def _jacobians(model, x):
    """(B, Y, P): each sample alone, one backward per output."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i:i + 1]).reshape(-1)
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                                 for o in out]))
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["full", "trace"])
@pytest.mark.parametrize("seed", range(3))
def test_default_ntk_of_a_model_coupled_in_larger_batches_equals_the_loop(seed, mode):
    """K u for every row against J_1 (J_2^T u) by plain autograd: the coupled rows are caught (one random entry
    against the samples alone missed them: 1.4 to 7.3 relative off)."""
    model, x, _ = _problem(seed)
    j = _jacobians(model, x)
    want = torch.einsum("iyp,jzp->ijyz" if mode == "full" else "iyp,jyp->ij", j, j)
    torch.testing.assert_close(pv.empirical_ntk(model, x, mode=mode), want, rtol=1e-9, atol=1e-12)


def test_ntk_rows_checked_with_x2_and_no_false_alarm_on_a_tied_padding_embedding(monkeypatch):
    """Forward mode would differ from the backward's convention at an Embedding's padding row that a tied output
    layer moves; the check's reference is reverse mode twice, and passes there."""
    passed = []

    def spy(*args):
        passed.append(check_ntk_rows(*args))
        return passed[-1]

    monkeypatch.setattr(ntk, "check_ntk_rows", spy)
    torch.manual_seed(0)
    model, tokens = DoublyTiedNet(vocab=6).double(), torch.randint(0, 6, (8, 7))
    tokens[:, 0] = 1  # the padding index in every sample
    j1, j2 = _jacobians(model, tokens[:5]), _jacobians(model, tokens[5:])
    got = pv.empirical_ntk(model, tokens[:5], tokens[5:])
    assert passed == [True]
    torch.testing.assert_close(got, torch.einsum("iyp,jzp->ijyz", j1, j2), rtol=1e-9, atol=1e-12)


class _FirstOrderTanh(torch.autograd.Function):
    """tanh whose backward is detached (a hand-written kernel's wrapper): no double backward through it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (g * (1 - torch.tanh(x) ** 2)).detach()


def test_ntk_rows_not_checked_through_a_backward_without_a_graph(monkeypatch):
    """The double backward would lose the first layer's terms there: the rows are not checked (no false alarm that
    would send every later call to the loop), the one entry alone is."""
    results = []

    def spy(*args):
        results.append(check_ntk_rows(*args))
        return results[-1]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(10, 20), nn.Linear(20, 3)

        def forward(self, x):
            return self.b(_FirstOrderTanh.apply(self.a(x)))

    monkeypatch.setattr(ntk, "check_ntk_rows", spy)
    torch.manual_seed(0)
    model, x = Net().double(), torch.randn(6, 10, dtype=torch.float64)
    j = _jacobians(model, x)
    for mode in ("full", "trace"):
        want = torch.einsum("iyp,jzp->ijyz" if mode == "full" else "iyp,jyp->ij", j, j)
        torch.testing.assert_close(pv.empirical_ntk(model, x, mode=mode), want, rtol=1e-9, atol=1e-12)
    assert results == [False, False]
