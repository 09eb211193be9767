"""A layer of zero width (nn.Linear(4, 0), nn.Embedding(5, 0), or one fed no features, nn.Linear(0, 3)): every
quantity equals the plain loop of tests/helpers.py (its empty gradients empty, its bias's as any other), where the
positions' reshape ``(B, -1, 0)`` was ambiguous (a raw RuntimeError from the norms, the clipped sum, the hooks)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import flatten_ref, ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv

TOL = {"rtol": 1e-10, "atol": 1e-12}


class ZeroWidth(nn.Module):
    """An empty output layer, a layer fed no features (each called twice) and an embedding of no dimensions beside
    the usual path; on (B, 4) or (B, T, 4)."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
            self.empty_out = nn.Linear(4, 0)
            self.empty_in = nn.Linear(0, 3)
            self.empty_embedding = nn.Embedding(5, 0)
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x) + self.empty_in(x[..., :0]) + self.empty_in(2 * x[..., :0]))  # called twice
        h = h + self.empty_out(x).sum(-1, keepdim=True) + self.empty_out(-x).sum(-1, keepdim=True)
        ids = (x[..., :2] > 0).long()  # (B, [T,] 2)
        h = h + self.empty_embedding(ids).sum((-1, -2)).unsqueeze(-1)
        h = h.mean(1) if h.dim() == 3 else h
        return self.head(h)


@pytest.fixture(params=[(6, 4), (6, 3, 4)], ids=["rows", "tokens"])
def problem(request):
    torch.manual_seed(0)
    model = ZeroWidth().double()
    x = torch.randn(*request.param, dtype=torch.float64)
    y = torch.randint(0, 2, (request.param[0],))
    return model, nn.CrossEntropyLoss(reduction="sum"), x, y


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_grads_norms_and_clipped_sum_equal_the_loop(problem, strategy):
    model, loss_fn, x, y = problem
    want = ref_grads(model, loss_fn, x, y)
    got = pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **TOL)
    flat, out = flatten_ref(want, 1), torch.empty(x.shape[0], sum(g[0].numel() for g in want.values()),
                                                  dtype=torch.float64)
    torch.testing.assert_close(pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, flat=True), flat, **TOL)
    assert pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, flat=True, out=out) is out
    torch.testing.assert_close(out, flat, **TOL)
    norms = flatten_ref(want, 1).norm(dim=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy), norms, **TOL)
    factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    summed = pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, strategy=strategy)
    clipped, _ = pv.clip_per_sample(got, 1.0)  # the materialised route
    for name, g in want.items():
        torch.testing.assert_close(summed[name], torch.einsum("b,b...->...", factors, g), **TOL)
        torch.testing.assert_close(clipped[name], factors.view(-1, *(1,) * (g.dim() - 1)) * g, **TOL)


def test_jacobian_equals_the_loop(problem):
    model, _, x, _ = problem
    want = ref_jacobian(model, x)
    got = pv.per_sample_jacobian(model, x, strategy="hooks")
    for name, j in want.items():
        torch.testing.assert_close(got[name], j, **TOL)
