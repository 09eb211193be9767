"""A Linear on tokens whose terms cancel: the Gram form of its ghost norm, sum_{t,s} (a_t . a_s)(g_t . g_s), in
float32 lost every digit (norms 0 and 32 for 3-5) where the tokens share a large part and their output gradients
cancel; such samples are computed again in float64 (rules.linear.cancelling), at once on a CPU, after the one read
on the path a GPU takes (rules.doubts, forced here). Norms and clipped sums against a loop written here in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.rules import doubts

B, T, D = 4, 4, 64


class _Cancelling(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # x (B, T, D): the tokens' contributions with alternating signs
        sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=x.dtype)
        return (self.lin(x) * sign[None, :, None]).sum(1)


def _loss(output, target):
    return (output * target).sum()


def _loop(model, x, t, bound):
    """((B,) norms, clipped sum {name: tensor}) of a float64 copy, one backward per sample."""
    model = copy.deepcopy(model).double()
    names = [n for n, _ in model.named_parameters()]
    rows = [torch.autograd.grad(_loss(model(x[i:i + 1].double()), t[i:i + 1].double()), list(model.parameters()))
            for i in range(x.shape[0])]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in rows])
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    return norms, {n: sum(f * r[k] for f, r in zip(factors, rows, strict=True)) for k, n in enumerate(names)}


@pytest.mark.parametrize("path", ["cpu", "deferred"])
def test_cancelling_tokens_norms_and_clipped_sum_equal_the_loop(monkeypatch, path):
    if path == "deferred":
        monkeypatch.setattr(doubts, "ON_CPU", True)
    torch.manual_seed(0)
    model = _Cancelling()
    x = (torch.randn(1, 1, D) * 30).expand(B, T, D) + 1e-3 * torch.randn(B, T, D)  # a large part shared
    t = torch.randn(B, D) * 30
    norms, sums = _loop(model, x, t, 1.0)
    got = pv.per_sample_grad_norms(model, _loss, x, t, verify=False)
    torch.testing.assert_close(got.double(), norms, rtol=1e-4, atol=0)
    clipped = pv.clipped_grad_sum(model, _loss, x, t, 1.0, verify=False)
    for name, want in sums.items():  # the float32 products' own rounding (the float32 loop's rows: 6e-4)
        torch.testing.assert_close(clipped[name].double(), want, rtol=0, atol=3e-3 * want.abs().max().item())


class _CancellingPixels(nn.Module):
    """A convolution whose positions share a large part of their input and whose output gradients alternate in sign
    (its norm from the pixels' Gram: positions^2 below the weight's size)."""

    def __init__(self, two_d: bool, padding: int | tuple[int, int] = 0):
        super().__init__()
        self.two_d = two_d
        self.conv = nn.Conv2d(32, 32, 1, padding=padding) if two_d else nn.Conv1d(64, 64, 1)

    def forward(self, x):
        out = self.conv(x).flatten(2)
        sign = torch.tensor([1.0, -1.0], dtype=x.dtype).repeat(out.shape[-1] // 2)  # alternating over the positions
        return (out * sign).sum(-1)


@pytest.mark.parametrize("path", ["cpu", "deferred"])
@pytest.mark.parametrize("two_d", [False, True], ids=["conv1d", "conv2d"])
def test_cancelling_pixels_norms_and_clipped_sum_equal_the_loop(monkeypatch, path, two_d):
    """Found by a probe: the same cancellation in a convolution's pixel Gram gave norms [0, 2, 3.5, 0] for 0.2-0.26
    (verify=False), and with the default check 15 of 16 fresh models kept a wrong norm for one sample of 8."""
    if path == "deferred":
        monkeypatch.setattr(doubts, "ON_CPU", True)
    torch.manual_seed(0)
    model = _CancellingPixels(two_d)
    channels, positions = (32, (2, 2)) if two_d else (64, (4,))
    shared = torch.randn(1, channels, *(1,) * len(positions)) * 30  # the same at every position
    x = shared.expand(B, channels, *positions) + 1e-3 * torch.randn(B, channels, *positions)
    t = torch.randn(B, channels)
    norms, sums = _loop(model, x, t, 0.1)
    got = pv.per_sample_grad_norms(model, _loss, x, t, verify=False)
    torch.testing.assert_close(got.double(), norms, rtol=1e-4, atol=0)
    clipped = pv.clipped_grad_sum(model, _loss, x, t, 0.1, verify=False)
    for name, want in sums.items():
        torch.testing.assert_close(clipped[name].double(), want, rtol=0, atol=3e-3 * want.abs().max().item())


class _TiedCancelling(nn.Module):
    """One weight in two Linears whose uses nearly undo each other: W x - W (x + shift)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
        self.l2.weight = self.l1.weight
        self.register_buffer("shift", 1e-3 * torch.randn(16))

    def forward(self, x):
        return (self.l1(x) - self.l2(x + self.shift)).flatten(1)


