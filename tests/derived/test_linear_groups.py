"""On a CPU book-keeping takes the Gram norms of its Linear maps together after the backward
(``rules/linear_batch.py``: one buffer per token count, one range read, one cancellation guard); a layer whose values
are extreme (squares past float32's range, or lost to underflow) is handed to the Linear rule alone, scaled there.
Clipped sums and norms against a loop written here: per-sample gradients of a float64 copy, one backward each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.derived import bookkeeping
from pergrad_viz.rules.linear import LinearGhost


class Tokens(nn.Module):
    """Three Linears of three shapes over 4 tokens (their Gram form), a mean over the tokens, a head."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(16, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.down(torch.tanh(self.up(torch.tanh(self.mix(x))))).mean(1))


def _loop(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, bound: float):
    """(clipped sum {name: tensor}, (B,) norms) in float64, one backward per sample."""
    model = model.double()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1].double()), y[i:i + 1]), params)
            for i in range(x.shape[0])]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in rows])
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    return {n: sum(f * r[k] for f, r in zip(factors, rows, strict=True)) for k, n in enumerate(names)}, norms


@pytest.fixture
def spied(monkeypatch):
    """{"together": [how many Linear calls each group of norms took], "alone": [T of each Linear rule's own call]}."""
    seen = {"together": [], "alone": []}
    together, alone = bookkeeping.linear_gram_norms, LinearGhost.squared_norms

    def linear_gram_norms(calls):
        seen["together"].append(len(calls))
        return together(calls)

    def squared_norms(module, a, g, local):
        seen["alone"].append(a.shape[1])
        return alone(module, a, g, local)

    monkeypatch.setattr(bookkeeping, "linear_gram_norms", linear_gram_norms)
    monkeypatch.setattr(LinearGhost, "squared_norms", staticmethod(squared_norms))
    return seen


@pytest.mark.parametrize("inputs, scale, redo", [(1.0, 1.0, False), (1e20, 1.0, True), (1e-22, 1.0, True),
                                                 (1.0, 1e25, True), (1e-12, 7e19, True), (1e-12, 1e-12, True)],
                         ids=["ordinary", "huge activations", "tiny activations", "huge gradients",
                              "a bias's huge sum", "tiny activations and gradients"])
def test_linear_norms_taken_together_equal_the_loop(spied, inputs, scale, redo):
    torch.manual_seed(0)
    model = Tokens()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, 16, generator=g) * inputs, torch.randint(0, 3, (6,), generator=g)
    model.mix.weight.data /= inputs  # the first layer's input extreme, the rest of the network ordinary

    def loss_fn(output, target):
        return scale * nn.functional.cross_entropy(output, target, reduction="sum")

    sums, norms = pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, return_norms=True, verify=False)  # no check behind
    assert spied["together"] == [3]  # mix, up and down; the head (one token) alone
    assert bool([t for t in spied["alone"] if t > 1]) == redo  # the extreme layer computed again, scaled
    want, want_norms = _loop(model, loss_fn, x, y, 1.0)
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-4, atol=0)
    for name, w in want.items():
        torch.testing.assert_close(sums[name].double(), w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linears_of_two_token_counts_and_frozen_weights(spied, dtype):
    """Two token counts (two groups), a Linear whose weight is frozen (its bias alone: the rule's own way)."""

    class TwoLengths(nn.Module):
        def __init__(self):
            super().__init__()
            self.short, self.long, self.bias_only = nn.Linear(16, 16), nn.Linear(16, 24), nn.Linear(16, 16)
            self.bias_only.weight.requires_grad_(False)
            self.head = nn.Linear(40, 3)

        def forward(self, x):
            short = self.bias_only(torch.tanh(self.short(x[:, :4]))).mean(1)
            return self.head(torch.cat([short, self.long(x).mean(1)], 1))

    model, loss_fn, x, y, sums, norms = _half_bound(TwoLengths, 2, 16, dtype)
    assert spied["together"] == [2]
    _agrees(model, loss_fn, x, y, sums, norms)


def _half_bound(build, seed: int, width: int, dtype: torch.dtype):
    """(model, loss_fn, x (5, 6, width), y, clipped sums, norms) of ``build()`` at max_norm 0.5, unchecked."""
    torch.manual_seed(0)
    model = build().to(dtype)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, width, generator=g, dtype=dtype), torch.randint(0, 3, (5,), generator=g)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    sums, norms = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, return_norms=True, verify=False)
    return model, loss_fn, x, y, sums, norms


def _agrees(model, loss_fn, x, y, sums, norms) -> None:
    want, want_norms = _loop(model, loss_fn, x, y, 0.5)
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-5, atol=0)
    assert set(sums) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(sums[name].double(), w, rtol=1e-5, atol=1e-6)


class SharedInput(nn.Module):
    """Query, key and value maps reading one tensor (BERT's self-attention), a fourth Linear on a copy of it."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(32, 24), nn.Linear(32, 24), nn.Linear(32, 28)
        self.apart = nn.Linear(32, 24)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = torch.tanh(x)
        q, k, v = self.query(h), self.key(h), self.value(h)
        scores = torch.softmax(q @ k.mT, -1)
        return self.head((scores @ v[..., :24] + self.apart(h.clone())).mean(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_input_read_by_several_linears_has_its_gram_taken_once(spied, monkeypatch, dtype):
    """The Gram of a tensor read by query, key and value is formed once (two products fewer), a copy of it (another
    tensor, same values) has its own; the norms and sums those of the loop."""
    products = []
    bmm = torch.bmm

    def counting(a, b, *args, **kwargs):
        products.append(a.shape)
        return bmm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "bmm", counting)
    model, loss_fn, x, y, sums, norms = _half_bound(SharedInput, 3, 32, dtype)
    assert spied["together"] == [4]
    assert len(products) == 4 + 2  # four output-gradient Grams, two input Grams (the shared one and the copy's)
    monkeypatch.setattr(torch, "bmm", bmm)
    _agrees(model, loss_fn, x, y, sums, norms)
