"""The path a GPU takes (rules.doubts, forced here on the CPU): book-keeping computes each Linear's and
convolution's Gram norms unscaled, notes the Grams' per-sample maxima, and reads them once before the clip factors
(per_sample_grad_norms: before it returns); a layer whose values are extreme (squares past float32's range, or lost
to underflow) is computed again, scaled. Norms and clipped sums against a loop written here: per-sample gradients of
a float64 copy, one backward each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.rules import doubts


class Tokens(nn.Module):
    """Two Linears over 4 tokens of 16 features (their Gram form), a mean over the tokens, a head."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.out(torch.tanh(self.mix(x))).mean(1))


class Pixels(nn.Module):
    """A convolution on 2 x 2 maps (its norms from the pixels' Gram, as ResNet-18's layer3 on 32 x 32 images), a
    mean over the positions, a head; the input (B, 4, 16) as 16 channels of 2 x 2."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(x.view(-1, 16, 2, 2))).mean((2, 3)))


MODELS = {"tokens": Tokens, "pixels": Pixels}


@pytest.fixture
def deferred(monkeypatch):
    monkeypatch.setattr(doubts, "ON_CPU", True)
    redone = []
    real = doubts.Doubts.settle
    monkeypatch.setattr(doubts.Doubts, "settle", lambda self: redone.append(real(self)) or redone[-1])
    return redone


def _loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float, bound: float):
    """(clipped sum {name: tensor}, (B,) norms) in float64, one backward per sample."""
    model = model.double()
    names = [n for n, _ in model.named_parameters()]
    rows = []
    for i in range(x.shape[0]):
        loss = scale * nn.functional.cross_entropy(model(x[i:i + 1].double()), y[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, list(model.parameters())))
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in rows])
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    return {n: sum(f * r[k] for f, r in zip(factors, rows, strict=True)) for k, n in enumerate(names)}, norms


@pytest.mark.parametrize("inputs, scale, redo", [(1.0, 1.0, False), (1e20, 1.0, True), (1e-22, 1.0, True),
                                                 (1.0, 1e25, True), (1e-12, 7e19, True)],
                         ids=["ordinary", "huge activations", "tiny activations", "huge gradients",
                              "a bias's huge sum"])
@pytest.mark.parametrize("kind", MODELS)
def test_gram_norms_unscaled_then_settled(deferred, kind, inputs, scale, redo):
    torch.manual_seed(0)
    model = MODELS[kind]()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, 16, generator=g) * inputs, torch.randint(0, 3, (6,), generator=g)
    model.mix.weight.data /= inputs  # the first layer's input extreme, the rest of the network ordinary
    bound = 1.0

    def loss_fn(output, target):
        return scale * nn.functional.cross_entropy(output, target, reduction="sum")

    sums, norms = pv.clipped_grad_sum(model, loss_fn, x, y, bound, return_norms=True, verify=False)  # no check behind
    assert deferred and (max(deferred) > 0) == redo  # a layer computed again exactly where values are extreme
    deferred.clear()
    alone = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True, verify=False)
    assert deferred and (max(deferred) > 0) == redo
    want, want_norms = _loop(model, x, y, scale, bound)
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.stack([n.double() for n in alone.values()]).norm(dim=0), want_norms, rtol=1e-4,
                               atol=0)
    for name, w in want.items():
        torch.testing.assert_close(sums[name].double(), w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))
