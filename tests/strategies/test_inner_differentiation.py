"""A forward that differentiates inside itself (a force field: forces = -dE/dpos with create_graph=True, a
physics-informed network): the per-layer rules would see only the first-order uses of the parameters, so the
probe refuses ``hooks`` and ``torch_func`` hands over (its vmap cannot run ``autograd.grad``); ``auto`` gives the
loop's numbers (written here) with the check off, every other strategy those numbers or a clear refusal. Likewise a
forward that runs torch.vmap itself (an ensemble over stacked members' weights), whose parameter uses the probe's
function mode cannot see: never zeros or a wrong row for them."""

from __future__ import annotations

import pytest
import torch
from helpers import ref_grads
from torch import nn

import pergrad_viz as pv


class ForceField(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, pos):
        pos = pos if pos.requires_grad else pos.clone().requires_grad_(True)
        energy = self.b(torch.tanh(self.a(pos))).sum()
        return -torch.autograd.grad(energy, pos, create_graph=True)[0]  # (B, 3)


def _problem():
    torch.manual_seed(0)
    return ForceField().double(), torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)


@pytest.mark.parametrize("strategy", [*pv.STRATEGIES, "auto"])
def test_every_strategy_is_the_loop_or_refuses(strategy):
    model, pos, forces = _problem()
    loss_fn = nn.MSELoss(reduction="sum")
    want = ref_grads(model, loss_fn, pos, forces)
    try:
        got = pv.per_sample_grads(model, loss_fn, pos, forces, strategy=strategy, verify=False)
    except ValueError as e:
        assert strategy not in ("auto", "loop"), e
        assert "'auto'" in str(e) or "'loop'" in str(e)
        return
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12)


def test_the_derived_quantities_are_the_loops():
    model, pos, forces = _problem()
    loss_fn = nn.MSELoss(reduction="sum")
    rows = ref_grads(model, loss_fn, pos, forces)
    norms = torch.cat([g.flatten(1) for g in rows.values()], 1).norm(dim=1)
    factors = (0.3 / (norms + 1e-6)).clamp(max=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, pos, forces, verify=False), norms)
    clipped = pv.clipped_grad_sum(model, loss_fn, pos, forces, 0.3, verify=False)
    for name, g in rows.items():
        torch.testing.assert_close(clipped[name], torch.einsum("b,b...->...", factors, g))
    with pytest.raises(pv.UnsupportedModelError, match="differentiates inside itself"):
        pv.per_sample_grads(model, loss_fn, pos, forces, strategy="hooks")


class Ensemble(nn.Module):
    def __init__(self):
        super().__init__()
        self.members = nn.Parameter(torch.randn(3, 6, 4) * 0.3)
        self.head = nn.Linear(4, 3)

    def forward(self, h):
        z = torch.vmap(lambda w: torch.tanh(h @ w))(self.members)  # (members, B, 4)
        return self.head(z.mean(0))


def test_a_forward_running_vmap_over_its_parameters_is_the_loops():
    torch.manual_seed(0)
    model = Ensemble().double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    want = ref_grads(model, loss_fn, x, y)
    got = pv.per_sample_grads(model, loss_fn, x, y, verify=False)
    norms = pv.per_sample_grad_norms(model, loss_fn, x, y, verify=False)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1))
    with pytest.raises(pv.PlanMismatchError, match="inside torch.vmap"):
        pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False)