@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "tokens"])
def test_a_tied_weight_whose_uses_cancel_equals_the_loop(tokens):
    """Found by a probe: the tied norm ||A||^2 + ||B||^2 + 2 <A, B> in float32 kept only rounding (norms 0.35 and
    1.4 for 0.05, the clipped sum 95% off, verify=False)."""
    torch.manual_seed(0)
    model = _TiedCancelling()
    x = 30 * torch.randn(B, 1, 16) + 1e-3 * torch.randn(B, 5, 16) if tokens else 30 * torch.randn(B, 16)
    t = torch.randn(B, 40 if tokens else 8)
    norms, sums = _loop(model, x, t, 0.02)
    got = pv.per_sample_grad_norms(model, _loss, x, t, verify=False)
    torch.testing.assert_close(got.double(), norms, rtol=2e-3, atol=0)  # the float32 inputs' own rounding: 8e-4
    clipped = pv.clipped_grad_sum(model, _loss, x, t, 0.02, verify=False)
    for name, want in sums.items():
        torch.testing.assert_close(clipped[name].double(), want, rtol=0, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_ordinary_tokens_are_not_computed_again(dtype):
    """The guard's false alarms cost a float64 pass: none on ordinary data, and none at all below float32 (where
    the threshold, in the dtype's own rounding, would flag every sample: a bfloat16 model's every layer again)."""
    from pergrad_viz.core.numbers import row_dots
    from pergrad_viz.rules.linear import cancelling

    torch.manual_seed(0)
    a, g = torch.randn(8, 32, 64).to(dtype), torch.randn(8, 32, 64).to(dtype)
    aa, gg = torch.bmm(a, a.mT), torch.bmm(g, g.mT)
    weight = row_dots(aa.flatten(1), gg.flatten(1))
    assert not cancelling(weight, aa, gg, 64, 64).any()


@pytest.mark.parametrize("path", ["cpu", "deferred"])
@pytest.mark.parametrize("layer", ["linear", "conv1d", "conv2d", "conv2d-padded"])
def test_float64_terms_that_cancel_are_computed_again(monkeypatch, path, layer):
    """Found by a probe: float64 had no guard, and a Gram norm squares what cancels: tokens sharing a part 1e8 times
    their differences left a norm of 0 for 1.1e4 (that sample not clipped: a clipped sum of norm 1e4 where B C = 4),
    a convolution's 7.7e4 for 2.9e4. Now such samples are computed again from their gradients, formed in float64."""
    if path == "deferred":
        monkeypatch.setattr(doubts, "ON_CPU", True)
    torch.manual_seed(0)
    # conv2d-padded: columns of zeros beside the pixels (padding (0, 1)), which the float64 pass pads again
    padding = (0, 1) if layer == "conv2d-padded" else 0
    model = (_Cancelling() if layer == "linear" else _CancellingPixels("2d" in layer, padding)).double()
    shape = (B, T, D) if layer == "linear" else (B, 32, 2, 2) if "2d" in layer else (B, 64, 4)
    shared = torch.randn(1, 1, D) if layer == "linear" else torch.randn(1, shape[1], *(1,) * (len(shape) - 2))
    x = shared.double().expand(*shape) * 1e4 + 1e-4 * torch.randn(*shape, dtype=torch.float64)  # the same part
    t = torch.randn(B, shape[-1] if layer == "linear" else shape[1], dtype=torch.float64)
    norms, sums = _loop(model, x, t, 1.0)
    got = pv.per_sample_grad_norms(model, _loss, x, t, verify=False)
    torch.testing.assert_close(got, norms, rtol=1e-6, atol=0)
    clipped, got = pv.clipped_grad_sum(model, _loss, x, t, 1.0, verify=False, return_norms=True)
    torch.testing.assert_close(got, norms, rtol=1e-6, atol=0)
    for name, want in sums.items():
        torch.testing.assert_close(clipped[name], want, rtol=1e-6, atol=1e-8 * want.abs().max().item())


def test_a_float64_tied_weight_whose_uses_cancel_equals_the_loop():
    """Found by a probe: the tied weight's guard was float32's alone, and in float64 two uses of one weight that nearly
    undo each other (each 1e9 times their sum) gave norms [128, 0, 181] for [9.9, 2.0, 8.1], the clipped sum 94% off.
    Now flagged in float64 too and formed from the gradient itself (nothing wider to compute the factors in)."""
    torch.manual_seed(0)
    model = _TiedCancelling().double()
    with torch.no_grad():
        model.shift.mul_(1e-9 / 1e-3)  # the second use's input 1e-9 away from the first's
    x = torch.randn(B, 16, dtype=torch.float64)
    t = torch.randn(B, 8, dtype=torch.float64) * 1e9
    norms, sums = _loop(model, x, t, 1.0)
    got = pv.per_sample_grad_norms(model, _loss, x, t, verify=False)
    torch.testing.assert_close(got, norms, rtol=1e-6, atol=0)
    clipped = pv.clipped_grad_sum(model, _loss, x, t, 1.0, verify=False)
    for name, want in sums.items():
        torch.testing.assert_close(clipped[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_tied_weights_gradient_formed_from_its_parts():
    """``rules.linear.gradient_squared_norms``: rows a block at a time, one-hot parts (an Embedding's ids, a
    gradient's own rows) and factor parts (a Linear's), against the per-sample gradients summed here."""
    from pergrad_viz.derived import tied
    from pergrad_viz.rules import linear

    torch.manual_seed(0)
    ids = torch.randint(0, 7, (3, 5))
    emb_g = torch.randn(3, 5, 4, dtype=torch.float64)
    head_g, head_a = torch.randn(3, 6, 7, dtype=torch.float64), torch.randn(3, 6, 4, dtype=torch.float64)
    dense = torch.randn(3, 7, 4, dtype=torch.float64)
    parts = [(ids, emb_g, None), (head_g, head_a, None), tied.dense_part(dense, None)]
    want = torch.zeros(3, 7, 4, dtype=torch.float64)
    for b in range(3):
        want[b].index_add_(0, ids[b], emb_g[b])
    want += head_g.mT @ head_a + dense
    expected = want.square().sum((1, 2))
    for step in (8, 200):  # a block of one row, all rows at once
        with pytest.MonkeyPatch.context() as m:
            m.setattr(linear, "EXPLICIT_BYTES", step)
            picked = [(left[[2, 0]], right[[2, 0]]) for left, right, _ in parts]
            torch.testing.assert_close(linear.gradient_squared_norms(picked), expected[[2, 0]])
