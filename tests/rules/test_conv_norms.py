"""A convolution's ghost norms and weighted sums as book-keeping takes them, against per-sample weight gradients
written out in this test (one ``autograd.grad`` of sum(conv(x_i) * g_i) per sample, float64): the pixels' Gram
(``ConvGhost.direct_norms``) where taken, the im2col columns elsewhere; the weighted sum through the
convolution's own kernel and, on 1 x 1 maps, through the columns; every padding mode, stride and dilation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.derived.norms import ghost_squared_norms
from pergrad_viz.rules.conv import SMALL_MAP, ConvGhost, conv_weighted_sum, live_window

DT = torch.float64
B = 4


def _later(conv: nn.Module, **attributes) -> nn.Module:
    for name, value in attributes.items():
        setattr(conv, name, value)
    return conv

# (layer, input shape of one sample, the form its norms take: ConvGhost.direct_norms' pixels' Gram, or None: the
# im2col columns)
CONFIGS = {
    "2d-pad1": (lambda: nn.Conv2d(8, 8, 3, padding=1), (8, 3, 3), "pixels"),
    "2d-1x1-map": (lambda: nn.Conv2d(16, 6, 3, padding=1), (16, 1, 1), "pixels"),
    "2d-stride2": (lambda: nn.Conv2d(32, 8, 3, stride=2, padding=1), (32, 3, 3), "pixels"),
    "2d-stride2-columns": (lambda: nn.Conv2d(6, 8, 3, stride=2, padding=1), (6, 4, 4), None),  # the columns' Gram
    "2d-dilation-same-reflect": (lambda: nn.Conv2d(6, 6, 3, padding="same", dilation=2, padding_mode="reflect"),
                                 (6, 3, 3), "pixels"),
    "2d-even-kernel-same-circular": (lambda: nn.Conv2d(6, 5, (2, 3), padding="same", padding_mode="circular"),
                                     (6, 3, 2), "pixels"),
    "2d-asymmetric-replicate-nobias": (lambda: nn.Conv2d(5, 7, 3, padding=(1, 2), padding_mode="replicate",
                                                         bias=False), (5, 2, 3), "pixels"),
    "2d-1x1-kernel": (lambda: nn.Conv2d(8, 8, 1), (8, 2, 2), "pixels"),
    # many channels: the pixels' Gram padded, not the input (asymmetric: the two spatial dimensions' pads apart)
    "2d-many-channels-asymmetric-pad": (lambda: nn.Conv2d(64, 4, 3, padding=(1, 2)), (64, 3, 4), "pixels"),
    "1d-stride-dilation": (lambda: nn.Conv1d(6, 8, 3, stride=2, padding=2, dilation=2), (6, 5), "pixels"),
    "1d-same-reflect": (lambda: nn.Conv1d(6, 6, 4, padding="same", padding_mode="reflect"), (6, 4), "pixels"),
    "2d-large-map": (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 6, 6), None),  # each sample's gradient
    "2d-large-map-dilation-reflect": (lambda: nn.Conv2d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"),
                                      (2, 6, 5), None),
    "1d-large-map-same-circular": (lambda: nn.Conv1d(2, 3, 3, padding="same", padding_mode="circular"), (2, 12),
                                   None),
    "2d-large-map-stride2-rgb": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (3, 8, 8), None),
    "2d-large-map-stride2": (lambda: nn.Conv2d(5, 2, 3, stride=2, padding=1), (5, 12, 12), None),
    # taps that read only zero padding at every output position (live_window crops them away)
    "2d-2x2-map-stride2-dead-taps": (lambda: nn.Conv2d(8, 6, 3, stride=2, padding=1), (8, 2, 2), None),
    "2d-dilated-dead-rows": (lambda: nn.Conv2d(4, 5, 3, padding=2, dilation=2), (4, 1, 3), None),
    "2d-asymmetric-dead-taps-nobias": (lambda: nn.Conv2d(5, 4, (3, 5), padding=(1, 3), bias=False), (5, 1, 1),
                                       "pixels"),
    "1d-dead-taps": (lambda: nn.Conv1d(6, 4, 5, padding=3), (6, 1), "pixels"),
    "1d-stride3-dead-taps": (lambda: nn.Conv1d(3, 4, 4, stride=3, padding=2), (3, 2), None),
    # padding and dilation set after construction (a stem changed by hand): the forward reads them afresh, except
    # with a padding mode other than zeros, where it pads by the amounts of its construction
    "2d-padding-dilation-set-later": (lambda: _later(nn.Conv2d(4, 5, 3), padding=(2, 1), dilation=(2, 1)),
                                      (4, 3, 4), "pixels"),
    "2d-large-map-padding-set-later": (lambda: _later(nn.Conv2d(2, 3, 3, stride=3), padding=(1, 1)), (2, 6, 6),
                                       None),
    "2d-same-dilation-set-later": (lambda: _later(nn.Conv2d(3, 3, 3, padding="same"), dilation=(2, 2)), (3, 5, 5),
                                   None),
    "1d-reflect-padding-set-later": (lambda: _later(nn.Conv1d(3, 4, 3, padding=1, padding_mode="reflect"),
                                                    padding=(2,)), (3, 5), "pixels"),
    # a weight replaced by one of another kernel size (kernel_size then stale: the forward reads the weight)
    "2d-kernel-replaced-larger": (lambda: _later(nn.Conv2d(2, 4, 3), weight=nn.Parameter(torch.randn(4, 2, 5, 5))),
                                  (2, 7, 7), "pixels"),
    "1d-kernel-replaced-by-1": (lambda: _later(nn.Conv1d(3, 4, 3), weight=nn.Parameter(torch.randn(4, 3, 1))),
                                (3, 5), None),
}
DEAD_TAPS = [name for name in CONFIGS if "dead" in name or name == "2d-1x1-map"]


def _case(name: str, seed: int = 0):
    make, shape, _ = CONFIGS[name]
    torch.manual_seed(seed)
    conv = make().to(DT)
    x = torch.randn(B, *shape, dtype=DT)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    return conv, x, g


def _per_sample(conv: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: (B, *shape)}: the gradient of sum(conv(x_i) * g_i) for each sample alone."""
    params = dict(conv.named_parameters())
    rows = {n: [] for n in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad((conv(x[i:i + 1]) * g[i:i + 1]).sum(), list(params.values()))
        for n, t in zip(params, grads, strict=True):
            rows[n].append(t)
    return {n: torch.stack(r) for n, r in rows.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_conv_norms_equal_the_per_sample_gradients(name):
    conv, x, g = _case(name)
    form = CONFIGS[name][2]
    assert (ConvGhost.direct_bytes(conv, [(x, g)]) is not None) is (form is not None)
    local = {n: n for n, _ in conv.named_parameters()}
    got = ghost_squared_norms(ConvGhost, conv, [(x, g)], local)
    want = _per_sample(conv, x, g)
    for n in local:
        torch.testing.assert_close(got[n], want[n].flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["2d-pad1", "2d-large-map"])  # the pixels' Gram, the columns
def test_norms_of_huge_samples_are_finite_and_right(name):
    conv, x, g = _case(name, seed=1)
    x, g = x.float(), g.float()
    conv = conv.float()
    x[0] *= 1e20
    g[0] *= 1e-15  # the plain squares of x overflow float32; the norm does not
    local = {"weight": "weight", "bias": "bias"}
    got = ghost_squared_norms(ConvGhost, conv, [(x, g)], local)
    want = _per_sample(conv.double(), x.double(), g.double())
    for n in local:
        assert torch.isfinite(got[n]).all()
        torch.testing.assert_close(got[n].double(), want[n].flatten(1).square().sum(1), rtol=1e-4, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_conv_weighted_sum_is_the_sum_of_scaled_per_sample_gradients(name):
    conv, x, g = _case(name, seed=2)
    c = torch.rand(B, dtype=DT)
    out = {n: torch.zeros_like(p) for n, p in conv.named_parameters()}
    conv_weighted_sum(conv, [(x, g)], dict.fromkeys(out, c), out)
    want = _per_sample(conv, x, g)
    for n, total in out.items():
        torch.testing.assert_close(total, torch.einsum("b,b...->...", c, want[n]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_live_window_crops_exactly_the_taps_that_read_only_padding(name):
    conv, x, g = _case(name)
    _, kernel, taps = live_window(conv, x, g.shape[2:])
    kernel_shape = tuple(conv.weight.shape[2:])  # the weight's (kernel_size is stale where it was replaced)
    full = (1, *kernel_shape) if isinstance(conv, nn.Conv1d) else kernel_shape
    # a tap is dead where its per-sample gradient is zero for every input (here: every sample of random x and g)
    want = _per_sample(conv, x, g)["weight"].abs().sum((0, 1, 2)).reshape(full) != 0
    live = torch.zeros(full, dtype=torch.bool)
    live[(slice(None), slice(None)) if taps is None else taps] = True
    assert (taps is not None) is (name in DEAD_TAPS)
    assert torch.equal(live, want), (live, want)
    assert taps is None or kernel == tuple(t.stop - t.start for t in taps)


def test_both_weighted_sum_routes_are_tested():
    maps = {name: _case(name)[2][0, 0].numel() for name in CONFIGS}
    assert min(maps.values()) <= SMALL_MAP < max(maps.values())


def test_clipped_sum_of_a_small_cnn_equals_the_loop():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                          nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.Flatten(),
                          nn.Linear(8 * 2 * 2, 3)).to(DT)
    x, y = torch.randn(6, 3, 4, 4, dtype=DT), torch.tensor([0, 1, 2, 0, 1, 2])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    got = pv.clipped_grad_sum(model, loss_fn, x, y, 0.05, strategy="hooks")
    params = dict(model.named_parameters())
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(6):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), list(params.values()))
        norm = torch.sqrt(sum(t.square().sum() for t in grads))
        factor = min(1.0, 0.05 / (float(norm) + 1e-6))
        for n, t in zip(params, grads, strict=True):
            want[n] += factor * t
    for n in params:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-10)


# The pixels' Gram taken whatever its cost (direct_norms called here), where the window of the taps is made of
# padding on one side, on both, or only (no tap reads an input value: stride 3 over 2 padded positions, 7 over 3)
ODD_WINDOWS = {
    "padding-both-sides-stride3": (lambda: nn.Conv2d(3, 4, 1, stride=3, padding=2), (3, 1, 1)),
    "padding-only": (lambda: nn.Conv2d(3, 4, 1, stride=7, padding=3), (3, 1, 1)),
    "one-dim-padding-only": (lambda: nn.Conv2d(3, 4, (1, 3), stride=(7, 1), padding=(3, 1)), (3, 1, 4)),
    "1d-padding-only": (lambda: nn.Conv1d(3, 4, 1, stride=7, padding=3), (3, 1)),
    "right-padding-unread": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=2), (3, 4, 5)),
}


@pytest.mark.parametrize("name", list(ODD_WINDOWS))
def test_pixels_gram_of_windows_made_of_padding(name):
    make, shape = ODD_WINDOWS[name]
    torch.manual_seed(4)
    conv = make().to(DT)
    x = torch.randn(B, *shape, dtype=DT)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    got = ConvGhost.direct_norms(conv, [(x, g)], {"weight": "weight"})["weight"]
    want = _per_sample(conv, x, g)["weight"].flatten(1).square().sum(1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
