"""PyTorch 2.14 batches torch.cdist's backward wrongly where a vmap over the samples holds a backward batched over
output vectors (vmap of jacrev): torch_func's Jacobian, and the per-layer fallback's inside hooks'. Each level alone is
right. pergrad_viz.engine.cotangents tries the strategy's own Jacobian on two samples together and alone, once per
plan: the wrong strategies hand over, so that every Jacobian and NTK equals the loop here (each sample and output
alone, in this file) even with verify=False; where the nesting is right, nothing changes."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, ref_jacobian
from torch import nn

import pergrad_viz as pv
from pergrad_viz.errors import HandOverError


class Prototypes(nn.Module):
    """Distances to learnt prototypes (a prototype network / RBF head): ``c`` is used in the root's own forward,
    which takes the per-layer fallback."""

    def __init__(self, prototypes: int = 2):
        super().__init__()
        self.embed = nn.Linear(4, 3)
        self.c = nn.Parameter(torch.randn(prototypes, 3))

    def forward(self, x):
        h = self.embed(x)[:, None]  # (B, 1, 3)
        return torch.cdist(h, self.c[None].expand(x.shape[0], -1, -1))[:, 0]  # (B, prototypes)


def _problem():
    torch.manual_seed(0)
    return Prototypes().double(), torch.randn(5, 4, dtype=torch.float64)


@pytest.mark.parametrize("verify", [True, False])
def test_auto_jacobian_through_cdist_equals_the_loop(verify):
    model, x = _problem()
    for _ in range(2):  # the trial's finding is kept: the second call too
        assert_dict_close(pv.per_sample_jacobian(model, x, verify=verify), ref_jacobian(model, x),
                          rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["hooks", "torch_func"])
def test_the_nesting_strategies_refuse_naming_the_fix(strategy):
    model, x = _problem()
    with pytest.raises(HandOverError, match=r"torch\.cdist.*strategy='auto' or 'loop'"):
        pv.per_sample_jacobian(model, x, strategy=strategy, verify=False)


def test_ntk_through_cdist_equals_the_loop():
    model, x = _problem()
    jac = ref_jacobian(model, x)
    flat = torch.cat([j.reshape(5, 2, -1) for j in jac.values()], dim=2)
    want = torch.einsum("iyp,jzp->ijyz", flat, flat)
    torch.testing.assert_close(pv.empirical_ntk(model, x, verify=False), want, rtol=1e-9, atol=1e-12)


def test_where_the_nesting_is_right_torch_func_still_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    got = pv.per_sample_jacobian(model, x, strategy="torch_func", verify=False)
    assert_dict_close(got, ref_jacobian(model, x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("norm", [lambda: nn.GroupNorm(8, 8), lambda: nn.InstanceNorm2d(8, affine=True)])
def test_float32_rounding_of_a_zero_jacobian_is_no_wrong_nesting(norm):
    """Found by a probe: a conv's bias before a GroupNorm / InstanceNorm has a Jacobian of exactly 0, float32 noise of
    3e-7 beside a whole Jacobian of 10, unlike alone and together: torch_func was refused as PyTorch's wrong batching
    rule (its result as close to float64 as the float32 loop's). The cdist case above is still caught in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm(), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    x = torch.randn(4, 3, 6, 6)
    got = pv.per_sample_jacobian(model, x, strategy="torch_func", flat=True)
    want = pv.per_sample_jacobian(model.double(), x.double(), strategy="loop", flat=True)
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
    cdist, near = Prototypes().float(), torch.randn(5, 4)
    with pytest.raises(HandOverError, match=r"torch\.cdist"):
        pv.per_sample_jacobian(cdist, near, strategy="torch_func", verify=False)


class _BesideALargeBranch(nn.Module):
    """Prototypes on normalised pixels beside a linear branch on the raw 0..255 ones (a large Jacobian)."""

    def __init__(self, features: int = 3 * 64 * 64):
        super().__init__()
        self.embed, self.c, self.side = nn.Linear(features, 3), nn.Parameter(torch.randn(2, 3)), nn.Linear(features, 2)

    def forward(self, x):
        h = self.embed(x / 255)[:, None]
        return torch.cdist(h, self.c[None].expand(x.shape[0], -1, -1))[:, 0] + self.side(x)


def test_a_large_branch_elsewhere_does_not_cover_a_wrong_batching_rule():
    """Found by a review: the rounding allowed was the whole model's Jacobian's, so a branch on raw pixels beside the
    prototypes let the wrong cdist batching rule through (auto's prototype rows 100% off, verify=False)."""
    torch.manual_seed(0)
    model, x = _BesideALargeBranch(), torch.rand(5, 3 * 64 * 64) * 255
    twin = _BesideALargeBranch()
    twin.load_state_dict(model.state_dict())
    want = pv.per_sample_jacobian(twin.double(), x.double(), strategy="loop")["c"]
    got = pv.per_sample_jacobian(model, x, verify=False)["c"]
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
    with pytest.raises(HandOverError, match=r"torch\.cdist"):
        pv.per_sample_jacobian(model, x, strategy="torch_func", verify=False)


class _RootBias(nn.Module):
    """A per-channel bias directly on the root before GroupNorm(8, 8), which removes it: a layer alone, Jacobian 0."""

    def __init__(self):
        super().__init__()
        self.conv, self.b = nn.Conv2d(3, 8, 3, bias=False), nn.Parameter(torch.randn(8, 1, 1))
        self.gn, self.fc = nn.GroupNorm(8, 8), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(self.gn(self.conv(x) + self.b).flatten(1))


@pytest.mark.parametrize("strategy", ["torch_func", "hooks"])
def test_a_zero_jacobian_alone_in_its_layer_is_settled_in_float64(strategy):
    """Found by a review: with the rounding floor of the parameter's own layer, a bias that is a layer alone had a
    floor of 0, and its float32 noise was called PyTorch's wrong batching rule; a difference in float32 is now settled
    on a float64 copy (cdist's wrong rule is wrong there too: the tests above)."""
    torch.manual_seed(0)
    model, x = _RootBias(), torch.randn(4, 3, 8, 8)
    twin = _RootBias()
    twin.load_state_dict(model.state_dict())
    want = pv.per_sample_jacobian(twin.double(), x.double(), strategy="loop", flat=True)
    got = pv.per_sample_jacobian(model, x, strategy=strategy, flat=True, verify=False)
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
